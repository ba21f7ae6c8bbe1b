cd /tmp/tp56
while pgrep -f "bash bench.sh" > /dev/null; do sleep 5; done
for run in 3; do
for method in vanilla clover; do
for cfg in "1 1" "2 1" "1 2"; do
  set -- $cfg; tp=$1; th=$2
  PYTHONPATH=/work/wt56 nice -n 19 python -m clover.cli generate --target demo --backend torch --method $method --no-adaptive --prompts-file bench.jsonl --max-new-tokens 64 --batch-size 4 --threads $th --tensor-parallel $tp --output out-$method-$tp-$th-$run.jsonl --summary sum-$method-$tp-$th-$run.json > log-$method-$tp-$th-$run.txt 2>&1
  echo "$run $method tp=$tp threads=$th load=$(cut -d' ' -f1 /proc/loadavg) $(python -c "import json; d=json.load(open('sum-$method-$tp-$th-$run.json')); print(round(d['tokens_per_second'],2), 'tok/s', round(d['tokens_per_step'],2), 'tok/step', round(d['decode_seconds'],2), 's')")"
done; done; done
