#!/usr/bin/env bash
set -u
for round in 1 2 3; do
for tree in before after; do
  if [ $tree = before ]; then dir=/work/wt-before; else dir=/work/main; fi
  (cd $dir && OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$dir /work/main/.venv/bin/python -m clover.bench --engine /work/main/engines/demo \
     --sweeps batch --batch-sizes 1,8 --lines vanilla,clover --budget 8 --repeats 3 --max-new-tokens 64 --prompts mtbench \
     --num-prompts 16 --threads 2 --silent --output /tmp/bench46/fixed-$tree-$round) > /tmp/bench46/fixed-$tree-$round.log 2>&1
  echo "fixed-$tree-$round rc=$? $(date -u +%H:%M:%S) load $(cat /proc/loadavg)" >> /tmp/bench46/progress.txt
done
done
