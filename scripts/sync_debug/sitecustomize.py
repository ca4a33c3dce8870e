"""Count the synchronizing CUDA calls of the target and draft processes, per call site.

Python imports `sitecustomize` at start-up from its path. With this folder first on
PYTHONPATH, each target and draft process waits for the file /tmp/sync_on (so that
start-up's deliberate syncs stay out), then turns on torch's sync debug mode, counts each
warning by the stack that raised it, and at exit writes the counts to
/tmp/sync_<role>_<pid>.txt (most frequent first):

    source scripts/gpu_common.sh && set_up_run /tmp/sync_out
    export PYTHONPATH=$PWD/scripts/sync_debug:$PYTHONPATH
    python3 scripts/bench_e2e.py ... > /tmp/sync_out/log.txt 2>&1 &
    until grep -q "runtime up" /tmp/sync_out/log.txt; do sleep 1; done; touch /tmp/sync_on; wait

torch's sync debug mode does not see every synchronizing call (its own warning says so).
"""

import os
import sys

_ROLE = next((r for r in ("target", "draft") if r in sys.argv[:3]), None)

if _ROLE is not None:
    import atexit
    import collections
    import threading
    import time
    import traceback
    import warnings

    _counts = collections.Counter()
    _lock = threading.Lock()

    def _turn_on() -> None:
        while not os.path.exists("/tmp/sync_on"):
            time.sleep(0.5)
        import torch

        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)

    def _count(message, category, filename, lineno, file=None, line=None) -> None:
        stack = "".join(f for f in traceback.format_stack(limit=14)[:-2] if "warnings" not in f)
        with _lock:
            _counts[(str(message)[:80], stack)] += 1

    def _write() -> None:
        with _lock, open(f"/tmp/sync_{_ROLE}_{os.getpid()}.txt", "w") as f:
            for (message, stack), n in _counts.most_common(30):
                f.write(f"==== {n}x {message}\n{stack}\n")

    _exit = os._exit

    def _write_and_exit(code: int) -> None:  # the launcher stops its children with SIGTERM -> os._exit
        _write()
        _exit(code)

    threading.Thread(target=_turn_on, name="sync-debug", daemon=True).start()
    warnings.showwarning = _count
    atexit.register(_write)
    os._exit = _write_and_exit
