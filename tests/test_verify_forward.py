"""A speculating step's verify laid out while the draft answers (target_proc/verify_forward.py).

The laid-out forward must verify exactly what a forward built after the answer verifies:
the same tokens and logprobs, greedy and sampled, whatever the answer's length (full, shorter
than the layout, none for some sequences, none at all), near max_tokens, and with some
drafts wrong. In-process: a TargetWorker (SD mode) over a tiny random llama, with a draft
link that answers from the target's own greedy output.
"""

from __future__ import annotations

import functools
import gc
import random

import numpy as np
import pytest
import torch
from conftest import save_tiny_model

from protocol.sparse_q import DraftTokens
from target_proc import verify_forward, worker as worker_module
from target_proc.no_draft import NoDraft
from test_overlap import _RUNNERS, _prompts, _serve, _worker

K = 4


class _ReferenceDraft(NoDraft):
    """Answers each sequence with up to K tokens of `reference` (request id -> the target's
    greedy tokens) from where it stands; `lengths` picks each answer's length, and every
    `wrong`-th answer has a wrong first token."""

    present = alive = True

    def __init__(self, reference: dict[str, list[int]], lengths, wrong: int = 0) -> None:
        self.reference, self.lengths, self.wrong, self.answers = reference, lengths, wrong, 0

    def collect(self, seqs):
        specs = {}
        for s in seqs:
            n = self.lengths()
            if n is None:
                continue
            ref = self.reference[s.request_id][s.num_generated:s.num_generated + n]
            ids = np.array(ref or [0] * n, dtype=np.int64)[:n]
            self.answers += 1
            if self.wrong and self.answers % self.wrong == 0 and len(ids):
                ids[0] = (ids[0] + 1) % 300
            specs[s.seq_id] = DraftTokens(ids)
        return specs


def _requests(temperature: float, max_tokens: int = 24):
    return [(p, dict(max_tokens=max_tokens + 3 * i, temperature=temperature, seed=11 + i, ignore_eos=True,
                     logprobs=1 if temperature else None)) for i, p in enumerate(_prompts(3, seed=8))]


def _run(target, requests, draft, monkeypatch, laid_out: bool | None, device: str = "cpu"):
    """Serve `requests` in SD mode, every step speculating; returns the outputs and, per laid-out
    step, whether its forward ran as laid out and the most drafts it was laid out for."""
    used = []
    real = verify_forward.forward_laid_out

    def counted(worker, lo, specs):
        fwd = real(worker, lo, specs)
        used.append((fwd is not None, max(lo.limits)))
        return fwd

    monkeypatch.setattr(worker_module, "forward_laid_out", counted)
    # On the CPU no graph runs the layout: laid out eagerly here (the worker lays out for graphs only).
    eager = functools.partial(verify_forward.lay_out, eager=device == "cpu")
    if laid_out is not None:  # None: the worker's own
        monkeypatch.setattr(worker_module, "lay_out", eager if laid_out else lambda *a: None)
    worker, clients = _worker(target, False, mode="sd", draft=draft, k=K, device=device)
    worker.policy.use_speculation = lambda batch: True
    out, _ = _serve(worker, clients, requests)
    assert worker.engine_stats().num_verifies_laid_out == sum(laid for laid, _ in used)
    return out, used


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("answers", ["full", "mixed"])
def test_the_laid_out_verify_gives_the_same_tokens_and_logprobs(tiny_pair, monkeypatch, temperature, answers):
    requests = _requests(temperature)
    ar, _ = _run(tiny_pair.target, [(p, dict(sp, temperature=0.0, logprobs=None)) for p, sp in requests],
                 NoDraft(), monkeypatch, laid_out=False)
    reference = {rid: toks for rid, (toks, _, _) in ar.items()}
    got = {}
    for laid_out in (False, True):
        rng = random.Random(5)
        lengths = (lambda: K) if answers == "full" else (lambda: rng.choice([K, K, K - 1, 1, 0, None]))
        draft = _ReferenceDraft(reference, lengths, wrong=0 if answers == "full" else 5)
        got[laid_out] = _run(tiny_pair.target, requests, draft, monkeypatch, laid_out)
    # The same tokens; logprobs to float rounding (a sequence with fewer drafts than laid out
    # runs in a forward of more tokens, whose CPU kernels add in another order).
    for rid, (toks, reason, lps) in got[False][0].items():
        assert got[True][0][rid][:2] == [toks, reason]
        assert np.allclose([x[0] for x in got[True][0][rid][2]], [x[0] for x in lps], atol=1e-4)
    used = [laid for laid, _ in got[True][1]]
    assert got[False][1] == [] and sum(used) >= 5  # the laid-out forward ran
    assert all(used) if answers == "full" else not all(used)  # an answer without drafts is laid out anew
    if temperature == 0.0:  # greedy: the target's own tokens, whatever the drafts
        assert {rid: toks for rid, (toks, _, _) in got[True][0].items()} == reference


