"""Speculation with a real target and its distilled draft, on held-out prompts.

Measures, through the runtime's own `ar` / `sd` / `ssd` paths (spec_runtime.client):
  - acceptance per position and mean tokens per round at each K (--ks), greedy and at
    each temperature (--temperatures), mode sd;
  - tokens/s of ar, sd (each K) and ssd (each fan-out), one prompt at a time (batch 1);
  - the SSD tree-cache hit rate at fan-out 1..4 (--fan-outs: F forks at each of the K
    depths, 1 at the bonus depth), every round working ahead (--work-ahead always);
and, with both models loaded in this process (the runtime's loader and model runner),
  - where the target's greedy token ranks in the draft's distribution along the target's
    own greedy continuations, against the synthetic oracle's assumption
    (spec_runtime/bench/oracle.py: rank 1 with probability alpha, else rank 2, 3, 4 with
    0.5, 0.2, 0.1), alpha being the measured rank-1 rate.

The prompts are the distillation's held-out prompts (the shipped prompt set split as
`spec-runtime distill` splits it; --distill-json reproduces another run's split), or
--prompts FILE. Chat-templated, as `spec-runtime generate` sends them.

    python scripts/real_pair.py --num-prompts 4 --max-tokens 48              # embedded pair, CPU
    python scripts/real_pair.py --device cuda --out bench/results/real_pair_smollm2_nvidia-h100-x1_DATE.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

MAX_RANK = 8
ORACLE_RANKS = (0.5, 0.2, 0.1)  # the benchmark's default --synthetic-ranks (docs/benchmarks.md)


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x)


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def held_out_prompts(args) -> tuple[list[str], str]:
    """(prompts, where they come from)."""
    from spec_runtime.distill.data import held_out_indices, load_prompts

    if args.prompts:
        prompts, source = load_prompts(args.prompts), args.prompts
    else:
        settings = {"prompts": "", "num_prompts": 0, "held_out_fraction": 0.05}
        if args.distill_json:
            with open(args.distill_json) as f:
                settings.update({k: v for k, v in json.load(f)["settings"].items() if k in settings})
        every = load_prompts(settings["prompts"])
        if settings["num_prompts"]:
            every = every[:settings["num_prompts"]]
        held = held_out_indices(len(every), settings["held_out_fraction"])
        prompts = [every[i] for i in held]
        source = (f"held-out prompts of {settings['prompts'] or 'the shipped prompt set'} "
                  f"(fraction {settings['held_out_fraction']}, {len(every)} prompts)")
    return prompts[:args.num_prompts] if args.num_prompts else prompts, source


def runtime_config(args, mode: str, k: int, fan_out: int = 0):
    from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig

    spec = {"fan_out": (fan_out,) * k + (1,), "work_ahead": "always", "tree_shape": "fixed"} if mode == "ssd" else {}
    return RuntimeConfig(
        target=ModelConfig(path=args.target, device=args.target_device),
        draft=ModelConfig(path=args.draft, device=args.draft_device),
        spec=SpeculativeConfig(mode=mode, k=k, draft_timeout_s=args.draft_timeout_s, **spec),
        # Speculate every step: the figures are the mode's, not the adaptive policy's choice.
        sched=SchedulerConfig(max_batch_size=1, max_model_len=args.max_model_len, spec_policy="always"),
        startup_timeout_s=900.0)


def run_point(client, prompt_ids: list[list[int]], temperature: float, args) -> dict:
    """One prompt at a time; totals of the requests' stats and the wall time."""
    from protocol.messages import SamplingParams

    totals = {"tokens": 0, "rounds": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0, "hits": 0, "misses": 0,
              "fallback_rounds": 0, "sd_rounds": 0, "wall_s": 0.0}
    accepted, drafted = [], []
    outputs = []
    for i, ids in enumerate(prompt_ids):
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=args.seed + i)
        t0 = time.perf_counter()
        res = client.generate(ids, sp)
        totals["wall_s"] += time.perf_counter() - t0
        st = res.stats
        outputs.append(res.token_ids)
        totals["tokens"] += st.num_generated_tokens
        totals["rounds"] += st.num_rounds
        totals["drafts"] += st.num_drafts
        totals["draft_tokens"] += st.num_draft_tokens
        totals["accepted"] += st.num_accepted_tokens
        totals["hits"] += st.num_cache_hits
        totals["misses"] += st.num_cache_misses
        totals["fallback_rounds"] += st.num_ar_fallback_rounds
        totals["sd_rounds"] += st.num_sd_rounds
        for n, (a, d) in enumerate(zip(st.accepted_per_position, st.drafted_per_position)):
            if n == len(accepted):
                accepted.append(0)
                drafted.append(0)
            accepted[n] += a
            drafted[n] += d
    t = totals
    row = {"temperature": temperature, "num_prompts": len(prompt_ids), "num_generated_tokens": t["tokens"],
           "tokens_per_s": round(t["tokens"] / t["wall_s"], 3) if t["wall_s"] else 0.0,
           "num_rounds": t["rounds"], "num_drafts": t["drafts"],
           "tokens_per_round": round(t["tokens"] / t["rounds"], 4) if t["rounds"] else 0.0,
           "mean_acceptance_length": round(1 + t["accepted"] / t["drafts"], 4) if t["drafts"] else 1.0,
           "acceptance_rate": round(t["accepted"] / t["draft_tokens"], 4) if t["draft_tokens"] else 0.0,
           "acceptance_per_position": [round(a / d, 4) if d else 0.0 for a, d in zip(accepted, drafted)],
           "num_ar_fallback_rounds": t["fallback_rounds"]}
    if t["hits"] + t["misses"]:
        row.update(num_cache_hits=t["hits"], num_cache_misses=t["misses"],
                   cache_hit_rate=round(t["hits"] / (t["hits"] + t["misses"]), 4), num_sd_rounds=t["sd_rounds"])
    return row, outputs


