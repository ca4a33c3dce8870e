# Sourced by the gpu_*.sh scripts from the repository root.
#
# set_up_run DEFAULT_OUT: $OUT (DEFAULT_OUT unless set) made; the wheels found in .whl/
#   installed into .site/ (for a machine without network access); PYTHONPATH and the
#   environment every run shares exported. flashinfer's JIT cache is one per tree: its
#   builds name the headers under that tree's .site/, which another copy may not have.
# wait_healthy PORT PID: wait (up to $START_TIMEOUT s, default 150) until the server on
#   127.0.0.1:PORT answers /health; fails early if process PID exits.

set_up_run() {
  OUT=${OUT:-$1}
  mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>&1 | grep -v WARNING | tail -3
  fi
  export PYTHONPATH=$PWD/.site:$PWD
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi_ws/$(pwd | cksum | cut -d" " -f1)}
}

wait_healthy() {
  local port=$1 pid=$2
  for _ in $(seq 1 "${START_TIMEOUT:-150}"); do
    python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
      "http://127.0.0.1:$port/health" 2> /dev/null && return 0
    kill -0 "$pid" 2> /dev/null || return 1
    sleep 1
  done
  return 1
}
