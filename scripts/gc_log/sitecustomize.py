"""Log every garbage collection over 2 ms, per process, to /tmp/gcdiag/PID.log: the
process's first argv words, then one line per collection (Unix time, generation, ms,
objects collected). Python imports `sitecustomize` at start-up from its path, so copying
this file into .site/ (the folder scripts/gpu_common.sh puts first on PYTHONPATH) makes
every process of a run log its own pauses, the target's and the draft's included:

    mkdir -p .site && cp scripts/gc_log/sitecustomize.py .site/
    ALPHA=0.6 MAX_TOKENS=512 PART=e2e PAIR=8b K=4 PROMPTS=512 TEMPS=0.7 BATCHES=4,16,32 MODES=ssd,ar bash scripts/gpu_ssd.sh
"""

import gc
import os
import sys
import time

_DIR = "/tmp/gcdiag"
os.makedirs(_DIR, exist_ok=True)
_start = [0.0]
_log = open(f"{_DIR}/{os.getpid()}.log", "a", buffering=1)
_log.write("argv " + " ".join(sys.argv[:3]) + "\n")


def _on_gc(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
        return
    dt = time.perf_counter() - _start[0]
    if dt > 0.002:
        _log.write(f"{time.time():.3f} gen{info['generation']} {1e3 * dt:.1f} ms collected {info['collected']}\n")


gc.callbacks.append(_on_gc)
