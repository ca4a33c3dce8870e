#!/usr/bin/env bash
# Plain steps of the SSD engine against AR's, with and without the target and the draft
# pinned to CPU cores of their own (taskset every second on every thread of each process).
# Target on cuda:0, draft on cuda:1; alpha 0.6, T = 0.7, 512-token prompts, batch 16 and 32,
# 512 new tokens. Writes the host's CPU topology, one JSON and one log per run, and the
# busiest threads every 4 s (ps) under $OUT.
#
#   bash scripts/gpu_cpu_placement.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh
set_up_run /tmp/gpu_cpu_placement_out
{ lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|NUMA|Model name"; nvidia-smi topo -m; } > "$OUT/topology.txt"
T_CPUS=$(cat /sys/devices/system/cpu/cpu2/topology/thread_siblings_list)
D_CPUS=$(cat /sys/devices/system/cpu/cpu6/topology/thread_siblings_list)
echo "target cpus $T_CPUS, draft cpus $D_CPUS" | tee -a "$OUT/topology.txt"

sample_threads() {
  while sleep 4; do
    echo "== $(date +%s)"
    ps -eLo pid,tid,psr,pcpu,args --sort=-pcpu | grep -v " ps -eLo" | head -8 | cut -c1-110
  done >> "$OUT/threads_$1.txt"
}
pin() {
  while sleep 1; do
    for p in $(pgrep -f -- "-m target"); do taskset -a -c -p "$T_CPUS" "$p" > /dev/null 2>&1; done
    for p in $(pgrep -f -- "-m draft"); do taskset -a -c -p "$D_CPUS" "$p" > /dev/null 2>&1; done
  done
}
run() {  # TAG MODE PINNED
  sample_threads "$1" & local sp=$! pp=""
  if [ "$3" = 1 ]; then pin & pp=$!; fi
  timeout "${RUN_TIMEOUT:-170}" python3 scripts/bench_e2e.py --target random:target-8b --draft random:draft-1b \
    --target-device cuda:0 --draft-device cuda:1 --target-gpu-memory-utilization 0.85 --modes "$2" --k 4 \
    --fan-out 3,3,3,3,3 --prompt-lens 512 --batch-sizes 16,32 --temperatures 0.7 --max-tokens 512 --warmup-tokens 64 \
    --synthetic-acceptance 0.6 --synthetic-ranks 0.5,0.2,0.1 --log-level INFO --out "$OUT/e2e_$1.json" > "$OUT/log_$1.txt" 2>&1
  kill $sp $pp 2> /dev/null; wait $sp $pp 2> /dev/null
  grep -E "^\[(ssd|ar)\] (P=|runtime)" "$OUT/log_$1.txt"
}
run ar_free ar 0
run ssd_free ssd 0
run ssd_pin ssd 1
run ar_pin ar 1
