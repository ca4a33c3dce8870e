"""Where a step's time goes in the target and draft processes: torch.profiler over a
window of steps, with the GPU's idle time per step put down to the host work under way.

Python imports `sitecustomize` at start-up from its path. With this folder first on
PYTHONPATH, each target process profiles steps PROFILE_SKIP+1 .. PROFILE_SKIP+PROFILE_STEPS
among those that run at least PROFILE_MIN_BATCH sequences (defaults 60, 40, 1), and each
draft process the same count of SpecRequests it answers. PROFILE_ROLES (default
"target,draft") names the processes that profile: a profiled draft answers several times
slower, which moves the round policy's choices. The target's main methods, the
draft's, and the runner's are wrapped in `record_function` ranges. At the end of the window
each process appends its report to $PROFILE_DIR/profiles.txt (default /tmp), headed by its
role, pid and command line:

  - per window: wall time, GPU busy time (the union of its kernels and copies on the
    timeline), GPU idle time. A target window runs from one step's start to the next's (the
    loop's polling, admission and streaming between steps included); a draft window is
    one SpecRequest's handling (its answer, then its work-ahead);
  - the idle time put down to the innermost range running on the host when each gap
    began ("GPU idle while the host did X");
  - each range's host time per step;
  - torch's table of operators, by self CPU time, and by self time on the GPU.

    source scripts/gpu_common.sh && set_up_run /tmp/prof_out
    PYTHONPATH=$PWD/scripts/profile_steps:$PYTHONPATH PROFILE_DIR=$OUT python3 scripts/bench_e2e.py ...

The ranges cost a few microseconds each on the host, so absolute times run slightly over
a run without them; the split is what this is for.
"""

import os
import sys

_ROLE = next((r for r in ("target", "draft") if r in sys.argv[:3]), None)

if _ROLE not in os.environ.get("PROFILE_ROLES", "target,draft").split(","):
    _ROLE = None

