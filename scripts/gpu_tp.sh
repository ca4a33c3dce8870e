#!/usr/bin/env bash
# Tensor parallelism on two GPUs of one host (logs and JSON under $OUT, default /tmp/gpu_tp_out):
#   1. scripts/bench_tp_step.py: target-32b decode and verify steps at TP=1 and TP=2, and
#      target-70b (Llama-3-70B shape) at TP=2, each against its bandwidth floor;
#   2. scripts/bench_e2e.py: target-32b at TP=2 (cuda:0, cuda:1) with draft-0.6b sharing
#      cuda:1, AR and SD (K=8, synthetic oracle alpha 0.8), 512-token prompts.
#   PARTS="steps e2e" bash scripts/gpu_tp.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh
set_up_run /tmp/gpu_tp_out
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
for part in ${PARTS:-steps e2e}; do
  case $part in
    steps)
      stamp "target-32b TP=1 and TP=2"
      timeout "${STEP_TIMEOUT:-200}" python3 scripts/bench_tp_step.py --model target-32b --tp 1,2 \
        --out "$OUT/tp_step_32b.json" 2>&1 | grep -v "^ *$" | tail -30
      stamp "target-70b TP=2"
      timeout "${STEP_TIMEOUT:-200}" python3 scripts/bench_tp_step.py --model target-70b --tp 2 \
        --out "$OUT/tp_step_70b.json" 2>&1 | grep -v "^ *$" | tail -20
      ;;
    e2e)
      stamp "target-32b TP=2 + draft-0.6b on cuda:1: AR and SD"
      timeout "${E2E_TIMEOUT:-240}" python3 scripts/bench_e2e.py --target random:target-32b --draft random:draft-0.6b \
        -tp 2 --target-gpu-memory-utilization 0.75 --target-device cuda:0 --draft-device cuda:1 \
        --modes "${MODES:-sd,ar}" --k 8 --prompt-lens 512 --batch-sizes "${BATCHES:-1,4,16}" --temperatures 0 \
        --max-tokens 256 --synthetic-acceptance 0.8 --synthetic-ranks 0.5,0.2,0.1 \
        --out "$OUT/e2e_32b_tp2.json" 2>&1 | grep -v "^ *$" | tail -20
      ;;
  esac
done
stamp done
