"""Sequence-dependent logit processors (penalties, logit bias, min_tokens) and min-p:
their definitions, and exactness of speculative sampling under them.

The joint test runs the rejection sampler over several rounds with random numbers of
drafts from a draft that knows nothing of the processors, and compares the joint of
the first three tokens with the exact processed target chain (chi-square and TV).
"""

from __future__ import annotations

import itertools

import torch

from protocol.messages import SamplingParams
from spec_runtime.logits_process import LogitsProcess, token_logprobs
from spec_runtime.rejection import rejection_sample
from spec_runtime.sampling import SamplingTensors, hash32, target_probs
from test_sampling import _bigram, _check_dist, _draft_chain, _reference_probs

EOS = 0


def _reference_process(logits: torch.Tensor, sp: SamplingParams, prompt: list[int], output: list[int]):
    """The textbook definitions for one position: [V] -> [V] (vLLM's order)."""
    x = logits.double().clone()
    for t, b in sp.logit_bias.items():
        x[t] += b
    if len(output) < sp.min_tokens:
        for t in list(sp.stop_token_ids) + ([] if sp.ignore_eos else [EOS]):
            x[t] = float("-inf")
    for t in set(prompt) | set(output):
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t in set(output):
        x[t] -= sp.frequency_penalty * output.count(t) + sp.presence_penalty
    return x


def _reference_min_p(logits: torch.Tensor, t: float, min_p: float, k: int, p: float) -> torch.Tensor:
    probs = torch.softmax(logits.double() / t, -1)
    kept = torch.where(probs >= min_p * probs.max(), logits.double(), float("-inf"))
    return _reference_probs(kept, t, k, p)


def test_apply_matches_reference_per_verify_slot():
    g = torch.Generator().manual_seed(0)
    b, s, vocab = 6, 4, 12
    params = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(presence_penalty=0.8, frequency_penalty=-0.4),
        SamplingParams(logit_bias={3: 5.0, 4: -100.0}, min_tokens=6, stop_token_ids=[5]),
        SamplingParams(),  # no processor: passes through bit for bit
        SamplingParams(repetition_penalty=0.6, frequency_penalty=1.1, min_tokens=3, ignore_eos=True,
                       stop_token_ids=[7]),
        SamplingParams(min_tokens=2),
    ]
    tokens = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 9, 6, 4, 8, 7)]
    num_prompt = [3, 4, 2, 4, 5, 6]
    logits = torch.randn(b, s, vocab, generator=g) * 3
    drafts = torch.randint(0, vocab, (b, s - 1), generator=g)
    drafts[1, 2:] = -1  # a row with fewer drafts: its padded slots are never used
    proc = LogitsProcess.build(params, tokens, num_prompt, [EOS], vocab, "cpu")
    out = proc.apply(logits, drafts)
    for i, sp in enumerate(params):
        prompt, output = tokens[i][: num_prompt[i]], tokens[i][num_prompt[i]:]
        for slot in range(s):
            fed = [t for t in drafts[i, :slot].tolist() if t >= 0]
            if len(fed) < slot:
                continue
            ref = _reference_process(logits[i, slot], sp, prompt, output + fed)
            torch.testing.assert_close(out[i, slot].double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[3], logits[3])
    assert LogitsProcess.build([SamplingParams()] * 2, tokens[:2], num_prompt[:2], [EOS], vocab, "cpu") is None


def test_min_p_in_target_probs_matches_reference():
    g = torch.Generator().manual_seed(1)
    rows = [(1.0, 0, 1.0, 0.1), (0.7, 5, 1.0, 0.3), (1.5, 0, 0.9, 0.05), (1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.9),
            (1.0, 0, 1.0, 1.0)]
    st = SamplingTensors.from_params([(t, k, p, i) for i, (t, k, p, _) in enumerate(rows)],
                                     min_p=[m for *_, m in rows])
    logits = torch.randn(len(rows), 30, generator=g) * 2
    probs = target_probs(logits, st)
    for i, (t, k, p, m) in enumerate(rows):
        ref = _reference_probs(logits[i], 0.0, 0, 1.0) if t == 0 else _reference_min_p(logits[i], t, m, k, p)
        torch.testing.assert_close(probs[i], ref, atol=1e-6, rtol=1e-5)
    assert (probs[5] > 0).sum() == 1  # min_p = 1 keeps the most likely token only


