"""Top-1 agreement of a draft directory and its GGUF exports with the target, teacher-forced.

The target (default: the embedded SmolLM2 GGUF) continues the first N held-out prompts of
the shipped prompt set greedily; each draft then reads those sequences in one forward,
and its top-1 token at every continuation position is compared with the target's and
with the directory draft's. GGUF files load through transformers' GGUF reader.

    python scripts/draft_quant_agreement.py smollm2-draft d_q8_0.gguf d_q5_1.gguf --out agreement.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM

from spec_runtime.distill.data import encode_prompt, load_prompts
from spec_runtime.distill.train import load_target


def top1(model, seqs) -> torch.Tensor:
    rows = []
    for ids, full in seqs:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([full])).logits[0]
        rows.append(logits[len(ids) - 1:len(full) - 1].argmax(-1))
    return torch.cat(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("draft_dir")
    ap.add_argument("gguf", nargs="*", help="GGUF exports of the same draft")
    ap.add_argument("--target", default="", help="target (default: the embedded SmolLM2 GGUF)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    target, tok, eos = load_target(args.target, torch.device("cpu"))
    prompts = load_prompts("")
    held = [i for i in range(len(prompts)) if i % 20 == 10][:args.num_prompts]  # distill's 5% held-out split
    seqs = []
    for i in held:
        ids = encode_prompt(tok, prompts[i])
        out = target.generate(input_ids=torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos[0])
        seqs.append((ids, out[0].tolist()))
    want = torch.cat([torch.tensor(full[len(ids):]) for ids, full in seqs])

    float_draft = AutoModelForCausalLM.from_pretrained(args.draft_dir, dtype=torch.float32).eval()
    ref = top1(float_draft, seqs)
    files = {"directory": (os.path.join(args.draft_dir, "model.safetensors"), ref)}
    for path in args.gguf:
        m = AutoModelForCausalLM.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
        files[os.path.basename(path)] = (path, top1(m, seqs))
    report = {"positions": int(want.numel()), "prompts": [prompts[i] for i in held],
              "max_new_tokens": args.max_new_tokens}
    for name, (path, t1) in files.items():
        report[name] = {"bytes": os.path.getsize(path), "agree_target": float((t1 == want).float().mean()),
                        "agree_directory": float((t1 == ref).float().mean())}
        print(f"{name:28s} {report[name]['bytes']:>11,d} B  target {report[name]['agree_target']:.3f}  "
              f"directory {report[name]['agree_directory']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
