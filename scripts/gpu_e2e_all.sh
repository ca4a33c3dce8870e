#!/usr/bin/env bash
# All end-to-end GPU runs in one call (device time is scarce):
#   run(command="bash scripts/gpu_e2e_all.sh", carry=[".whl"], kind="nvidia-h200-x2")
# 1. target-32b + draft-0.6b, K=8: AR, SD, SSD at batch 1..16, T 0 and 0.7
# 2. same pair, K=6: SD and SSD at batch 1, 4, 16, T 0
# 3. target-8b + draft-1b, K=2 and K=4: AR (once), SD, SSD at batch 1, 4, 16, T 0
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_e2e_out}

F8=2,2,2,2,2,2,2,2,2; F6=2,2,2,2,2,2,2; F4=2,2,2,2,2; F2=2,2,2
PAIR=32b K=8 FAN_OUT=$F8 MAX_TOKENS=64 TAG=32b_k8 bash scripts/gpu_e2e.sh
PAIR=32b K=6 FAN_OUT=$F6 MAX_TOKENS=64 MODES=ssd,sd BATCHES=1,4,16 TEMPS=0 TAG=32b_k6 bash scripts/gpu_e2e.sh
PAIR=8b K=4 FAN_OUT=$F4 MAX_TOKENS=64 BATCHES=1,4,16 TEMPS=0 TAG=8b_k4 bash scripts/gpu_e2e.sh
PAIR=8b K=2 FAN_OUT=$F2 MAX_TOKENS=64 MODES=ssd,sd BATCHES=1,4,16 TEMPS=0 TAG=8b_k2 bash scripts/gpu_e2e.sh
