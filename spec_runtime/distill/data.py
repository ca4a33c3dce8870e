"""Teacher data: the target's own continuations of a prompt set, with its top-k log-probs.

Each sample is one prompt (chat-templated when the tokenizer has a template) followed by
the target's continuation, up to and including its end-of-sequence token. The target's
distribution at every continuation position is kept as its top-k token ids and their
log-probs under the full softmax (temperature 1), so the draft is trained towards the
target's own distribution whatever temperature produced the text. The set is written
after every generation batch, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from importlib import resources

import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


@dataclass
class TeacherSample:
    token_ids: list[int]  # prompt + continuation
    start: int  # first position whose next token is a continuation token (prompt length - 1)
    topk_ids: torch.Tensor  # [num_continuation, k] int32
    topk_logprobs: torch.Tensor  # [num_continuation, k] float16, largest first
    prompt_index: int


def load_prompts(path: str = "") -> list[str]:
    """One prompt per line (blank lines and lines starting with '#' skipped); "" = the shipped set."""
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"prompts file {path!r} does not exist")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    else:
        text = resources.files("spec_runtime.distill").joinpath("prompts.txt").read_text(encoding="utf-8")
    prompts = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise ValueError(f"no prompts in {path or 'the shipped prompt set'}")
    return [p.replace("\\n", "\n") for p in prompts]


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """As `spec-runtime generate` encodes it: chat-templated when the tokenizer has a template."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
    else:
        ids = tokenizer.encode(prompt)
    return [int(t) for t in ids]


