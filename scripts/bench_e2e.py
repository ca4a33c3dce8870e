"""AR, SD and SSD side by side: tokens/s against batch size, same prompts, same run.

Each mode starts its own runtime (target and draft processes) and decodes the same
random prompts at each point (point_prompts: drawn from the prompt length and batch
size). With random-weight models (`random:target-32b` ...) pass --synthetic-acceptance so
acceptance comes from the synthetic acceptance oracle (spec_runtime.bench.oracle;
docs/benchmarks.md, "Method"); every result row names it. Several values (0.8,0.6) run
the whole matrix at each, one runtime per mode and value, so a pair's matrix is one
command.

    python scripts/bench_e2e.py --target random:target-32b --draft random:draft-0.6b \\
        --target-device cuda:0 --draft-device cuda:1 --k 8 --synthetic-acceptance 0.8 \\
        --synthetic-ranks 0.5,0.2,0.1 --out bench/results/e2e.json

Reported per (mode, temperature, batch): tokens/s (generated tokens over wall time,
prefill included), decode tokens/s (tokens after the first over wall time less the mean
time to first token: the rate the all-hit ideal describes), step tokens/s (the same
tokens over the engine's step time, admissions left out), mean tokens per round,
acceptance per position, tree-cache hit rate, target verify time per step (v), time
blocked on the draft per step, the draft's work-ahead per round, the rest of a step's
loop (admissions, host work), and for SSD its all-hit ideal: E[tokens per round] / v.
--repeats runs each batch several times and sums (one 128-token request at batch 1 is
well under a second).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time

import numpy as np


def _tuple(kind):
    return lambda s: tuple(kind(x) for x in s.split(",") if x)


def run_mode(args, mode: str, alpha: float | None = None):
    """Every point of the matrix in one runtime of `mode`, each point's row yielded as it is
    measured; alpha: the synthetic oracle's acceptance (None: off)."""
    from protocol.messages import SamplingParams
    from spec_runtime.client import Client
    from spec_runtime.config import ModelConfig, RuntimeConfig, SchedulerConfig, SpeculativeConfig

    cfg = RuntimeConfig(
        target=ModelConfig(path=args.target, device=args.target_device, cuda_graphs=not args.no_cuda_graphs,
                           tensor_parallel_size=args.tensor_parallel_size,
                           gpu_memory_utilization=args.target_gpu_memory_utilization),
        draft=ModelConfig(path=args.draft, device=args.draft_device, cuda_graphs=not args.no_cuda_graphs),
        spec=SpeculativeConfig(mode=mode, k=args.k, fan_out=args.fan_out, fan_out_miss=args.fan_out_miss,
                               backup=args.backup, tree_budget=args.tree_budget, work_ahead=args.work_ahead,
                               tree_shape=args.tree_shape,
                               synthetic_acceptance=(alpha, *args.synthetic_ranks) if alpha is not None else (),
                               draft_timeout_s=30.0),
        # SD is the synchronous baseline: it speculates every step. SSD runs with the
        # policies a user gets (--spec-policy), which may choose SD rounds or plain steps.
        sched=SchedulerConfig(max_batch_size=max(args.batch_sizes), max_model_len=args.max_model_len,
                              spec_policy=args.spec_policy if mode == "ssd" else "always",
                              overlap_schedule=args.overlap_schedule),
        startup_timeout_s=900.0,
        log_level=args.log_level,
    )
    t_start = time.perf_counter()
    with Client(cfg) as client:
        print(f"[{mode}] runtime up in {time.perf_counter() - t_start:.1f} s", file=sys.stderr, flush=True)
        vocab = client.ready.vocab_size
        for prompt_len, temp, bs in _points(args):
            prompts = point_prompts(vocab, prompt_len, bs)
            sp = SamplingParams(max_tokens=args.max_tokens, temperature=temp, ignore_eos=True, seed=None)
            # Untimed, twice: the second run meets the prefix cache as the timed runs do, so
            # the kernels of both prefill paths are built before timing, whichever mode runs first.
            for _ in range(2 if args.warmup_tokens else 0):
                client.generate_batch(prompts[:bs], SamplingParams(max_tokens=args.warmup_tokens, temperature=temp,
                                                                   ignore_eos=True))
            before = client.engine_stats()
            results, wall, decode_wall = [], 0.0, 0.0
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                res = client.generate_batch(prompts[:bs], sp)
                w = time.perf_counter() - t0
                wall += w
                decode_wall += w - float(np.mean([r.stats.ttft_s for r in res]))
                results += res
            after = client.engine_stats()
            r = _row(mode, temp, bs, wall, decode_wall, results, before, after, args, alpha)
            r["prompt_len"] = prompt_len
            r["ssd_rounds"] = after.num_ssd_rounds - before.num_ssd_rounds
            r["sd_rounds"] = after.num_sd_rounds - before.num_sd_rounds
            r["halves_steps"] = after.num_halves_steps - before.num_halves_steps
            r["plain_steps"] = after.num_plain_steps - before.num_plain_steps
            r["verifies_laid_out"] = after.num_verifies_laid_out - before.num_verifies_laid_out
            r["tree_shrinks"] = after.draft_tree_shrinks - before.draft_tree_shrinks
            r["tree_grows"] = after.draft_tree_grows - before.draft_tree_grows
            # SSD: the round policy's choice per batch size at the end of the point.
            r["round_choices"] = {str(b): c for b, c in after.round_choices.items()}
            answers = after.draft_num_answers - before.draft_num_answers
            r["draft_answer_ms"] = 1e3 * (after.draft_answer_s - before.draft_answer_s) / answers if answers else None
            # The first repeat's tokens, to compare greedy output across modes.
            r["output_sha1"] = hashlib.sha1(np.array([t for x in results[:bs] for t in x.token_ids],
                                                      dtype=np.int64).tobytes()).hexdigest()
            print(f"[{mode}] P={prompt_len} T={temp} B={bs}{_alpha_label(alpha)}: {r['tokens_per_s']:.1f} tok/s "
                  f"(decode {r['decode_tokens_per_s']:.1f}, "
                  f"steps {r['step_tokens_per_s']:.1f}), "
                  f"{r['mean_tokens_per_round']:.2f} "
                  f"tok/round, hit {r['cache_hit_rate']}, v={r['verify_ms_per_step']:.2f} ms "
                  f"(launch {r['host_parts_ms_per_step'].get('verify_launch', 0.0):.2f}), "
                  f"wait={r['draft_wait_ms_per_step']:.2f} ms, work={r['draft_work_ms_per_step']:.2f} ms, "
                  f"host={r['host_ms_per_step']:.2f} ms ("
                  + ", ".join(f"{k} {v:.3f}" for k, v in r["host_parts_ms_per_step"].items() if k != "verify_launch")
                  + f"), policy={r['policy_ms_per_step']:.3f} ms, "
                  f"admit={r['admit_ms_per_step']:.2f} ms, steps {r['steps']}, "
                  f"ssd/sd rounds {r['ssd_rounds']}/{r['sd_rounds']}, halves steps {r['halves_steps']}, "
                  f"plain steps {r['plain_steps']}, "
                  f"tree shrinks/grows {r['tree_shrinks']}/{r['tree_grows']}, "
                  f"draft answer {r['draft_answer_ms'] or 0:.2f} ms",
                  file=sys.stderr, flush=True)
            yield r


