#!/usr/bin/env bash
# Prefix caching off and on, served: target-8b + draft-1b (random weights, synthetic oracle
# alpha 0.8, ranks 0.5,0.2,0.1) on one GPU in sd mode, K=4. 200 random requests share one
# 2,000-token prefix and add 200 unique tokens each, at concurrency 32, 128 new tokens each.
#
#   bash scripts/gpu_prefix_cache.sh
#
# Env: PREFIX, INPUT, OUTPUT, NUM, CONC, MODE, RUNS ("on off"), START_TIMEOUT. Wheels found in
# .whl/ are installed into .site/ first; JSON and logs go under $OUT (default /tmp/gpu_prefix_out).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh
set_up_run /tmp/gpu_prefix_out
PREFIX=${PREFIX:-2000}; INPUT=${INPUT:-200}; OUTPUT=${OUTPUT:-128}; NUM=${NUM:-200}; CONC=${CONC:-32}
MODE=${MODE:-sd}
for run in ${RUNS:-on off}; do
  flag=""; [ "$run" = off ] && flag="--no-enable-prefix-caching"
  port=$((8100 + RANDOM % 500))
  python3 -m spec_runtime serve --target random:target-8b --draft random:draft-1b --mode "$MODE" --k 4 \
    --synthetic-acceptance 0.8,0.5,0.2,0.1 --target-device cuda:0 --draft-device cuda:0 \
    --target-gpu-memory-utilization 0.5 --draft-gpu-memory-utilization 0.3 \
    --max-model-len 4096 --max-num-seqs "$CONC" --port "$port" $flag > "$OUT/server_$run.log" 2>&1 &
  pid=$!
  if wait_healthy "$port" "$pid"; then
    python3 -m spec_runtime bench --base-url "http://127.0.0.1:$port" --random-prefix-len "$PREFIX" \
      --random-input-len "$INPUT" --output-len "$OUTPUT" --num-prompts "$NUM" --max-concurrency "$CONC" \
      --ignore-eos --disable-tqdm --save-result "$OUT/prefix_cache_$run.json" 2>&1 | tail -40
    python3 -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())" \
      "http://127.0.0.1:$port/metrics" | grep -E "prefix_cache|preempt|kv_cache_usage" | grep -v "^#"
  else
    echo "server ($run) did not come up"; tail -30 "$OUT/server_$run.log"
  fi
  kill $pid 2> /dev/null; wait $pid 2> /dev/null
done