def run_mode(args, mode: str, k: int, prompts: list[str], fan_out: int = 0) -> tuple[list[dict], list]:
    from spec_runtime.client import Client

    cfg = runtime_config(args, mode, k, fan_out)
    rows, greedy = [], None
    t0 = time.perf_counter()
    with Client(cfg) as client:
        print(f"[{mode} K={k}{f' F={fan_out}' if fan_out else ''}] up in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
        prompt_ids = [client.encode_prompt(p, chat=True) for p in prompts]
        if args.warmup_tokens:  # first forwards (allocation, caches) are not what the figures describe
            from protocol.messages import SamplingParams

            client.generate(prompt_ids[0], SamplingParams(max_tokens=args.warmup_tokens, ignore_eos=True))
        for temp in args.temperatures:
            row, outputs = run_point(client, prompt_ids, temp, args)
            row = {"mode": mode, "k": k if mode != "ar" else None, **({"fan_out": fan_out} if fan_out else {}),
                   "draft": cfg.draft_name if mode != "ar" else None, **row}
            rows.append(row)
            if temp == 0.0:
                greedy = [ids + out for ids, out in zip(prompt_ids, outputs)], [len(ids) for ids in prompt_ids]
            print(f"  T={temp}: {row['tokens_per_s']} tok/s, {row['tokens_per_round']} tokens/round, "
                  f"acceptance {row['acceptance_per_position']}"
                  + (f", hit rate {row['cache_hit_rate']}" if "cache_hit_rate" in row else ""),
                  file=sys.stderr, flush=True)
    return rows, greedy


def rank_distribution(args, sequences: list[list[int]], prompt_lens: list[int]) -> dict:
    """Where the target's greedy token ranks in the draft's logits, along the target's
    greedy continuations (teacher-forced: both models see the same prefixes)."""
    import torch

    from spec_runtime.config import ModelConfig, RuntimeConfig
    from spec_runtime.engine.forward_batch import ForwardItem
    from spec_runtime.engine.runner import ModelRunner

    draft_path = RuntimeConfig(target=ModelConfig(path=args.target), draft=ModelConfig(path=args.draft)).draft_path
    logits = {}
    for role, path, device in (("target", args.target, args.target_device), ("draft", draft_path, args.draft_device)):
        runner = ModelRunner(ModelConfig(path=path, device=device), num_slots=1, max_model_len=args.max_model_len)
        per_seq = []
        for seq, n in zip(sequences, prompt_lens):
            out = runner.run([ForwardItem(seq[:-1], 0, runner.layout.slot_rows(0, len(seq) - 1), logits="all")])
            per_seq.append(out[n - 1:].float().cpu())  # rows predicting the continuation tokens
        logits[role] = per_seq
        del runner
    counts = [0] * (MAX_RANK + 1)
    total = 0
    for t_logits, d_logits in zip(logits["target"], logits["draft"]):
        vocab = min(t_logits.shape[-1], d_logits.shape[-1])
        token = t_logits[:, :vocab].argmax(-1)  # [positions]
        d = d_logits[:, :vocab]
        rank = (d > d.gather(-1, token[:, None])).sum(-1)  # 0-based
        for r in rank.tolist():
            counts[min(r, MAX_RANK)] += 1
        total += len(token)
    measured = [c / total for c in counts]
    alpha = measured[0]
    miss = 1 - alpha
    oracle = [alpha] + [miss * p for p in ORACLE_RANKS] + [0.0] * (MAX_RANK - 1 - len(ORACLE_RANKS))
    oracle.append(max(0.0, miss * (1 - sum(ORACLE_RANKS))))
    given_miss = [c / (total - counts[0]) for c in counts[1:]] if total > counts[0] else []
    return {"num_positions": total, "ranks": [*range(1, MAX_RANK + 1), f">{MAX_RANK}"],
            "measured": [round(x, 4) for x in measured], "oracle_at_measured_alpha": [round(x, 4) for x in oracle],
            "measured_given_miss": [round(x, 4) for x in given_miss], "oracle_given_miss": list(ORACLE_RANKS)}


def print_table(report: dict) -> None:
    print(f"{'mode':5} {'K':>2} {'F':>2} {'T':>4} {'tok/s':>7} {'tok/round':>9} {'accept len':>10} "
          f"{'hit rate':>8}  acceptance per position")
    for r in report["runs"]:
        print(f"{r['mode']:5} {r['k'] or '':>2} {r.get('fan_out', ''):>2} {r['temperature']:>4} "
              f"{r['tokens_per_s']:>7.2f} {r['tokens_per_round']:>9.2f} {r['mean_acceptance_length']:>10.2f} "
              f"{r.get('cache_hit_rate', ''):>8}  {r['acceptance_per_position']}")
    rd = report.get("rank_distribution")
    if rd:
        print(f"\nrank of the target's greedy token in the draft ({rd['num_positions']} positions):")
        print("rank      " + " ".join(f"{str(x):>6}" for x in rd["ranks"]))
        print("measured  " + " ".join(f"{x:>6.3f}" for x in rd["measured"]))
        print("oracle    " + " ".join(f"{x:>6.3f}" for x in rd["oracle_at_measured_alpha"]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="", help="target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default="", help="draft model (default: the runtime's default draft for the target: "
                                                "the shipped SmolLM2 draft for the embedded target)")
    p.add_argument("--device", default="cpu", help="device of both models (default: cpu)")
    p.add_argument("--target-device", default=None, help="the target's device (default: --device)")
    p.add_argument("--draft-device", default=None, help="the draft's device (default: --device)")
    p.add_argument("--prompts", default="", help="one prompt per line (default: the distillation's held-out prompts)")
    p.add_argument("--distill-json", default="", help="a draft's distill.json: split the prompts as its run did")
    p.add_argument("--num-prompts", type=int, default=0, help="use the first N prompts (0 = all)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt (default: 128)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--ks", type=_ints, default=(2, 4, 8), help="K values of the sd runs (default: 2,4,8)")
    p.add_argument("--temperatures", type=_floats, default=(0.0, 0.7), help="default: 0,0.7")
    p.add_argument("--ssd-k", type=int, default=4, help="K of the ssd runs (default: 4)")
    p.add_argument("--fan-outs", type=_ints, default=(1, 2, 3, 4), help="ssd fan-outs (default: 1,2,3,4)")
    p.add_argument("--no-ranks", action="store_true", help="skip the rank distribution")
    p.add_argument("--draft-timeout-s", type=float, default=120.0,
                   help="a round waits this long for the draft (default: 120, so a loaded CPU never drops drafts)")
    p.add_argument("--warmup-tokens", type=int, default=8,
                   help="tokens of one uncounted request before each runtime's measurements (default: 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="JSON file (default: bench/results/real_pair_<target>_<device>_<date>.json)")
    args = p.parse_args(argv)
    args.target_device = args.target_device or args.device
    args.draft_device = args.draft_device or args.device
    if 0.0 not in args.temperatures:
        p.error("--temperatures must include 0 (the rank distribution follows the greedy continuations)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from spec_runtime.config import ModelConfig, RuntimeConfig
    from spec_runtime.models.loader import model_name

    draft = RuntimeConfig(target=ModelConfig(path=args.target), draft=ModelConfig(path=args.draft)).draft_name
    if draft == "ngram":
        print("real_pair.py: this target has no default draft model; pass --draft PATH", file=sys.stderr)
        return 2
    prompts, source = held_out_prompts(args)
    print(f"{len(prompts)} prompts: {source}; draft {draft}", file=sys.stderr, flush=True)
    device = args.target_device if args.target_device == args.draft_device else \
        f"{args.target_device}+{args.draft_device}"
    out = args.out or os.path.join("bench", "results", f"real_pair_{model_name(args.target).lower()}_"
                                   f"{device.replace(':', '')}_{datetime.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    report = {
        "target": model_name(args.target), "draft": draft, "device": device, "machine": platform.node(),
        "cpu_count": os.cpu_count(), "prompts": source, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
        "batch_size": 1, "chat_template": True, "temperatures": list(args.temperatures), "ks": list(args.ks),
        "ssd_k": args.ssd_k, "fan_outs": list(args.fan_outs), "spec_policy": "always", "ssd_work_ahead": "always",
        "complete": False, "runs": [],
    }

    def save() -> None:  # after every runtime, so a long run that stops early keeps what it measured
        report["load_average"] = os.getloadavg()
        with open(out, "w") as f:
            json.dump(report, f, indent=1)

    ar_rows, greedy = run_mode(args, "ar", 1, prompts)
    report["runs"] += ar_rows
    save()
    if not args.no_ranks:
        report["rank_distribution"] = rank_distribution(args, *greedy)
        save()
    for k in args.ks:
        report["runs"] += run_mode(args, "sd", k, prompts)[0]
        save()
    for f in args.fan_outs:
        report["runs"] += run_mode(args, "ssd", args.ssd_k, prompts, fan_out=f)[0]
        save()
    report["complete"] = True
    save()
    print_table(report)
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