def _greedy_identical(rows) -> bool | None:
    """Whether every greedy point produced the same tokens in every mode (None: nothing to compare)."""
    by_point: dict[tuple, set] = {}
    for r in rows:
        if r["temperature"] == 0:
            key = (r["synthetic_acceptance"], r["prompt_len"], r["batch_size"])
            by_point.setdefault(key, set()).add(r["output_sha1"])
    compared = [v for v in by_point.values()]
    return all(len(v) == 1 for v in compared) if compared else None


def point_prompts(vocab: int, prompt_len: int, batch: int) -> list[list[int]]:
    """The random prompts of one point, drawn from its prompt length and batch size alone: a
    point run in another command, alone or in another matrix, decodes the same prompts, and
    its output can be compared across the commands (output_sha1)."""
    rng = np.random.default_rng([prompt_len, batch])
    return [rng.integers(10, vocab, size=prompt_len).tolist() for _ in range(batch)]


def _points(args):
    """(prompt length, temperature, batch) of the matrix; temperatures other than 0 only
    at the prompt lengths --sampled-prompt-lens names (all of them by default); batches
    of more than --max-batch-tokens tokens (prompts and outputs) left out."""
    for prompt_len in args.prompt_lens:
        for temp in args.temperatures:
            if temp > 0 and args.sampled_prompt_lens and prompt_len not in args.sampled_prompt_lens:
                continue
            for bs in args.batch_sizes:
                if args.max_batch_tokens and bs * (prompt_len + args.max_tokens) > args.max_batch_tokens:
                    continue
                yield prompt_len, temp, bs


