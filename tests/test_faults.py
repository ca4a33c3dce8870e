"""Faults of the processes: nothing lost, nothing hung.

A killed or stalled draft costs speculation, never a request: in-flight requests finish
with the same greedy output as target-only decoding, a new draft is started, and
speculation resumes. A killed target fails every pending call with a clear error. A
killed parent takes its children with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from conftest import save_tiny_model
from e2e_util import random_prompts, wait_until
from protocol.messages import SamplingParams
from spec_runtime.client import Client, RequestFailed
from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig

LONG = SamplingParams(max_tokens=400, ignore_eos=True)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The kill tests wait long for an answer, so on a loaded host a round without speculation
# can only come from the link (a disconnect), never from a slow answer; the stall test
# sets a short timeout.
PATIENT_S = 60.0


def _cfg(target, draft, timeout_s=PATIENT_S):
    return RuntimeConfig(
        target=ModelConfig(path=target), draft=ModelConfig(path=draft),
        spec=SpeculativeConfig(mode="sd", k=3, draft_timeout_s=timeout_s),
        sched=SchedulerConfig(max_batch_size=4, max_model_len=512, spec_policy="always"), startup_timeout_s=240.0,
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = save_tiny_model(tmp_path_factory.mktemp("faults") / "t", "llama")
    prompts = random_prompts(384, seed=7)
    cfg = _cfg(target, target).replace(spec=SpeculativeConfig(mode="ar"))
    with Client(cfg) as client:
        ar = [r.token_ids for r in client.generate_batch(prompts, LONG)]
    return target, prompts, ar


def _run_with_fault(client, prompts, fault):
    """Generate all prompts at once; call fault() once the first tokens stream back."""
    rids = [client.submit(p, LONG) for p in prompts]
    results: dict[str, list[int]] = {}
    started = threading.Event()

    def consume(rid):
        ids = []
        for out in client.stream_outputs(rid, timeout_s=30):
            ids.extend(out.new_token_ids)
            started.set()
        results[rid] = ids

    threads = [threading.Thread(target=consume, args=(r,)) for r in rids]
    for t in threads:
        t.start()
    assert started.wait(120)
    fault()
    for t in threads:
        t.join(300)  # a hang guard, not a speed check
    assert not any(t.is_alive() for t in threads), "requests did not finish after the fault"
    return [results[r] for r in rids]



def test_draft_killed_mid_generation(setup):
    target, prompts, ar = setup
    with Client(_cfg(target, target)) as client:
        draft_pid = client.launcher.pids()["draft"]
        outs = _run_with_fault(client, prompts, lambda: os.kill(draft_pid, signal.SIGKILL))
        assert outs == ar  # nothing lost, nothing different
        # The dead peer is noticed from the socket, not by waiting out the (long) timeout
        # round after round: at most the round in flight at the kill ends early.
        assert client.engine_stats().num_draft_timeouts <= 1
        # A new draft is started and speculation resumes.
        assert wait_until(lambda: client.launcher.num_draft_restarts == 1, 120)
        assert client.launcher.pids()["draft"] != draft_pid
        before = client.engine_stats().totals.num_draft_tokens
        assert wait_until(lambda: client.engine_stats().draft_alive, 10)
        res = client.generate_batch(prompts, LONG)
        assert [r.token_ids for r in res] == ar
        assert client.engine_stats().totals.num_draft_tokens > before


def test_draft_killed_while_idle(setup):
    """The restarted draft re-binds the same address; the target's socket must take it."""
    target, prompts, ar = setup
    with Client(_cfg(target, target)) as client:
        os.kill(client.launcher.pids()["draft"], signal.SIGKILL)
        assert wait_until(lambda: client.launcher.num_draft_restarts == 1, 120)
        assert wait_until(lambda: client.engine_stats().draft_alive, 10)
        res = client.generate_batch(prompts, LONG)
        assert [r.token_ids for r in res] == ar
        totals = client.engine_stats().totals
        assert totals.num_draft_tokens > 0 and totals.num_ar_fallback_rounds == 0


def _stall_and_scrape(client, draft) -> None:
    """Stop the draft; then stats are answered (from the counters it pushed last, never
    asking it) while the target keeps stepping."""
    draft.suspend()
    steps = client.engine_stats(timeout_s=10).num_steps
    for _ in range(3):
        assert wait_until(lambda: client.engine_stats(timeout_s=10).num_steps > steps, 60)
        steps = client.engine_stats(timeout_s=10).num_steps


def test_draft_stalled_then_resumed(setup):
    target, prompts, ar = setup
    with Client(_cfg(target, target, timeout_s=0.5)) as client:
        draft = psutil.Process(client.launcher.pids()["draft"])
        outs = _run_with_fault(client, prompts, lambda: _stall_and_scrape(client, draft))
        assert outs == ar
        st = client.engine_stats()
        assert st.num_draft_timeouts == 1  # one timeout, then plain decoding without waiting
        assert st.totals.num_ar_fallback_rounds > 0
        draft.resume()
        # Once it answers a probe, speculation resumes.
        time.sleep(1.5)
        before = client.engine_stats().totals.num_draft_tokens
        res = client.generate_batch(prompts, LONG)
        assert [r.token_ids for r in res] == ar
        assert client.engine_stats().totals.num_draft_tokens > before


def test_target_killed_fails_pending_calls(setup):
    target, prompts, _ = setup
    client = Client(_cfg(target, target))
    try:
        pid = client.launcher.pids()["target"]
        errors: list[Exception] = []

        def run():
            try:
                client.generate(prompts[0], SamplingParams(max_tokens=100000 // 1000, ignore_eos=True))
                client.generate(prompts[0], SamplingParams(max_tokens=400, ignore_eos=True))
            except RequestFailed as e:
                errors.append(e)

        t = threading.Thread(target=run)
        t.start()
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        t.join(120)  # a hang guard, not a speed check
        assert not t.is_alive()
        assert client.launcher.dead_child() == "target"
        with pytest.raises(RequestFailed, match="target process died"):
            client.generate(prompts[0], SamplingParams(max_tokens=4))
    finally:
        client.close()


def test_children_exit_when_parent_is_killed(setup, tmp_path):
    target, _, _ = setup
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {ROOT!r})\n"  # the code under test, not an installed copy
        "from spec_runtime.client import Client\n"
        "from spec_runtime.config import *\n"
        f"cfg = RuntimeConfig(target=ModelConfig(path={target!r}), draft=ModelConfig(path={target!r}),"
        " spec=SpeculativeConfig(mode='sd', k=2), sched=SchedulerConfig(max_batch_size=2, max_model_len=128, spec_policy='always'))\n"
        "c = Client(cfg)\n"
        "print(' '.join(str(p) for p in c.launcher.pids().values()), flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        parent.kill()
        parent.wait()

        def gone():
            return all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)

        assert wait_until(gone, 30)
    finally:
        parent.kill()