def test_multi_round_joint_with_processors_is_exact():
    """Penalties, logit bias, min_tokens and min-p on the target; the draft proposes from
    its own unprocessed distribution. The first three tokens must follow the processed
    target chain exactly, through rounds that verify 0..K drafts each."""
    n, vocab, k, length = 60_000, 6, 2, 3
    target_table, draft_table = _bigram(vocab, seed=11, peak=1)
    sp = SamplingParams(temperature=0.9, repetition_penalty=1.6, frequency_penalty=0.5, presence_penalty=0.3,
                        logit_bias={2: 1.0}, min_tokens=2, min_p=0.05, max_tokens=length)
    prompt = [1, 3]
    st = SamplingTensors.from_params([(sp.temperature, 0, 1.0, 5000 + i) for i in range(n)], min_p=[sp.min_p] * n)
    st_draft = SamplingTensors.from_params([(1.0, 0, 1.0, 5000 + i) for i in range(n)])
    prev, pos = torch.full((n,), prompt[-1]), torch.full((n,), len(prompt))
    out = torch.full((n, length * (k + 1) + 1), -1)
    count = torch.zeros(n, dtype=torch.long)
    for rnd in range(length):
        d, q_ids, q_probs = _draft_chain(draft_table, prev, st_draft, pos, k, 4)
        m = hash32(st.seed, pos, 60 + rnd, torch.zeros(1, dtype=torch.long)).squeeze(-1) % (k + 1)
        d = torch.where(torch.arange(k) < m.unsqueeze(1), d, -1)
        logits = target_table[torch.cat([prev.unsqueeze(1), d.clamp(min=0)], 1)]
        histories = [prompt + row[:c] for row, c in zip(out.tolist(), count.tolist())]
        proc = LogitsProcess.build([sp] * n, histories, [len(prompt)] * n, [EOS], vocab, "cpu")
        res = rejection_sample(proc.apply(logits, d), d, m, q_ids, q_probs, st, pos)
        cols = count.unsqueeze(1) + torch.arange(k + 1)
        keep = res.output_token_ids >= 0
        out.scatter_(1, torch.where(keep, cols, out.shape[1] - 1), torch.where(keep, res.output_token_ids, -1))
        count, pos, prev = count + res.num_output, pos + res.num_output, res.last_token_ids
    assert (count >= length).all()

    def p_next(output: list[int]) -> torch.Tensor:
        last = (prompt + output)[-1]
        x = _reference_process(target_table[last], sp, prompt, output)
        return _reference_min_p(x.float(), sp.temperature, sp.min_p, 0, 1.0)

    joint = torch.zeros([vocab] * length)
    for seq in itertools.product(range(vocab), repeat=length):
        pr = 1.0
        for i in range(length):
            pr *= p_next(list(seq[:i]))[seq[i]].item()
        joint[seq] = pr
    assert joint[EOS].sum() == 0 and joint[:, EOS].sum() == 0  # min_tokens = 2 masks EOS twice
    codes = (out[:, 0] * vocab + out[:, 1]) * vocab + out[:, 2]
    _check_dist(codes, joint.flatten() / joint.sum(), max_tv=0.03)


def test_token_logprobs_are_the_raw_log_softmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 20, generator=g) * 2
    ids = torch.randint(0, 20, (3, 4), generator=g)
    ids[1, 2:] = -1
    lp, top_ids, top_lp = token_logprobs(logits, ids, 5)
    lsm = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp, torch.where(ids >= 0, lsm.gather(-1, ids.clamp(min=0)[..., None])[..., 0], 0.0))
    torch.testing.assert_close(top_lp, lsm.topk(5, -1).values)
    assert torch.equal(lsm.gather(-1, top_ids), top_lp)
    assert token_logprobs(logits, ids)[1] is None