def _alpha_label(alpha: float | None) -> str:
    return f" alpha={alpha}" if alpha is not None else ""


def _row(mode, temp, bs, wall, decode_wall, results, before, after, args, alpha=None) -> dict:
    gen = sum(r.stats.num_generated_tokens for r in results)
    rounds = sum(r.stats.num_rounds - 1 for r in results)  # verify rounds (prefill excluded)
    drafted = sum(r.stats.num_draft_tokens for r in results)
    accepted = sum(r.stats.num_accepted_tokens for r in results)
    hits = sum(r.stats.num_cache_hits for r in results)
    misses = sum(r.stats.num_cache_misses for r in results)
    k = args.k if mode != "ar" else 0
    acc_pos = [sum(r.stats.accepted_per_position[i] for r in results) for i in range(k)]
    dr_pos = [sum(r.stats.drafted_per_position[i] for r in results) for i in range(k)]
    steps = max(1, after.num_steps - before.num_steps)
    verify_s = (after.verify_s - before.verify_s) / steps
    tokens_per_round = (gen - len(results)) / max(1, rounds)
    row = {
        "mode": mode, "temperature": temp, "batch_size": bs, "k": k,
        "fan_out": list(args.fan_out) if mode == "ssd" else None,
        "tree_budget": args.tree_budget if mode == "ssd" else None,
        "synthetic_acceptance": alpha, "synthetic_ranks": list(args.synthetic_ranks),
        "generated_tokens": gen, "repeats": args.repeats, "wall_s": wall, "tokens_per_s": gen / wall,
        "decode_tokens_per_s": (gen - len(results)) / decode_wall if decode_wall > 0 else None,
        "mean_tokens_per_round": tokens_per_round,
        "acceptance_rate": accepted / drafted if drafted else None,
        "acceptance_per_position": [a / d if d else None for a, d in zip(acc_pos, dr_pos)],
        "cache_hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
        "verify_ms_per_step": 1e3 * verify_s,
        "draft_wait_ms_per_step": 1e3 * (after.draft_wait_s - before.draft_wait_s) / steps,
        "draft_work_ms_per_step": 1e3 * (after.draft_work_s - before.draft_work_s) / steps,
        # The rest of a step's loop iteration: admissions (prefills), and host work outside the
        # verify and the wait (outcomes sent, tokens appended, the round policy, streaming).
        "admit_ms_per_step": 1e3 * (after.admit_s - before.admit_s) / steps,
        # SSD: the round policy's own host time (choosing each step's plan, recording its costs),
        # within the wait (choosing) and the host work (recording).
        "policy_ms_per_step": 1e3 * (after.round_policy_s - before.round_policy_s) / steps,
        # Parts of the host work per step: poll (client and draft sockets), outcomes (sent to the
        # draft), accept (stop rules, stats), record (the policies' bookkeeping); and verify_launch,
        # the verify's host part before it waits for the GPU (within verify_ms, not host_ms).
        "host_parts_ms_per_step": {name: 1e3 * (v - before.host_parts.get(name, 0.0)) / steps
                                   for name, v in after.host_parts.items()},
        "host_ms_per_step": 1e3 * ((after.loop_s - before.loop_s) - (after.admit_s - before.admit_s)
                                   - (after.verify_s - before.verify_s)
                                   - (after.draft_wait_s - before.draft_wait_s)) / steps,
        # The steps alone: tokens after each request's first over the loop time less
        # admissions (prefills of requests that arrived while others decoded do not count).
        "step_tokens_per_s": (gen - len(results)) / max(1e-9, (after.loop_s - before.loop_s)
                                                       - (after.admit_s - before.admit_s)),
        "steps": steps,
        "mean_ttft_s": float(np.mean([r.stats.ttft_s for r in results])),
        "mean_queue_s": float(np.mean([r.stats.queue_s for r in results])),
    }
    # All-hit ideal: every round costs only the verify, E[tokens per round] / v, per sequence.
    row["ideal_tokens_per_s"] = bs * tokens_per_round / verify_s if verify_s > 0 else None
    if row["ideal_tokens_per_s"] and row["decode_tokens_per_s"]:
        row["decode_fraction_of_ideal"] = row["decode_tokens_per_s"] / row["ideal_tokens_per_s"]
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--target-device", default="cuda:0")
    p.add_argument("--draft-device", default="cuda:1")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="target ranks, on --target-device and the devices after it")
    p.add_argument("--target-gpu-memory-utilization", type=float, default=0.85,
                   help="lower it where the draft shares a target rank's GPU")
    p.add_argument("--modes", type=_tuple(str), default=("ar", "sd", "ssd"))
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--fan-out", type=_tuple(int), default=())
    p.add_argument("--fan-out-miss", type=_tuple(int), default=())
    p.add_argument("--backup", default="auto", help="SSD: auto (chosen per batch size), jit, ngram or none")
    p.add_argument("--tree-budget", type=int, default=0, help="SSD: most branches per round over the batch "
                   "(0: 64 up to batch 4, then 16 per sequence up to 256, and smaller trees where the round policy predicts them faster)")
    p.add_argument("--tree-shape", default="auto", help="SSD: auto (the round policy picks it) or fixed")
    p.add_argument("--work-ahead", default="auto", help="SSD: auto (SSD/SD rounds or plain steps by measured "
                   "costs) or always")
    p.add_argument("--spec-policy", default="adaptive", help="SSD's speculation policy (SD always speculates)")
    p.add_argument("--batch-sizes", type=_tuple(int), default=(1, 2, 4, 8, 16))
    p.add_argument("--temperatures", type=_tuple(float), default=(0.0, 0.7))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="runs of each batch, summed")
    p.add_argument("--warmup-tokens", type=int, default=64,
                   help="tokens of two untimed runs of each point first (graphs, kernels and the SSD policy settle)")
    p.add_argument("--prompt-lens", type=_tuple(int), default=(128,))
    p.add_argument("--sampled-prompt-lens", type=_tuple(int), default=(),
                   help="prompt lengths at which temperatures > 0 run (default: all)")
    p.add_argument("--max-batch-tokens", type=int, default=0,
                   help="leave out points whose batch holds more tokens (prompts and outputs); 0: none left out")
    p.add_argument("--max-model-len", type=int, default=None, help="default: longest prompt + max tokens + 64")
    p.add_argument("--synthetic-acceptance", type=_tuple(float), default=(),
                   help="the oracle's acceptance alpha; several (0.8,0.6): the matrix at each")
    p.add_argument("--synthetic-ranks", type=_tuple(float), default=())
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--overlap-schedule", default="auto", choices=("auto", "on", "off"),
                   help="plain steps queued before the previous step's tokens reach the host (auto: on CUDA)")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args(argv)
    if args.max_model_len is None:
        args.max_model_len = max(args.prompt_lens) + args.max_tokens + 64

    rows = []
    for alpha in args.synthetic_acceptance or (None,):
        for mode in args.modes:
            for row in run_mode(args, mode, alpha):
                rows.append(row)
                with open(args.out, "w") as f:  # after every point: a run cut short keeps what it measured
                    json.dump({"args": vars(args), "host": platform.node(), "rows": rows,
                               "greedy_identical": _greedy_identical(rows)}, f, indent=1)
    print(f"greedy output identical across modes at every greedy point: {_greedy_identical(rows)}")
    print(f"{'mode':5} {'alpha':>5} {'P':>5} {'T':>4} {'B':>3} {'tok/s':>8} {'decode':>8} {'tok/rnd':>7} {'hit':>5} "
          f"{'v ms':>6} {'wait':>6} {'work':>6} {'ideal':>8}")
    for r in rows:
        hit = f"{r['cache_hit_rate']:.2f}" if r["cache_hit_rate"] is not None else "-"
        ideal = f"{r['ideal_tokens_per_s']:.1f}" if r["mode"] == "ssd" and r["ideal_tokens_per_s"] else "-"
        alpha = "-" if r["synthetic_acceptance"] is None else f"{r['synthetic_acceptance']:.2f}"
        print(f"{r['mode']:5} {alpha:>5} {r['prompt_len']:5d} {r['temperature']:4.1f} {r['batch_size']:3d} {r['tokens_per_s']:8.1f} "
              f"{r['decode_tokens_per_s']:8.1f} "
              f"{r['mean_tokens_per_round']:7.2f} {hit:>5} {r['verify_ms_per_step']:6.2f} "
              f"{r['draft_wait_ms_per_step']:6.2f} {r['draft_work_ms_per_step']:6.2f} {ideal:>8}")


if __name__ == "__main__":
    main()
