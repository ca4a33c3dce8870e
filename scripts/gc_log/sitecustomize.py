"""Log every garbage collection over 2 ms, per process, to /tmp/gcdiag/PID.log: the
process's first argv words, then one line per collection (Unix time, generation, ms,
objects collected), and at a collection 5 s or more after the last such line, the
totals since start-up (collections and ms per generation; child processes are killed,
so nothing is written at exit: a process that stops collecting writes no more lines).
Python imports `sitecustomize` at start-up from its path, so copying this file into
.site/ (the folder scripts/gpu_common.sh puts first on PYTHONPATH) makes every process
of a run log its own pauses, the target's and the draft's included:

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
_count = [0, 0, 0]
_ms = [0.0, 0.0, 0.0]
_last_total = [time.time()]
_log = open(f"{_DIR}/{os.getpid()}.log", "a", buffering=1)
_log.write("argv " + " ".join(sys.argv[:3]) + "\n")


def _on_gc(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
        return
    dt = time.perf_counter() - _start[0]
    gen = info["generation"]
    _count[gen] += 1
    _ms[gen] += 1e3 * dt
    now = time.time()
    if dt > 0.002:
        _log.write(f"{now:.3f} gen{gen} {1e3 * dt:.1f} ms collected {info['collected']}\n")
    if now - _last_total[0] >= 5.0:
        _last_total[0] = now
        _log.write(f"{now:.3f} totals " + " ".join(f"gen{g} {_count[g]} / {_ms[g]:.1f} ms" for g in range(3)) + "\n")


gc.callbacks.append(_on_gc)
