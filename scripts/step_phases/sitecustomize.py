"""Where a speculating step's verify spends its time before and on the GPU, without a profiler.

Python imports `sitecustomize` at start-up from its path. With this folder first on
PYTHONPATH, each target process times its speculating steps at batch 1 (every batch size
with STEP_PHASES_ALL=1) with host clocks and CUDA events, and every 50 such steps appends the
medians (after each run's first 10 steps) to $STEP_PHASES_DIR/phases.txt (default /tmp):

  host pre-replay     TargetWorker._launch's start to the CUDA graph's replay call
  host replay call    the replay call itself
  host post-replay    the replay's return to the end of _launch (logits, rejection sampling queued)
  gpu launch->replay  GPU time from an event recorded at _launch's start to one just before
                      the replay: the GPU idles there, as the step before it has landed
  gpu graph           the replay on the GPU
  gpu post            what _launch queued after the replay
  sync wait           the landing's wait for the step's tokens
  launch->landed      _launch's start to the tokens on the host

A laid-out verify's host pre-replay also splits into parts, written as a `parts` line:

  pack                the answer's drafts packed into arrays (protocol.sparse_q.pack)
  upload              their one host-to-device copy (forward_batch.upload_int64)
  to replay           ModelRunner.run_prepared's entry to the replay call (with no graph,
                      to the end of _launch: the eager forward's host time)
  rest                the rest: the arrays built around them, the ids written into the
                      graph's inputs (index_copy_), the verify's inputs

and `transform` after the replay (the benchmark oracle's logits, when it is set).
STEP_PHASES_EAGER=1 lays out forwards no graph replays too (as on the CPU), so their parts
show as well.

NO_LAYOUT=1 makes the worker build each verify once the answer is in, as it does where no
CUDA graph would replay a layout (target_proc/verify_forward.py): the A/B of docs/benchmarks.md.

    source scripts/gpu_common.sh && set_up_run /tmp/out
    PYTHONPATH=$PWD/scripts/step_phases:$PYTHONPATH STEP_PHASES_DIR=$OUT python3 scripts/bench_e2e.py ...

A CPU run records the host times only (no graph, no events).
"""

import collections
import os
import sys
import time

if "target" in sys.argv[:3]:  # the target child (spec_runtime.child_boot target ...)
    import numpy as np
    import torch

    _NAMES = ("host pre-replay", "host replay call", "host post-replay", "gpu launch->replay", "gpu graph",
              "gpu post", "sync wait", "launch->landed")
    _PARTS = ("pack", "upload", "to replay", "rest", "transform")
    _rows: dict = collections.defaultdict(list)
    _parts: dict = collections.defaultdict(list)
    _step: dict = {}

    class _NoEvent:
        def record(self) -> None:
            pass

        def elapsed_time(self, other) -> float:
            return 0.0

    def _event():
        if not torch.cuda.is_available():
            return _NoEvent()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _dump() -> None:
        label = "no layout" if os.environ.get("NO_LAYOUT") else "layout"
        with open(os.path.join(os.environ.get("STEP_PHASES_DIR", "/tmp"), "phases.txt"), "a") as f:
            for kind, rows in _rows.items():
                a = np.array(rows[10:] or rows)
                f.write(f"pid {os.getpid()} {label} {kind} n={len(rows)} "
                        + ", ".join(f"{name} {np.median(a[:, i]):.3f}" for i, name in enumerate(_NAMES)) + "\n")
            for kind, rows in _parts.items():
                a = np.array(rows[10:] or rows)
                f.write(f"pid {os.getpid()} {label} {kind} parts n={len(rows)} "
                        + ", ".join(f"{name} {np.median(a[:, i]):.3f}" for i, name in enumerate(_PARTS)) + "\n")

    def _timed_part(name, fn):
        """fn, its host time added to the step's part `name` (a speculating step's only)."""
        def timed(*args, **kwargs):
            if not _step:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            _step[name] = _step.get(name, 0.0) + time.perf_counter() - t
            return out
        return timed

    def _install() -> None:
        from spec_runtime.engine import runner as runner_mod
        from target_proc import verify_forward, worker

        W = worker.TargetWorker
        run_prepared = runner_mod.ModelRunner.run_prepared

        def timed_run_prepared(self, prep):
            if _step:
                _step["rp0"] = time.perf_counter()
            return run_prepared(self, prep)

        runner_mod.ModelRunner.run_prepared = timed_run_prepared
        verify_forward.pack = _timed_part("pack", verify_forward.pack)
        verify_forward.upload_int64 = _timed_part("upload", verify_forward.upload_int64)
        verify_forward.transform_rows = _timed_part("transform", verify_forward.transform_rows)
        launch, land, replay = W._launch, W._land, torch.cuda.CUDAGraph.replay
        every = bool(os.environ.get("STEP_PHASES_ALL"))

        def timed_launch(self, seqs, specs, plan, *rest):
            _step.clear()
            if plan.speculate and (every or len(seqs) == 1):
                _step.update(on=True, e0=_event(), h0=time.perf_counter())
            out = launch(self, seqs, specs, plan, *rest)
            if _step:
                _step.update(h3=time.perf_counter(), e3=_event(), kind=plan.kind)
            return out

        def timed_land(self, run, upcoming=None):
            if not _step:
                return land(self, run, upcoming)
            if "h1" not in _step:  # no graph replayed
                _step.update(h1=_step["h3"], h2=_step["h3"], e1=_step["e3"], e2=_step["e3"])
            h = time.perf_counter()
            if run.done is not None:
                run.done.synchronize()
            h4 = time.perf_counter()
            s = dict(_step)
            _step.clear()
            out = land(self, run, upcoming)
            rows = _rows[s["kind"]]
            rows.append((1e3 * (s["h1"] - s["h0"]), 1e3 * (s["h2"] - s["h1"]), 1e3 * (s["h3"] - s["h2"]),
                         s["e0"].elapsed_time(s["e1"]), s["e1"].elapsed_time(s["e2"]), s["e2"].elapsed_time(s["e3"]),
                         1e3 * (h4 - h), 1e3 * (h4 - s["h0"])))
            if "rp0" in s:  # laid out: the pre-replay's parts (ms)
                pack, upload, to_replay = s.get("pack", 0.0), s.get("upload", 0.0), s["h1"] - s["rp0"]
                _parts[s["kind"]].append(tuple(1e3 * x for x in (
                    pack, upload, to_replay, s["h1"] - s["h0"] - pack - upload - to_replay, s.get("transform", 0.0))))
            if len(rows) % 50 == 0:
                _dump()
            return out

        def timed_replay(graph):
            if _step:
                _step.update(h1=time.perf_counter(), e1=_event())
            replay(graph)
            if _step:
                _step.update(e2=_event(), h2=time.perf_counter())

        W._launch, W._land, torch.cuda.CUDAGraph.replay = timed_launch, timed_land, timed_replay
        if os.environ.get("NO_LAYOUT"):
            worker.lay_out = lambda *a, **kw: None
        elif os.environ.get("STEP_PHASES_EAGER"):
            lay_out = worker.lay_out
            worker.lay_out = lambda *a, **kw: lay_out(*a, **{**kw, "eager": True})

    _install()
