#!/usr/bin/env bash
# Benchmark the OpenAI-compatible endpoint (clover serve --openai-port) with NVIDIA's aiperf:
# vanilla vs the default (adaptive) Clover method on one engine, at several concurrency levels, MT-bench
# first turns as prompts, greedy streaming chat completions of max_tokens new tokens.
#
#   python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf==0.13.0   # once
#   benchmarks/aiperf_sweep.sh                       # engines/demo, concurrency 1 4 16 32
#   LEVELS="1 4" METHODS="vanilla" benchmarks/aiperf_sweep.sh
#
# Rerunnable: a (method, concurrency) already measured (its profile_export_aiperf.json exists under
# $OUT/raw) is skipped, and a method whose levels are all measured starts no server. Each method gets its own
# `clover serve` (one after another, so they never share the CPUs); the servers are stopped on exit (trap).
# Then benchmarks/aiperf_report.py writes $OUT/results.md and $OUT/aiperf_sweep.png. See docs/openai.md.
set -euo pipefail
cd "$(dirname "$0")/.."

AIPERF=${AIPERF:-/tmp/aiperf-venv/bin/aiperf}
PYTHON=${PYTHON:-python}
ENGINE=${ENGINE:-engines/demo}
OUT=${OUT:-docs/results/openai}
METHODS=${METHODS:-"vanilla auto"}        # auto: the engine's heads (Clover) with its adaptive tree budget
LEVELS=${LEVELS:-"1 4 16 32"}
REQ_PER_CONC=${REQ_PER_CONC:-2}           # requests per level = REQ_PER_CONC x concurrency
MAX_TOKENS=${MAX_TOKENS:-64}
PORT_BASE=${PORT_BASE:-28100}             # HTTP, gRPC, metrics: PORT_BASE+0..2; OpenAI: PORT_BASE+90
LEVEL_TIMEOUT=${LEVEL_TIMEOUT:-900}       # seconds one aiperf run may take

[ -x "$AIPERF" ] || { echo "aiperf not found at $AIPERF (python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf==0.13.0)" >&2; exit 2; }
[ -f "$ENGINE/engine.json" ] || $PYTHON -c "from clover.export.builder import ensure_demo_engine; ensure_demo_engine()"

mkdir -p "$OUT/raw"
PROMPTS="$OUT/raw/mtbench_first_turns.jsonl"
[ -s "$PROMPTS" ] || $PYTHON -c "
import json, sys
from clover.prompts import mtbench_first_turns
with open(sys.argv[1], 'w') as f:
    for turn in mtbench_first_turns():
        f.write(json.dumps({'text': turn['prompt']}) + '\n')  # aiperf's single_turn JSONL
" "$PROMPTS"


SERVER_PID=""
AIPERF_PID=""
stop_server() {
    if [ -n "$AIPERF_PID" ]; then kill -TERM "$AIPERF_PID" 2>/dev/null || true; wait "$AIPERF_PID" 2>/dev/null || true; AIPERF_PID=""; fi
    [ -n "$SERVER_PID" ] || return 0
    if kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true          # clover serve drains and stops tritonserver
        for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true       # its own process group (setsid), if still there
    fi
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

level_dir() { echo "$OUT/raw/$1/c$2"; }

MEASURED=0
note_env() {  # the machine and its load, once per invocation that measures something
    [ "$MEASURED" = 1 ] && return 0
    MEASURED=1
    { echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"; echo "cpu: $(lscpu | grep 'Model name' | sed 's/ \+/ /g')";
      echo "nproc: $(nproc)"; echo "uptime before: $(uptime)"; echo "aiperf: $("$AIPERF" --version 2>/dev/null | tail -1)"; } \
      >> "$OUT/raw/env.txt"
}

for method in $METHODS; do
    todo=""
    for c in $LEVELS; do [ -f "$(level_dir "$method" "$c")/profile_export_aiperf.json" ] || todo="$todo $c"; done
    if [ -z "$todo" ]; then echo "[aiperf_sweep] $method: all levels measured, skipped"; continue; fi

    note_env
    openai_port=$((PORT_BASE + 90))
    mkdir -p "$OUT/raw/$method"
    serve=(clover)
    serve_args=(serve --engine "$ENGINE" --method "$method" --host 127.0.0.1 --http-port "$PORT_BASE"
                --grpc-port $((PORT_BASE + 1)) --metrics-port $((PORT_BASE + 2)) --openai-port "$openai_port"
                --log-file "$OUT/raw/$method/tritonserver.log")
    echo "[aiperf_sweep] $method: clover ${serve_args[*]}"
    setsid "${serve[@]}" "${serve_args[@]}" > "$OUT/raw/$method/serve.out" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 1 600); do
        curl -sf "http://127.0.0.1:$openai_port/health" > /dev/null && break
        kill -0 "$SERVER_PID" 2>/dev/null || { cat "$OUT/raw/$method/serve.out" >&2; exit 1; }
        sleep 1
    done
    curl -sf "http://127.0.0.1:$openai_port/health" > /dev/null || { echo "server not ready" >&2; exit 1; }

    for c in $todo; do
        dir=$(level_dir "$method" "$c")
        tmp="$dir.partial"; rm -rf "$tmp"
        n=$((REQ_PER_CONC * c))
        echo "[aiperf_sweep] $method: concurrency $c, $n requests"
        # the tokenizer is the engine's own directory (a local path: no hub access). HF_HUB_OFFLINE=1 must NOT
        # be set: aiperf 0.13.0 then looks a local path up in the hub cache and fails.
        timeout "$LEVEL_TIMEOUT" "$AIPERF" profile \
            --model clover --url "http://127.0.0.1:$openai_port" --endpoint-type chat --streaming \
            --tokenizer "$ENGINE" --use-server-token-count \
            --input-file "$PROMPTS" --custom-dataset-type single_turn --random-seed 0 \
            --concurrency "$c" --request-count "$n" --warmup-request-count $(( c < 4 ? c : 4 )) \
            --extra-inputs "max_tokens:$MAX_TOKENS" --extra-inputs temperature:0 --extra-inputs ignore_eos:true \
            --ui-type none --no-server-metrics --no-gpu-telemetry --workers-max 1 --record-processors 1 \
            --artifact-dir "$tmp" > "$tmp.log" 2>&1 &
        AIPERF_PID=$!
        wait "$AIPERF_PID" || { tail -30 "$tmp.log" >&2; exit 1; }  # `wait`: a signal's trap runs at once
        AIPERF_PID=""
        mv "$tmp.log" "$tmp/aiperf.log"
        # the request payloads (aiperf's inputs.json) are the same for every level: keep one copy
        if [ ! -f "$OUT/raw/inputs.json" ]; then mv "$tmp/inputs.json" "$OUT/raw/inputs.json"
        elif cmp -s "$tmp/inputs.json" "$OUT/raw/inputs.json"; then rm "$tmp/inputs.json"; fi
        mv "$tmp" "$dir"
    done
    curl -s "http://127.0.0.1:$((PORT_BASE + 2))/metrics" | grep -E '^clover_' > "$OUT/raw/$method/metrics.txt" || true
    stop_server
done

[ "$MEASURED" = 1 ] && echo "uptime after: $(uptime)" >> "$OUT/raw/env.txt"
$PYTHON -m benchmarks.aiperf_report "$OUT"
