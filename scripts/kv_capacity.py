"""How many concurrent sequences of --max-model-len tokens the KV pools hold, before and after paged KV.

  python scripts/kv_capacity.py --target random:target-8b --draft random:draft-1b --max-model-len 4096

Sizes the target's pool as `serve` does (target_proc.model.target_runner), frees it, then
the draft's (draft_proc.factory), each alone on its device with its own
--gpu-memory-utilization (as with --draft-device on a second GPU). Prints:
- before: the slot model, where each sequence held max_model_len rows in both processes and
  --max-num-seqs defaulted to 8: min(8, target rows // L, draft slots);
- after: --max-num-seqs as sized at start-up (256 on CUDA capped by the target's blocks), the
  full-length sequences the target's blocks hold at once, those the draft's blocks hold
  (at most the sequences it takes), and the concurrent sequences of L tokens: the least
  of the three.
On the CPU the pools are sized from the flags (no memory measurement); tests run it so.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging

from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig

OLD_MAX_NUM_SEQS = 8  # --max-batch-size's default in the slot model


def capacity(cfg: RuntimeConfig) -> dict:
    """The figures of one configuration (see the module docstring)."""
    import torch

    from draft_proc.factory import make_speculators
    from target_proc.model import target_runner

    runner = target_runner(cfg)
    length = runner.layout.max_model_len
    target = {"num_blocks": runner.layout.num_blocks, "block_size": runner.layout.block_size,
              "max_num_seqs": runner.max_num_seqs, "max_model_len": length}
    del runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    _, _, _, info = make_speculators(cfg.replace(sched=SchedulerConfig(
        max_model_len=length, max_batch_size=cfg.sched.max_batch_size, max_draft_seqs=cfg.sched.max_draft_seqs)))
    full = target["num_blocks"] * target["block_size"] // length
    draft_slots = min(info["num_slots"], info["kv_capacity"] // length)
    return {
        "max_model_len": length, "target": target, "target_full_seqs": full, "draft_slots": draft_slots,
        "before": min(OLD_MAX_NUM_SEQS, full, draft_slots),
        "slot_model_at_most": min(full, draft_slots),
        "after": min(target["max_num_seqs"], full, draft_slots),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--draft-device", default=None, help="default: --device")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=0, help="0: sized as serve sizes it")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--num-kv-blocks", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    mem = args.gpu_memory_utilization
    cfg = RuntimeConfig(
        target=ModelConfig(path=args.target, device=args.device, gpu_memory_utilization=mem),
        draft=ModelConfig(path=args.draft, device=args.draft_device or args.device, gpu_memory_utilization=mem),
        spec=SpeculativeConfig(mode="sd"),
        sched=SchedulerConfig(max_model_len=args.max_model_len, max_batch_size=args.max_num_seqs,
                              num_kv_blocks=args.num_kv_blocks))
    out = capacity(cfg)
    print(json.dumps(out, indent=1))
    length = out["max_model_len"]
    print(f"concurrent {length}-token sequences: before {out['before']} (slot model at most "
          f"{out['slot_model_at_most']}), after {out['after']} (max_num_seqs {out['target']['max_num_seqs']}, "
          f"target blocks {out['target_full_seqs']}, "
          f"draft {out['draft_slots']})")
    return out


if __name__ == "__main__":
    main()
