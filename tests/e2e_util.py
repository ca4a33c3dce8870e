"""Helpers shared by the end-to-end tests: runtimes over tiny models, and references."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from contextlib import contextmanager

import numpy as np
from scipy import stats

from protocol.messages import SamplingParams
from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig
from tiny_models import perturbed_copy  # noqa: F401  (scripts/tiny_models.py, on sys.path through conftest)


def make_config(target: str, draft: str = "", mode: str = "sd", k: int = 3, max_batch_size: int = 4,
                spec_policy: str = "always", **spec) -> RuntimeConfig:
    """Speculation on every step, SSD work-ahead every round and a fixed tree unless
    asked otherwise, so the stats a test checks do not depend on timings of this machine."""
    spec.setdefault("work_ahead", "always")
    spec.setdefault("tree_shape", "fixed")
    return RuntimeConfig(
        target=ModelConfig(path=target),
        draft=ModelConfig(path=draft),
        spec=SpeculativeConfig(mode=mode, k=k, **{"draft_timeout_s": 30.0, **spec}),
        sched=SchedulerConfig(max_batch_size=max_batch_size, max_model_len=256, spec_policy=spec_policy),
        startup_timeout_s=240.0,
    )


def random_prompts(vocab: int, lengths=(5, 9, 17, 30), seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Skip the special ids 0..2 so no prompt contains EOS.
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy decoding, one prompt at a time, never stopping at EOS.
    model: a Hugging Face directory, or a loaded transformers model (its generation
    config is as it was on return)."""
    import torch
    from transformers import AutoModelForCausalLM

    if isinstance(model, str):
        model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    outs = []
    try:
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([p])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=max_new_tokens, pad_token_id=0)
                outs.append(out[0, len(p):].tolist())
    finally:
        model.generation_config.eos_token_id = eos
    return outs


def record_submits(aclient) -> list:
    """Make `aclient.submit` also append (prompt ids, SamplingParams) to the returned list,
    so a test sees what the server asked the engine for."""
    submitted: list = []
    orig_submit = aclient.submit

    def recording_submit(ids, sp):
        submitted.append((list(ids), sp))
        return orig_submit(ids, sp)

    aclient.submit = recording_submit
    return submitted


@contextmanager
def serve_in_thread(app, timeout_s: float = 30.0):
    """Run an ASGI app with uvicorn on a free loopback port in a thread; yields its URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    if not wait_until(lambda: srv.started or not th.is_alive(), timeout_s, 0.02) or not srv.started:
        raise RuntimeError("the server did not start")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        th.join(timeout=10)


def wait_until(predicate, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Poll predicate() until it is true (True) or timeout_s passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return False


def first_tokens(client, prompt, n, seed0, sp_kw):
    """n requests in flight together (continuous batching), one seed each."""
    rids = [client.submit(prompt, SamplingParams(seed=seed0 + i, **sp_kw)) for i in range(n)]
    return [tuple(client._collect(r).token_ids) for r in rids]


def homogeneity_pvalue(a, b, min_count=10) -> float:
    """p-value of a chi-square test that samples a and b share one distribution."""
    ca, cb = Counter(a), Counter(b)
    keys = [k for k in set(ca) | set(cb) if ca[k] + cb[k] >= min_count]
    rows = [[ca[k] for k in keys] + [len(a) - sum(ca[k] for k in keys)],
            [cb[k] for k in keys] + [len(b) - sum(cb[k] for k in keys)]]
    table = np.array(rows)
    table = table[:, table.sum(0) > 0]
    return stats.chi2_contingency(table)[1]


def goodness_of_fit_pvalue(samples, probs: dict, min_expected: float = 10) -> float:
    """p-value of a chi-square test that `samples` were drawn from `probs` ({outcome:
    probability}). Each outcome expected at least min_expected times is a bin of its own;
    the others, and any outcome outside `probs`, share one bin, which holds enough of the
    least likely outcomes to be expected at least min_expected times too."""
    n, counts = len(samples), Counter(samples)
    keys = sorted((k for k in probs if n * probs[k] >= min_expected), key=lambda k: -probs[k])
    while keys and n * (1.0 - sum(probs[k] for k in keys)) < min_expected:
        keys.pop()
    observed = [counts[k] for k in keys] + [n - sum(counts[k] for k in keys)]
    expected = [n * probs[k] for k in keys] + [n - sum(n * probs[k] for k in keys)]
    return stats.chisquare(observed, expected).pvalue


class Borrowed:
    """A launcher (such as a shared deployment fixture) whose shutdown() is left to its owner,
    so a test's Client can be closed without taking it down."""

    def __init__(self, launcher):
        self._launcher = launcher

    def __getattr__(self, name):
        return getattr(self._launcher, name)

    def shutdown(self) -> None:
        pass
