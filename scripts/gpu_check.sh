#!/usr/bin/env bash
# Check a CUDA machine and time single steps: build flashinfer's prefill kernels, run
# tests/test_gpu.py, then scripts/bench_linear.py and scripts/bench_step.py (with a plot
# and a summary table). Needs one GPU.
#
#   OUT=/tmp/gpu_check bash scripts/gpu_check.sh
#   BENCH_MODELS=target-8b,draft-1b SKIP_LINEAR=1 bash scripts/gpu_check.sh
#
# Wheels found in .whl/ are installed into .site/ first (for a machine without network
# access). Logs and JSON go under $OUT (default /tmp/gpu_check_out).
# Env: BENCH_MODELS (default: all four shapes), SKIP_TESTS=1, SKIP_LINEAR=1, SKIP_BENCH=1,
# TEST_TIMEOUT, BENCH_TIMEOUT (seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

stamp "install wheels"
source scripts/gpu_common.sh
set_up_run /tmp/gpu_check_out
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, flashinfer, triton; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  || { echo "flashinfer import failed"; exit 1; }

# Build flashinfer's prefill module for the two head dims (128 and 64, bf16, fa2) in
# the background while the tests start; flashinfer's file lock makes the first user wait.
stamp "flashinfer JIT prebuild (background)"
for hd in 128 64; do
  python3 - "$hd" > "$OUT/jit_$hd.log" 2>&1 <<'EOF' &
import sys, time, torch
from flashinfer.jit import gen_batch_prefill_module
hd = int(sys.argv[1]); t = time.time()
bf = torch.bfloat16
gen_batch_prefill_module("fa2", bf, bf, bf, torch.int32, hd, hd, 0, False, False, False).build(False)
print(f"head_dim {hd}: prefill built in {time.time() - t:.1f}s", flush=True)
EOF
done

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  stamp "tests/test_gpu.py"
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -s -p no:cacheprovider -p no:logging -rs tests/test_gpu.py 2>&1 | tee "$OUT/test_gpu.log"
  stamp "tests exit ${PIPESTATUS[0]}"
fi
wait
cat "$OUT"/jit_*.log

if [ "${SKIP_LINEAR:-0}" != 1 ]; then
  stamp "scripts/bench_linear.py"
  timeout 200 python3 scripts/bench_linear.py --out "$OUT/bench_linear.json" 2>&1 | tee "$OUT/bench_linear.log"
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  stamp "scripts/bench_step.py"
  timeout "${BENCH_TIMEOUT:-420}" python3 scripts/bench_step.py --out "$OUT/bench_step.json" --profile "$OUT/profile.txt" \
    --models "${BENCH_MODELS:-target-8b,draft-1b,draft-0.6b,target-32b}" 2>&1 | tee "$OUT/bench.log"
  stamp "bench exit ${PIPESTATUS[0]}"
  python3 scripts/bench_step.py --plot-from "$OUT/bench_step.json" --png "$OUT/bench_step.png" || echo "plot failed"
  python3 - "$OUT/bench_step.json" <<'EOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no bench JSON: {e}")
print(f"\n{d['device']}  copy {d['copy_bw_tbs']:.2f} TB/s  context {d['context']}")
print(f"{'model':11s} {'GB':>5s} {'floor':>6s} {'dec b1':>7s} {'x':>5s} {'ver6 b1':>7s} {'v6/dec':>6s} {'dec b16':>7s}")
for m in d["models"]:
    s = {(r["q_len"], r["batch"]): r["ms"] for r in m["steps"]}
    v6 = s.get((6, 1))
    print(f"{m['model']:11s} {m['weight_bytes']/1e9:5.1f} {m['floor_ms']:6.2f} {s[(1,1)]:7.3f} {s[(1,1)]/m['floor_ms']:5.2f} "
          f"{(v6 or 0):7.3f} {(v6 or 0)/s[(1,1)]:6.2f} {s[(1,16)]:7.3f}")
for k, v in d.get("skipped", {}).items():
    print(f"{k}: skipped ({v})")
EOF
fi
stamp "done"