if _ROLE is not None and os.environ.get("PROFILE_STEPS", "40") != "0":
    import bisect
    import collections
    import functools
    import json
    import tempfile
    import threading

    _SKIP = int(os.environ.get("PROFILE_SKIP", "60"))
    _STEPS = int(os.environ.get("PROFILE_STEPS", "40"))
    _MIN_BATCH = int(os.environ.get("PROFILE_MIN_BATCH", "1"))
    _DIR = os.environ.get("PROFILE_DIR", "/tmp")
    _state = {"seen": 0, "prof": None, "done": False}
    _lock = threading.Lock()

    def _ranged(fn, label: str):
        """fn inside a record_function range named `label` while the window is open."""
        import torch

        @functools.wraps(fn)
        def wrapped(*a, **kw):
            if _state["prof"] is None:
                return fn(*a, **kw)
            with torch.profiler.record_function(label):
                return fn(*a, **kw)

        return wrapped

    def _wrap(cls, name: str, label: str) -> None:
        fn = getattr(cls, name, None)
        if fn is not None:
            setattr(cls, name, _ranged(fn, label))

    def _union(intervals: list[tuple[float, float]]) -> float:
        total, end = 0.0, float("-inf")
        for lo, hi in sorted(intervals):
            if hi <= end:
                continue
            total += hi - max(lo, end)
            end = hi
        return total

    def _analyse(trace: dict, top: str) -> str:
        """The per-step split from a chrome trace: `top` names the step's range."""
        events = trace.get("traceEvents", [])
        gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                     if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e)
        ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"]
        steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in ranges if e["name"] == top)
        if top == "target.step":  # a window runs to the next step's start: the loop's host work between counts
            steps = [(lo, max(hi, nxt)) for (lo, hi), (nxt, _) in zip(steps, steps[1:] + steps[-1:])]
        inner = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in ranges if e["name"] != top),
                       key=lambda r: (r[0], -r[1]))
        per_range = collections.Counter()
        for lo, hi, name in inner:
            per_range[name] += hi - lo
        idle_by = collections.Counter()
        walls, busy = [], []
        starts = [g[0] for g in gpu]
        for lo, hi in steps:
            i = bisect.bisect_left(starts, lo - 1e6)
            spans = [(max(a, lo), min(b, hi)) for a, b in gpu[i:] if a < hi and b > lo]
            walls.append(hi - lo)
            busy.append(_union(spans))
            # The gaps between kernels inside the step, each put down to the innermost range
            # running on the host when it began.
            t = lo
            for a, b in sorted(spans) + [(hi, hi)]:
                if a > t:
                    owner = "(none)"
                    for r_lo, r_hi, name in inner:
                        if r_lo > t:
                            break
                        if r_hi > t:
                            owner = name  # later starts are nested deeper
                    idle_by[owner] += a - t
                t = max(t, b)
        n = max(len(steps), 1)
        lines = [f"{len(steps)} windows of '{top}': wall {sum(walls) / n / 1e3:.3f} ms, GPU busy "
                 f"{sum(busy) / n / 1e3:.3f} ms, GPU idle {(sum(walls) - sum(busy)) / n / 1e3:.3f} ms per window",
                 "", "GPU idle per window, by the host range under way when each gap began (ms):"]
        lines += [f"  {v / n / 1e3:8.3f}  {k}" for k, v in idle_by.most_common(25)]
        lines += ["", "host time per window in each range (ms; nested ranges count in their parents too):"]
        lines += [f"  {v / n / 1e3:8.3f}  {k}" for k, v in per_range.most_common(40)]
        lines += ["", "wall / busy per window (ms): " + " ".join(f"{w / 1e3:.2f}/{b / 1e3:.2f}"
                                                            for w, b in zip(walls, busy))]
        return "\n".join(lines)

    def _finish(top: str) -> None:
        prof = _state["prof"]
        _state["prof"], _state["done"] = None, True
        prof.stop()
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        os.unlink(path)
        averages = prof.key_averages()
        table = averages.table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=60)
        try:  # the kernels by their time on the GPU (the key's name differs between torch releases)
            table += "\n\n" + averages.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=80)
        except (AttributeError, KeyError, ValueError):
            table += "\n\n" + averages.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=80)
        with _lock, open(os.path.join(_DIR, "profiles.txt"), "a") as out:
            out.write(f"===== {_ROLE} pid {os.getpid()}: {' '.join(sys.argv)[:300]}\n")
            out.write(_analyse(trace, top) + "\n\n" + table + "\n\n")

    def _window(fn, top: str, counts):
        """Wrap the per-step function: profile calls _SKIP+1 .. _SKIP+_STEPS of those `counts` accepts."""
        import torch

        @functools.wraps(fn)
        def wrapped(*a, **kw):
            if _state["done"] or not counts(*a):
                return fn(*a, **kw)
            with _lock:
                _state["seen"] += 1
                seen = _state["seen"]
            if seen == _SKIP + 1:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
                prof.start()
                _state["prof"] = prof
            if _state["prof"] is None:
                return fn(*a, **kw)
            with torch.profiler.record_function(top):
                out = fn(*a, **kw)
            if seen >= _SKIP + _STEPS:
                _finish(top)
            return out

        return wrapped

    def _install() -> None:
        from spec_runtime.engine import cuda_graphs, runner

        _wrap(runner.ModelRunner, "_batch", "runner.build_batch")
        _wrap(runner.ModelRunner, "forward", "runner.forward")
        _wrap(cuda_graphs.CudaGraphRunner, "run", "graphs.run")
        if _ROLE == "target":
            from target_proc import draft_link, verify, worker

            W = worker.TargetWorker
            for name in ("_plan", "_launch", "_land", "_accept", "_record_step", "_emit", "admit", "flush_outputs",
                         "poll_clients"):
                _wrap(W, name, f"target.{name}")
            for name in ("collect", "send_outcomes", "check"):
                _wrap(draft_link.DraftLink, name, f"draft_link.{name}")
            _wrap(verify.SamplingCache, "get", "verify.sampling_cache")
            for name in ("verify_inputs", "transform_rows", "rejection_sample", "logits_process", "output_logprobs"):
                setattr(worker, name, _ranged(getattr(worker, name), f"verify.{name}"))
            W.step = _window(W.step, "target.step", lambda self: len(self.running) >= _MIN_BATCH)
        else:
            from draft_proc import drafter, ssd, worker
            from protocol.messages import SpecRequest

            D = worker.DraftWorker
            for name in ("_apply_outcomes", "_response", "_take_in", "_commit"):
                _wrap(D, name, f"draft.{name}")
            for name in ("propose", "work_ahead", "_glue", "_fork", "_tree_decode", "skip_work_ahead", "take_in"):
                _wrap(ssd.SSDEngine, name, f"ssd.{name}")
            _wrap(drafter.ModelDrafter, "propose", "drafter.propose")
            D.handle = _window(D.handle, "draft.handle", lambda self, msg: isinstance(msg, SpecRequest))

    _install()
