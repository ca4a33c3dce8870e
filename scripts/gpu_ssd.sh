#!/usr/bin/env bash
# SSD at long contexts and under load. Target on cuda:0 and draft on cuda:1 (both on
# cuda:0 when the machine has one GPU).
#
#   PART=check bash scripts/gpu_ssd.sh
#   PART=e2e PAIR=8b K=4 PROMPTS=512,2048 BATCHES=1,4,16 bash scripts/gpu_ssd.sh
#
# PART=check: tests/test_gpu.py (tree graphs, attention, the forward) and
#   scripts/profile_draft.py at 512 to 8192 tokens of context (draft-0.6b, K=8, fan-out 3).
# PART=e2e:   scripts/bench_e2e.py on one pair (PAIR=32b: target-32b + draft-0.6b, K=8;
#   PAIR=8b: target-8b + draft-1b, K=${K:-2}); PROMPTS, BATCHES, TEMPS, MAX_TOKENS, ALPHA (one value or
#   several, 0.8,0.6: the matrix at each), SAMPLED_PROMPTS (the prompt lengths at which TEMPS above 0
#   run; default all), MODES,
#   FAN_OUT (default 3 at every depth), TREE_BUDGET (0: the default), TREE_SHAPE, WORK_AHEAD (auto,
#   always or halves), TARGET_MEM (the target's --target-gpu-memory-utilization, 0.85; 0.92 fits
#   target-32b on an 80 GB GPU),
#   MAX_BATCH_TOKENS (points whose batch holds more prompt and output tokens are left out),
#   LOG_LEVEL (DEBUG also writes the round policy's step records to $OUT/steps_$TAG.log; the draft
#   names any message it took over 50 ms to handle in $OUT/e2e_$TAG.log),
#   PROFILE=1 ($OUT/profiles.txt: where a window of steps spends its time in each process),
#   PHASES=1 ($OUT/phases.txt: each speculating step's verify in phases, scripts/step_phases; NO_LAYOUT=1 builds
#   every verify once the draft's answer is in, for A/B runs),
#   TORCH_SAMPLING=1 (the target samples with torch ops, not kernels/race.py's kernels: A/B runs),
#   OVERLAP (--overlap-schedule: auto, on, or off: every plain step reads its tokens before the next is queued).
# Wheels found in .whl/ are installed into .site/ first; logs and JSON go under $OUT
# (default /tmp/gpu_ssd_out).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh
set_up_run /tmp/gpu_ssd_out
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
NGPU=$(nvidia-smi -L | wc -l)
DRAFT_DEV=cuda:1; [ "$NGPU" -lt 2 ] && DRAFT_DEV=cuda:0

stamp "flashinfer prefill modules"
for hd in 128 64; do
  python3 - "$hd" <<'PY' 2>&1 | tail -1 &
import sys, time, torch
from flashinfer.jit import gen_batch_prefill_module
hd = int(sys.argv[1]); t = time.time(); bf = torch.bfloat16
gen_batch_prefill_module("fa2", bf, bf, bf, torch.int32, hd, hd, 0, False, False, False).build(False)
print(f"flashinfer head_dim {hd} built in {time.time() - t:.1f}s")
PY
done
wait

case "${PART:-check}" in
  check)
    stamp "tests/test_gpu.py"
    CUDA_VISIBLE_DEVICES=${TEST_GPU:-1} timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -rs \
      tests/test_gpu.py -k "${TEST_K:-tree or triton_attention or back_to_back or (graphs_and_transformers and triton)}" 2>&1 \
      | tail -15 | tee "$OUT/test_gpu.log"
    for b in ${PROFILE_BATCHES:-1 4}; do
      stamp "profile_draft batch $b"
      timeout "${PROFILE_TIMEOUT:-150}" python3 scripts/profile_draft.py --model random:draft-0.6b --k 8 --fan-out 3 \
        --oracle --batch "$b" --contexts "${CONTEXTS:-512,2048,8192}" --out "$OUT/profile_draft_b$b.json" 2>&1 \
        | grep -v "^ *$" | head -40 | tee "$OUT/profile_draft_b$b.log"
    done
    ;;
  e2e)
    case "${PAIR:-32b}" in
      32b) TARGET=random:target-32b; DRAFT=random:draft-0.6b; K=${K:-8} ;;
      8b)  TARGET=random:target-8b;  DRAFT=random:draft-1b;   K=${K:-2} ;;
    esac
    # PROFILE=1: the target and draft processes profile a window of steps
    # (scripts/profile_steps/sitecustomize.py; PROFILE_SKIP, PROFILE_STEPS, PROFILE_MIN_BATCH, PROFILE_ROLES).
    [ -n "${PROFILE:-}" ] && export PYTHONPATH=$PWD/scripts/profile_steps:$PYTHONPATH PROFILE_DIR=$OUT
    [ -n "${TORCH_SAMPLING:-}" ] && export PYTHONPATH=$PWD/scripts/torch_sampling:$PYTHONPATH
    [ -n "${PHASES:-}" ] && export PYTHONPATH=$PWD/scripts/step_phases:$PYTHONPATH STEP_PHASES_DIR=$OUT
    stamp "bench_e2e $PAIR K=$K"
    timeout "${RUN_TIMEOUT:-540}" python3 scripts/bench_e2e.py --target "$TARGET" --draft "$DRAFT" \
      --target-device cuda:0 --draft-device "$DRAFT_DEV" --target-gpu-memory-utilization "${TARGET_MEM:-0.85}" --modes "${MODES:-ssd,sd,ar}" --k "$K" \
      --fan-out "${FAN_OUT:-$(python3 -c "print(','.join(['3'] * ($K + 1)))")}" \
      --prompt-lens "${PROMPTS:-512}" --batch-sizes "${BATCHES:-1,4,16}" --max-batch-tokens "${MAX_BATCH_TOKENS:-0}" --temperatures "${TEMPS:-0}" --sampled-prompt-lens "${SAMPLED_PROMPTS:-}" \
      --max-tokens "${MAX_TOKENS:-256}" --warmup-tokens "${WARMUP:-64}" --tree-shape "${TREE_SHAPE:-auto}" --tree-budget "${TREE_BUDGET:-0}" --work-ahead "${WORK_AHEAD:-auto}" --synthetic-acceptance "${ALPHA:-0.8}" --synthetic-ranks 0.5,0.2,0.1 \
      --log-level "${LOG_LEVEL:-WARNING}" --overlap-schedule "${OVERLAP:-auto}" \
      --out "$OUT/e2e_${TAG:-$PAIR}.json" 2>&1 | grep -v "^ *$" | tee "/tmp/e2e_${TAG:-$PAIR}_full.log" \
      | grep -v "round_policy: step batch" | tee "$OUT/e2e_${TAG:-$PAIR}.log" | tail -60
    # LOG_LEVEL=DEBUG: the round policy's step records, one file to replay
    # (scripts/replay_round_policy.py), with the line that ends each point.
    if grep -q "round_policy: step batch" "/tmp/e2e_${TAG:-$PAIR}_full.log"; then
      grep -E "round_policy: step batch|^\[(ssd|sd|ar)\] P=" "/tmp/e2e_${TAG:-$PAIR}_full.log" > "$OUT/steps_${TAG:-$PAIR}.log"
    fi
    ;;
esac
stamp "done"
