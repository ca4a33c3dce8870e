#!/usr/bin/env bash
# AR, SD and SSD side by side on one random-weight model pair (scripts/bench_e2e.py):
# 128-token prompts, synthetic oracle alpha 0.8 (ranks 0.5,0.2,0.1). The target runs on
# cuda:0 and the draft on cuda:1, or on cuda:0 too when the machine has one GPU.
#
#   PAIR=32b bash scripts/gpu_e2e.sh
#   PAIR=8b K=2 FAN_OUT=3,3,3 BATCHES=1,4 TEMPS=0 bash scripts/gpu_e2e.sh
#
# PAIR=32b: target-32b + draft-0.6b.  PAIR=8b: target-8b + draft-1b.
# Env: K, FAN_OUT, BATCHES, TEMPS, MAX_TOKENS, MODES, REPEATS, SSD_EXTRA (extra bench_e2e
# flags), TAG (file name), RUN_TIMEOUT. Wheels found in .whl/ are installed into .site/
# first; the JSON and log go under $OUT (default /tmp/gpu_e2e_out).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh
set_up_run /tmp/gpu_e2e_out
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader

PAIR=${PAIR:-32b}
case "$PAIR" in
  32b) TARGET=random:target-32b; DRAFT=random:draft-0.6b; HDS="128" ;;
  8b)  TARGET=random:target-8b;  DRAFT=random:draft-1b;   HDS="128 64" ;;
  *) echo "unknown PAIR $PAIR"; exit 2 ;;
esac
NGPU=$(nvidia-smi -L | wc -l)
DRAFT_DEV=cuda:1; [ "$NGPU" -lt 2 ] && DRAFT_DEV=cuda:0

# Build flashinfer's attention modules once, before two processes race for them.
for hd in $HDS; do
  python3 - "$hd" <<'PY' 2>&1 | tail -1
import sys, time, torch
from flashinfer.jit import gen_batch_prefill_module
hd = int(sys.argv[1]); t = time.time(); bf = torch.bfloat16
gen_batch_prefill_module("fa2", bf, bf, bf, torch.int32, hd, hd, 0, False, False, False).build(False)
print(f"flashinfer head_dim {hd} built in {time.time() - t:.1f}s")
PY
done

timeout ${RUN_TIMEOUT:-240} python3 scripts/bench_e2e.py --target "$TARGET" --draft "$DRAFT" --target-device cuda:0 --draft-device "$DRAFT_DEV" \
  --modes "${MODES:-ssd,sd,ar}" --k "${K:-8}" --fan-out "${FAN_OUT:-}" --batch-sizes "${BATCHES:-1,2,4,8,16}" \
  --temperatures "${TEMPS:-0,0.7}" --max-tokens "${MAX_TOKENS:-96}" --prompt-len 128 --max-model-len 1024 \
  --synthetic-acceptance 0.8 --synthetic-ranks 0.5,0.2,0.1 --repeats "${REPEATS:-1}" ${SSD_EXTRA:-} \
  --out "$OUT/e2e_${TAG:-$PAIR}.json" 2>&1 | tee "$OUT/e2e_${TAG:-$PAIR}.log"