def test_an_answer_shorter_than_every_layout_is_laid_out_anew(tiny_pair, monkeypatch):
    """No sequence answered with drafts (a graph of one token per sequence would run it): the
    forward is built anew, and the tokens are AR's."""
    requests = _requests(0.0, max_tokens=10)
    ar, _ = _run(tiny_pair.target, requests, NoDraft(), monkeypatch, laid_out=False)
    out, used = _run(tiny_pair.target, requests, _ReferenceDraft({}, lambda: None), monkeypatch, laid_out=True)
    assert out == ar and any(k for _, k in used)
    assert all(k == 0 for laid, k in used if laid)  # as laid out only where every sequence was at its last token



def test_on_the_cpu_the_worker_builds_each_verify_after_the_answer(tiny_pair, monkeypatch):
    """No graph would run a layout there: the forward is built once the answer is in, as before."""
    requests = _requests(0.0)
    ar, _ = _run(tiny_pair.target, requests, NoDraft(), monkeypatch, laid_out=False)
    monkeypatch.undo()
    draft = _ReferenceDraft({rid: toks for rid, (toks, _, _) in ar.items()}, lambda: K)
    out, used = _run(tiny_pair.target, requests, draft, monkeypatch, laid_out=None)
    assert out == ar and used == [] and draft.answers >= 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_graph_replays_the_laid_out_verify(tmp_path, monkeypatch):
    """With CUDA graphs the layout is loaded into a graph's static inputs before the answer
    comes and replayed after the drafts are written into them: the same tokens as a forward
    built after the answer; head_dim 128 (flashinfer's prefill is built for it)."""
    target = save_tiny_model(tmp_path / "tiny", "llama", hidden_size=256, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=512, num_hidden_layers=2)
    _drop_gpu_runners()  # each sizes its KV pool from the memory left: one cached by another test takes it
    try:
        _compare_on_gpu(target, monkeypatch)
    finally:
        _drop_gpu_runners()


def _drop_gpu_runners() -> None:
    for key in [key for key in _RUNNERS if key[2] != "cpu"]:
        del _RUNNERS[key]
    gc.collect()
    torch.cuda.empty_cache()


def _compare_on_gpu(target: str, monkeypatch) -> None:
    requests = _requests(0.0) + [(p, dict(sp, temperature=0.7)) for p, sp in _requests(0.7)]
    ar, _ = _run(target, requests[:3], NoDraft(), monkeypatch, laid_out=False, device="cuda:0")
    reference = {str(i + j): ar[str(i)][0] for j in (0, 3) for i in range(3)}
    got = {}
    for laid_out in (False, True):
        rng = random.Random(6)
        draft = _ReferenceDraft(reference, lambda: rng.choice([K, K, K, K - 1, 0]), wrong=7)
        got[laid_out] = _run(target, requests, draft, monkeypatch, laid_out, device="cuda:0")
    for rid, (toks, reason, lps) in got[False][0].items():
        assert got[True][0][rid][:2] == [toks, reason], rid
        assert np.allclose([x[0] for x in got[True][0][rid][2]], [x[0] for x in lps], atol=1e-2)
    assert sum(laid for laid, _ in got[True][1]) >= 5


def test_the_step_phases_script_times_each_speculating_step(tiny_pair, tmp_path):
    """scripts/step_phases (docs/benchmarks.md's phases of a verify): a line of medians every 50
    speculating steps at batch 1 from the target process; NO_LAYOUT names its runs. Laid out
    (eagerly on the CPU: STEP_PHASES_EAGER), a parts line follows each line of phases."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def phases(**env_vars) -> list[str]:
        out = tmp_path / "_".join(env_vars)
        out.mkdir()
        env = dict(os.environ, PYTHONPATH=f"{root / 'scripts' / 'step_phases'}{os.pathsep}{root}",
                   STEP_PHASES_DIR=str(out), **env_vars)
        subprocess.run([sys.executable, str(root / "scripts" / "bench_e2e.py"), "--target", tiny_pair.target,
                        "--draft", tiny_pair.draft, "--target-device", "cpu", "--draft-device", "cpu", "--modes", "sd",
                        "--k", "4", "--prompt-lens", "16", "--batch-sizes", "1", "--temperatures", "0",
                        "--max-tokens", "60", "--warmup-tokens", "0", "--out", str(out / "e2e.json")],
                       env=env, capture_output=True, text=True, timeout=300, check=True)
        return (out / "phases.txt").read_text().splitlines()

    lines = phases(NO_LAYOUT="1")
    assert lines and all(" no layout sd n=50 host pre-replay " in ln for ln in lines), lines
    launched = float(lines[0].split("launch->landed ")[1])
    assert launched > 0
    lines = phases(STEP_PHASES_EAGER="1")
    assert len(lines) >= 2 and " layout sd n=50 host pre-replay " in lines[0], lines
    parts = dict(kv.rsplit(" ", 1) for kv in lines[1].split(" parts n=50 ")[1].split(", "))
    assert list(parts) == ["pack", "upload", "to replay", "rest", "transform"], lines
    assert float(parts["upload"]) > 0 and float(parts["pack"]) > 0, lines
