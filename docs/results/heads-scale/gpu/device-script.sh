#!/usr/bin/env bash
# One epoch of training/configs/scale.json on a lent GPU (Clover and Medusa side by side), stopped at DEADLINE s
# with whatever steps fit, annealed in a decay branch; heads packed into $OUT.
set -u
T0=$(date +%s); DEADLINE=${DEADLINE:-400}
export PYTHONUNBUFFERED=1 CLOVER_CACHE_DIR=/root/clover-cache
el() { echo $(( $(date +%s) - T0 )); }
D=outputs/dev3
cat /root/stash/p1 /root/stash/p2 $D/p3 > /root/demo.gguf && md5sum /root/demo.gguf
python3 -m pip install -q --no-deps $D/gguf-0.19.0-py3-none-any.whl 2>&1 | tail -1
mkdir -p outputs/data/sharegpt && gunzip -c $D/tt.jsonl.gz > outputs/data/sharegpt/teacher_train.jsonl
python3 - <<'PY'
from pathlib import Path
from clover.demo import _convert_gguf, cache_root, DEMO_NAME
out = cache_root() / DEMO_NAME
out.mkdir(parents=True, exist_ok=True)
_convert_gguf(Path("/root/demo.gguf"), out)
from clover.target import load_target, target_fingerprint
print("fingerprint", target_fingerprint(load_target(out)))
PY
echo "setup done at $(el) s"
mkdir -p /root/runs
python3 training/train.py --config $D/device.json --no-progress > /root/runs/clover.log 2>&1 &
P1=$!
python3 training/train.py --config $D/device.json --method medusa --token-path residual --feature-layers "" \
    --output /root/runs/medusa --no-progress > /root/runs/medusa.log 2>&1 &
P2=$!
while [[ $(el) -lt $DEADLINE ]] && { kill -0 $P1 2>/dev/null || kill -0 $P2 2>/dev/null; }; do sleep 3; done
kill $P1 $P2 2>/dev/null; wait
echo "training stopped at $(el) s"; tail -n 2 /root/runs/clover/train_log.jsonl /root/runs/medusa/train_log.jsonl
for m in clover medusa; do
  run=/root/runs/$m
  if [[ -f $run/training_summary.json ]]; then heads=$run; else
    heads=/root/runs/$m-branch
    timeout 100 python3 training/decay_branch.py $run --output $heads --no-progress > /root/runs/$m-branch.log 2>&1 &
  fi
  echo "$m -> $heads"
done
wait
echo "branches done at $(el) s"
for m in clover medusa; do
  heads=/root/runs/$m; [[ -f $heads/training_summary.json ]] || heads=/root/runs/$m-branch
  tar czf $OUT/$m.tgz --exclude train_state.pt -C $(dirname $heads) $(basename $heads)
  cp /root/runs/$m.log $OUT/$m-train.log 2>/dev/null
done
tail -5 /root/runs/*-branch.log 2>/dev/null
ls -la $OUT; nvidia-smi --query-gpu=name,memory.used --format=csv
echo "all done at $(el) s"