_SENTINEL = "\x00user-turn\x00"


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids that open a user turn (the chat template up to a user message's text), or
    the BOS token alone for a tokenizer without a template."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
        return [int(t) for t in tokenizer.encode(text[:text.index(_SENTINEL)], add_special_tokens=False)]
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


@torch.inference_mode()
def sample_prompts(target, tokenizer, eos_ids: list[int], n: int, *, batch_size: int, seed: int,
                   max_tokens: int = 64) -> list[str]:
    """`n` distinct prompts written by the target itself: user turns sampled at temperature 1."""
    prefix = user_turn_prefix(tokenizer)
    if not prefix:
        raise ValueError("--self-prompts needs a chat template or a BOS token to start a user turn from")
    device = next(target.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    eos = set(eos_ids)
    found: dict[str, None] = {}
    bar = tqdm(total=n, desc="Sampling prompts", unit="prompt", file=sys.stderr,
               mininterval=1.0 if sys.stderr.isatty() else 30.0)
    for attempt in range(8 * max(1, -(-n // batch_size))):
        if len(found) >= n:
            break
        torch.manual_seed(seed * 1_000_003 + 7919 * (attempt + 1))
        input_ids = torch.tensor([prefix] * batch_size, device=device)
        out = target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_tokens,
                              eos_token_id=eos_ids, pad_token_id=pad_id)
        for row in out[:, len(prefix):].tolist():
            end = _continuation_length(row, eos)
            if end == len(row) and row[-1] not in eos:
                continue  # the turn did not end within max_tokens
            text = tokenizer.decode(row[:end - 1], skip_special_tokens=True).strip()
            if len(text) >= 8 and text not in found and len(found) < n:
                found[text] = None
                bar.update(1)
    bar.close()
    if len(found) < n:
        logger.warning("the target wrote %d distinct prompts of the %d asked for", len(found), n)
    return list(found)


def save_samples(samples: list[TeacherSample], path: str) -> None:
    tmp = path + ".tmp"
    torch.save([{"token_ids": torch.tensor(s.token_ids, dtype=torch.int32), "start": s.start,
                 "topk_ids": s.topk_ids, "topk_logprobs": s.topk_logprobs, "prompt_index": s.prompt_index}
                for s in samples], tmp)
    os.replace(tmp, path)


def load_samples(path: str) -> list[TeacherSample]:
    # A local file this tool wrote; weights_only keeps torch.load from unpickling anything but tensors.
    raw = torch.load(path, weights_only=True)
    return [TeacherSample(r["token_ids"].tolist(), int(r["start"]), r["topk_ids"], r["topk_logprobs"],
                          int(r["prompt_index"])) for r in raw]


def _continuation_length(row: list[int], eos_ids: set[int]) -> int:
    for i, t in enumerate(row):
        if t in eos_ids:
            return i + 1
    return len(row)


@torch.inference_mode()
def generate_samples(target, tokenizer, prompts: list[str], eos_ids: list[int], *, max_new_tokens: int,
                     samples_per_prompt: int, temperature: float, batch_size: int, top_k: int,
                     path: str, seed: int) -> list[TeacherSample]:
    """Generate (or finish generating) the teacher set, writing it to `path` after each batch."""
    samples = load_samples(path) if os.path.isfile(path) else []
    # A resumed run may use fewer prompts (--num-prompts) than the interrupted one.
    samples = [s for s in samples if s.prompt_index < len(prompts)]
    jobs = [(i, j) for i in range(len(prompts)) for j in range(samples_per_prompt)]
    done = {(s.prompt_index, j) for j, s in _sample_numbers(samples)}
    todo = [job for job in jobs if job not in done]
    if samples:
        logger.info("teacher data: %d samples from %s, %d to generate", len(samples), path, len(todo))
    device = next(target.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    eos = set(eos_ids)
    encoded = {}
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc="Generating teacher data", unit="sample",
               file=sys.stderr, mininterval=1.0 if sys.stderr.isatty() else 30.0)
    # Greedy jobs and sampled jobs go in separate batches (generate takes one setting per call).
    for greedy in (True, False):
        group = [job for job in todo if (job[1] == 0) == greedy]
        for b in range(0, len(group), batch_size):
            batch = group[b:b + batch_size]
            ids = [encoded.setdefault(i, encode_prompt(tokenizer, prompts[i])) for i, _ in batch]
            width = max(map(len, ids))
            input_ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in ids], device=device)
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
            torch.manual_seed(seed * 1_000_003 + b * 2 + int(greedy))
            sample_kw = {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature,
                                                             "top_k": 0, "top_p": 1.0}
            out = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                  eos_token_id=eos_ids, pad_token_id=pad_id, output_logits=True,
                                  return_dict_in_generate=True, **sample_kw)
            new = out.sequences[:, width:].tolist()
            # [batch, steps, vocab] -> top-k log-probs under the raw (temperature 1) distribution
            logprobs = torch.stack(out.logits, 1).float().log_softmax(-1)
            top = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
            for r, (i, _) in enumerate(batch):
                n = _continuation_length(new[r], eos)
                samples.append(TeacherSample(ids[r] + new[r][:n], len(ids[r]) - 1,
                                             top.indices[r, :n].to(torch.int32).cpu(),
                                             top.values[r, :n].to(torch.float16).cpu(), i))
            save_samples(samples, path)
            bar.update(len(batch))
    bar.close()
    return samples


def _sample_numbers(samples: list[TeacherSample]):
    """(j, sample) where j counts the samples of the same prompt in order."""
    seen: dict[int, int] = {}
    for s in samples:
        j = seen.get(s.prompt_index, 0)
        seen[s.prompt_index] = j + 1
        yield j, s


def held_out_indices(num_prompts: int, fraction: float) -> list[int]:
    """The prompts never trained on: every round(1/fraction)-th, from the middle of the first stride."""
    every = max(2, round(1 / fraction))
    return [i for i in range(num_prompts) if i % every == every // 2] or [0]


def split_held_out(samples: list[TeacherSample], num_prompts: int, fraction: float):
    """(train, held_out) split by prompt, so no held-out prompt is trained on."""
    held = set(held_out_indices(num_prompts, fraction))
    train = [s for s in samples if s.prompt_index not in held]
    test = [s for s in samples if s.prompt_index in held]
    if not train or not test:
        raise ValueError(f"{num_prompts} prompts are too few to hold out {fraction:.0%} of them")
    return train, test
