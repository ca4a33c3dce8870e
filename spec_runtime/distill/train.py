"""Distil a draft from a target: forward KL from the target's top-k distribution.

The loop is plain torch: transformers builds and saves the draft, torch's AdamW and
transformers' cosine schedule train it. Held-out acceptance is the rate at which the
draft's top-1 token equals the target's on continuations of prompts it never trains
on: the per-token acceptance greedy speculative decoding sees.

Layout of the output directory:
  config.json, model.safetensors, tokenizer files   the draft, loadable with --draft DIR
  distill.json                                      shape, settings and held-out figures
  .distill/config.json                              the run's settings (for --resume)
  .distill/teacher.pt                               the teacher data
  .distill/checkpoint/                              draft weights, optimizer, step
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from spec_runtime.distill.config import DistillConfig
from spec_runtime.distill.data import (TeacherSample, generate_samples, load_prompts, sample_prompts,
                                       split_held_out)
from spec_runtime.distill.shape import count_params, draft_config, init_from_target

logger = logging.getLogger(__name__)

WORK_DIR = ".distill"
MAX_RANK = 8


@dataclass(frozen=True)
class Metrics:
    kl: float
    acceptance: float  # held-out top-1 agreement with the target
    num_positions: int
    # Fraction of positions whose target top-1 token is the draft's rank 1, 2, .., MAX_RANK
    # token, then the fraction where it is further down.
    rank_distribution: tuple[float, ...] = ()


def work_path(out: str, *parts: str) -> str:
    return os.path.join(out, WORK_DIR, *parts)


def load_target(path: str, device: torch.device):
    """(transformers model, tokenizer, eos ids) of a HF directory or .gguf file ("" = embedded SmolLM2)."""
    from transformers import AutoModelForCausalLM

    from spec_runtime.models.hf_config import arch_from_config
    from spec_runtime.models.loader import eos_token_ids, load_tokenizer, resolve_model_path

    directory, gguf = resolve_model_path(path)
    kw = {"gguf_file": gguf} if gguf else {}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kw).to(device).eval()
    model.requires_grad_(False)
    arch = arch_from_config(model.config)  # refuses families the runtime cannot serve
    tokenizer = load_tokenizer(path)
    eos = eos_token_ids(path, arch, tokenizer)
    if not eos:
        raise ValueError(f"target {path!r} declares no end-of-sequence token")
    return model, tokenizer, eos


def collate(samples: list[TeacherSample], device: torch.device):
    """Right-padded inputs and the (row, position) of every continuation target."""
    width = max(len(s.token_ids) for s in samples)
    input_ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    rows, cols = [], []
    for r, s in enumerate(samples):
        input_ids[r, :len(s.token_ids)] = torch.tensor(s.token_ids)
        mask[r, :len(s.token_ids)] = 1
        n = s.topk_ids.shape[0]
        rows += [r] * n
        cols += range(s.start, s.start + n)
    topk_ids = torch.cat([s.topk_ids for s in samples]).long()  # [num_positions, k]
    topk_logprobs = torch.cat([s.topk_logprobs for s in samples]).float()  # [num_positions, k]
    return (input_ids.to(device), mask.to(device), torch.tensor(rows, device=device),
            torch.tensor(cols, device=device), topk_ids.to(device), topk_logprobs.to(device))


def draft_logits(draft, samples: list[TeacherSample], device: torch.device):
    """(draft logits [num_positions, vocab], target top-k ids, target top-k log-probs) at the
    continuation positions of `samples`."""
    input_ids, mask, rows, cols, topk_ids, topk_logprobs = collate(samples, device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        hidden = draft.model(input_ids=input_ids, attention_mask=mask).last_hidden_state  # [B, T, H]
        logits = draft.lm_head(hidden[rows, cols])  # [num_positions, vocab]
    return logits.float(), topk_ids, topk_logprobs


def topk_kl(logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor) -> torch.Tensor:
    """Mean KL(p_topk || q) over positions.

    p is the target's top-k renormalised: the mass outside the top k (small for k = 64)
    carries no gradient, which is what makes the teacher data k/vocab the size.
    """
    log_q = logits.log_softmax(-1)
    log_p = topk_logprobs - topk_logprobs.logsumexp(-1, keepdim=True)  # [num_positions, k]
    return (log_p.exp() * (log_p - log_q.gather(-1, topk_ids))).sum(-1).mean()


@torch.no_grad()
def evaluate(draft, samples: list[TeacherSample], device: torch.device, batch_size: int) -> Metrics:
    """Held-out KL, top-1 agreement, and where the target's top-1 token sits in the draft's ranking."""
    was_training = draft.training
    draft.eval()
    kl_sum, total = 0.0, 0
    rank_counts = [0] * (MAX_RANK + 1)  # ranks 1..MAX_RANK, then "further down"
    for b in range(0, len(samples), batch_size):
        logits, topk_ids, topk_logprobs = draft_logits(draft, samples[b:b + batch_size], device)
        n = topk_ids.shape[0]
        kl_sum += topk_kl(logits, topk_ids, topk_logprobs).item() * n  # sync: a scalar per held-out batch
        hits = logits.topk(MAX_RANK, dim=-1).indices == topk_ids[:, :1]  # [num_positions, MAX_RANK]
        found = hits.any(-1)
        for r, c in zip(*torch.unique(hits.float().argmax(-1)[found], return_counts=True)):
            rank_counts[int(r)] += int(c)
        rank_counts[MAX_RANK] += int((~found).sum())
        total += n
    draft.train(was_training)
    total = max(total, 1)
    return Metrics(kl=kl_sum / total, acceptance=rank_counts[0] / total, num_positions=total,
                   rank_distribution=tuple(c / total for c in rank_counts))


def batch_indices(step: int, batch_size: int, num_samples: int, seed: int) -> list[int]:
    """The samples of `step`: epochs of seeded permutations, so a resumed run sees the same order."""
    out = []
    for flat in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(flat, num_samples)
        perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        out.append(int(perm[i]))
    return out


def _save_checkpoint(draft, opt, sched, step: int, history: list[dict], out: str) -> None:
    from safetensors.torch import save_model

    final = work_path(out, "checkpoint")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_model(draft, os.path.join(tmp, "model.safetensors"))
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, os.path.join(tmp, "optimizer.pt"))
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump({"step": step, "history": history}, f)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


def _load_checkpoint(draft, opt, sched, out: str) -> tuple[int, list[dict]]:
    from safetensors.torch import load_model

    ckpt = work_path(out, "checkpoint")
    if not os.path.isfile(os.path.join(ckpt, "state.json")):
        return 0, []
    load_model(draft, os.path.join(ckpt, "model.safetensors"), device=str(next(draft.parameters()).device))
    # A local file this tool wrote; weights_only keeps torch.load to tensors and plain data.
    state = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    with open(os.path.join(ckpt, "state.json")) as f:
        saved = json.load(f)
    logger.info("resuming from step %d (%s)", saved["step"], ckpt)
    return int(saved["step"]), list(saved["history"])


def _device(name: str) -> torch.device:
    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device")
    return device


def _self_prompts(cfg: DistillConfig, target, tokenizer, eos_ids) -> list[str]:
    """The target's own prompts, sampled once and kept in OUT/.distill/self_prompts.json."""
    if not cfg.self_prompts:
        return []
    path = work_path(cfg.out, "self_prompts.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if len(saved) >= cfg.self_prompts:
            return saved[:cfg.self_prompts]
    prompts = sample_prompts(target, tokenizer, eos_ids, cfg.self_prompts, batch_size=cfg.gen_batch_size,
                             seed=cfg.seed)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(prompts, f, indent=0)
    return prompts


def _make_draft(cfg: DistillConfig, target):
    """The draft (on the CPU), sized from the config and initialised from the target's
    weights; with its config and both parameter counts."""
    from transformers import AutoModelForCausalLM

    target_params = count_params(target)
    dcfg = draft_config(target.config, target_params, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size)
    draft = AutoModelForCausalLM.from_config(dcfg, dtype=torch.float32)
    init_from_target(draft, target)
    draft_params = count_params(draft)
    logger.info("draft: %d layers, width %d, ffn %d, %.1fM parameters (%.1f%% of the target's %.1fM)",
                dcfg.num_hidden_layers, dcfg.hidden_size, dcfg.intermediate_size, draft_params / 1e6,
                100 * draft_params / target_params, target_params / 1e6)
    return draft, dcfg, draft_params, target_params


def _train(cfg: DistillConfig, draft, opt, sched, train, held_out, device: torch.device, step: int,
           history: list[dict]) -> int:
    """Steps from `step` to cfg.steps, evaluating into `history` and checkpointing as
    configured; returns the last step."""
    bar = tqdm(total=cfg.steps, initial=step, desc="Distilling", unit="step", file=sys.stderr,
               mininterval=1.0 if sys.stderr.isatty() else 30.0)
    loss_ema = None
    t0 = time.monotonic()
    while step < cfg.steps:
        batch = [train[i] for i in batch_indices(step, cfg.batch_size, len(train), cfg.seed)]
        kl = topk_kl(*draft_logits(draft, batch, device))
        opt.zero_grad(set_to_none=True)
        kl.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        loss = kl.item()  # sync: the progress bar shows it
        if not math.isfinite(loss):
            raise RuntimeError(f"the loss became {loss} at step {step}; try a lower --lr")
        loss_ema = loss if loss_ema is None else 0.9 * loss_ema + 0.1 * loss
        bar.update(1)
        postfix = {"loss": f"{loss_ema:.3f}", "held_out_acc": f"{history[-1]['held_out_acceptance']:.3f}"}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            m = evaluate(draft, held_out, device, cfg.batch_size)
            history.append({"step": step, "train_loss": loss_ema, "held_out_kl": m.kl,
                            "held_out_acceptance": m.acceptance})
            postfix["held_out_acc"] = f"{m.acceptance:.3f}"
            logger.info("step %d/%d: train KL %.3f, held-out KL %.3f, held-out acceptance %.3f (%.1f s)",
                        step, cfg.steps, loss_ema, m.kl, m.acceptance, time.monotonic() - t0)
        bar.set_postfix(postfix, refresh=False)
        if step % cfg.save_every == 0 or step == cfg.steps:
            _save_checkpoint(draft, opt, sched, step, history, cfg.out)
    bar.close()
    return step


def _teacher_data(cfg: DistillConfig, target, tokenizer, eos_ids, prompts: list) -> tuple[list, list]:
    """The target's continuations of `prompts` (cached in OUT's work directory), split
    into training and held-out samples by prompt."""
    samples = generate_samples(
        target, tokenizer, prompts, eos_ids, max_new_tokens=cfg.max_new_tokens,
        samples_per_prompt=cfg.samples_per_prompt, temperature=cfg.gen_temperature,
        batch_size=cfg.gen_batch_size, top_k=cfg.top_k_logits, path=work_path(cfg.out, "teacher.pt"), seed=cfg.seed)
    train, held_out = split_held_out(samples, len(prompts), cfg.held_out_fraction)
    logger.info("teacher data: %d train samples (%d tokens), %d held-out (%d tokens)", len(train),
                sum(s.topk_ids.shape[0] for s in train), len(held_out), sum(s.topk_ids.shape[0] for s in held_out))
    return train, held_out


def distill(cfg: DistillConfig) -> dict:
    """Run (or resume) a distillation; returns the summary also written to OUT/distill.json."""
    from transformers import get_cosine_schedule_with_warmup

    device = _device(cfg.device)
    os.makedirs(work_path(cfg.out), exist_ok=True)
    with open(work_path(cfg.out, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)
    torch.manual_seed(cfg.seed)
    target, tokenizer, eos_ids = load_target(cfg.target, device)
    prompts = load_prompts(cfg.prompts)
    if cfg.num_prompts:
        prompts = prompts[:cfg.num_prompts]
    prompts += _self_prompts(cfg, target, tokenizer, eos_ids)
    train, held_out = _teacher_data(cfg, target, tokenizer, eos_ids, prompts)

    draft, dcfg, draft_params, target_params = _make_draft(cfg, target)
    del target
    draft.to(device).train()

    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = get_cosine_schedule_with_warmup(opt, min(cfg.warmup_steps, cfg.steps // 2), cfg.steps)
    step, history = _load_checkpoint(draft, opt, sched, cfg.out) if cfg.resume else (0, [])
    if not history:
        m = evaluate(draft, held_out, device, cfg.batch_size)
        history.append({"step": 0, "held_out_kl": m.kl, "held_out_acceptance": m.acceptance})
        logger.info("untrained draft: held-out KL %.3f, acceptance %.3f", m.kl, m.acceptance)

    step = _train(cfg, draft, opt, sched, train, held_out, device, step, history)
    final = evaluate(draft, held_out, device, cfg.batch_size)

    draft.to("cpu").save_pretrained(cfg.out)
    tokenizer.save_pretrained(cfg.out)
    summary = {
        "target": cfg.target or "embedded SmolLM2-135M-Instruct",
        "draft_params": draft_params, "target_params": target_params,
        "num_layers": dcfg.num_hidden_layers, "hidden_size": dcfg.hidden_size,
        "intermediate_size": dcfg.intermediate_size, "steps": step,
        "train_samples": len(train), "held_out_samples": len(held_out),
        "untrained_held_out_acceptance": history[0]["held_out_acceptance"],
        "held_out_acceptance": history[-1]["held_out_acceptance"],
        "untrained_held_out_kl": history[0]["held_out_kl"], "held_out_kl": history[-1]["held_out_kl"],
        "held_out_rank_distribution": list(final.rank_distribution),
        "history": history, "settings": cfg.to_dict(),
    }
    if cfg.gguf:
        from spec_runtime.distill.export import export_gguf
        from spec_runtime.models.loader import default_model_path

        exported = export_gguf(cfg.out, cfg.gguf, cfg.gguf_type, tokenizer_from=cfg.target or default_model_path())
        summary["gguf"] = {"path": exported.path, "bytes": exported.num_bytes, "tensor_types": exported.tensor_types}
    with open(os.path.join(cfg.out, "distill.json"), "w") as f:
        json.dump(summary, f, indent=1)
    logger.info("draft written to %s: held-out acceptance %.3f (untrained %.3f)", cfg.out,
                summary["held_out_acceptance"], summary["untrained_held_out_acceptance"])
    return summary
