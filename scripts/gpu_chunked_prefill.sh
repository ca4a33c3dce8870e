#!/usr/bin/env bash
# Chunked prefill off and on, served: target-8b + draft-1b (random weights, synthetic oracle
# alpha 0.8, ranks 0.5,0.2,0.1) on one GPU in sd mode, K=4. 160 short requests (128-token
# prompts, 256 new tokens) decode at concurrency 32 while 12 long ones (6,000-token prompts,
# 16 new tokens, two at a time) arrive. Reported per run: the short requests' p50/p99
# inter-token latency and TPOT (what a long prefill stalls), the long requests' TTFT, both
# groups' throughput, and the server's num_prefill_chunks (its warm-up requests included).
#
#   bash scripts/gpu_chunked_prefill.sh
#
# off: --max-num-batched-tokens 0 (whole prompts); on: --max-num-batched-tokens $BUDGET (2048).
# Env: BUDGET, SHORT_IN, SHORT_OUT, SHORT_NUM, CONC, LONG_IN, LONG_OUT, LONG_NUM, LONG_CONC,
# LONG_DELAY_S, MODE, RUNS ("off on"), START_TIMEOUT; TARGET, DRAFT, DEVICE and MEM_FLAGS run
# it elsewhere (e.g. tiny models on the CPU). Wheels found in .whl/ are installed into .site/
# first; JSON and logs go under $OUT (default /tmp/gpu_chunked_out), the summary in
# $OUT/chunked_prefill.json.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh
set_up_run /tmp/gpu_chunked_out
BUDGET=${BUDGET:-2048}; CONC=${CONC:-32}; MODE=${MODE:-sd}
SHORT_IN=${SHORT_IN:-128}; SHORT_OUT=${SHORT_OUT:-256}; SHORT_NUM=${SHORT_NUM:-160}
LONG_IN=${LONG_IN:-6000}; LONG_OUT=${LONG_OUT:-16}; LONG_NUM=${LONG_NUM:-12}; LONG_CONC=${LONG_CONC:-2}
TARGET=${TARGET:-random:target-8b}; DRAFT=${DRAFT:-random:draft-1b}; DEVICE=${DEVICE:-cuda:0}
MEM_FLAGS=${MEM_FLAGS:---target-gpu-memory-utilization 0.5 --draft-gpu-memory-utilization 0.3}
MAX_LEN=$((LONG_IN + LONG_OUT + 64))
BENCH="--ignore-eos --disable-tqdm --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99"
for run in ${RUNS:-off on}; do
  budget=0; [ "$run" = on ] && budget=$BUDGET
  port=$((8100 + RANDOM % 500))
  # shellcheck disable=SC2086
  python3 -m spec_runtime serve --target "$TARGET" --draft "$DRAFT" --mode "$MODE" --k 4 \
    --synthetic-acceptance 0.8,0.5,0.2,0.1 --target-device "$DEVICE" --draft-device "$DEVICE" $MEM_FLAGS \
    --max-model-len "$MAX_LEN" --max-num-seqs $((CONC + LONG_CONC)) --max-num-batched-tokens "$budget" \
    --port "$port" > "$OUT/server_$run.log" 2>&1 &
  pid=$!
  if wait_healthy "$port" "$pid"; then
    url="http://127.0.0.1:$port"
    # Untimed warm-up: both request shapes once, so neither run pays first-use costs in its figures.
    for shape in "$LONG_IN 4 $LONG_CONC" "$SHORT_IN 16 $CONC"; do
      set -- $shape
      python3 -m spec_runtime bench --base-url "$url" --random-input-len "$1" --output-len "$2" --num-prompts "$3" \
        --max-concurrency "$3" --ignore-eos --disable-tqdm --seed 3 > /dev/null 2>&1
    done
    # shellcheck disable=SC2086
    python3 -m spec_runtime bench --base-url "$url" --random-input-len "$SHORT_IN" --output-len "$SHORT_OUT" \
      --num-prompts "$SHORT_NUM" --max-concurrency "$CONC" $BENCH --seed 1 \
      --save-result "$OUT/short_$run.json" > "$OUT/bench_short_$run.log" 2>&1 &
    short=$!
    sleep "${LONG_DELAY_S:-4}"  # the short requests are decoding when the long ones arrive
    # shellcheck disable=SC2086
    python3 -m spec_runtime bench --base-url "$url" --random-input-len "$LONG_IN" --output-len "$LONG_OUT" \
      --num-prompts "$LONG_NUM" --max-concurrency "$LONG_CONC" $BENCH --seed 2 \
      --save-result "$OUT/long_$run.json" > "$OUT/bench_long_$run.log" 2>&1
    wait $short
    tail -25 "$OUT/bench_short_$run.log"
    python3 -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())" \
      "$url/metrics" | grep -E "prefill_chunks|preempt|kv_cache_usage" | grep -v "^#" | tee "$OUT/metrics_$run.txt"
  else
    echo "server ($run) did not come up"; tail -30 "$OUT/server_$run.log"
  fi
  kill $pid 2> /dev/null; wait $pid 2> /dev/null
done
python3 - "$OUT" "$BUDGET" <<'EOF'
import json, os, re, sys

out, budget = sys.argv[1], int(sys.argv[2])
summary = {"budget": budget}
for run in ("off", "on"):
    paths = {g: os.path.join(out, f"{g}_{run}.json") for g in ("short", "long")}
    if not all(os.path.exists(p) for p in paths.values()):
        continue
    short, long = (json.load(open(paths[g])) for g in ("short", "long"))
    metrics = open(os.path.join(out, f"metrics_{run}.txt")).read()
    chunks = re.findall(r"num_prefill_chunks_total\{[^}]*\} ([0-9.e+]+)", metrics)
    summary[run] = {
        "short_p50_itl_ms": short["p50_itl_ms"], "short_p99_itl_ms": short["p99_itl_ms"],
        "short_p50_tpot_ms": short["p50_tpot_ms"], "short_p99_tpot_ms": short["p99_tpot_ms"],
        "short_output_throughput": short["output_throughput"], "short_failed": short["failed"],
        "long_p50_ttft_ms": long["p50_ttft_ms"], "long_p99_ttft_ms": long["p99_ttft_ms"],
        "long_output_throughput": long["output_throughput"], "long_failed": long["failed"],
        "num_prefill_chunks": float(chunks[0]) if chunks else None,
    }
json.dump(summary, open(os.path.join(out, "chunked_prefill.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
EOF
