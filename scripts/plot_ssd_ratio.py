"""Plot SSD's decode tokens/s over SD's, per (prompt length, batch size), from
bench_e2e.py JSON files that hold both modes (greedy rows).

    python scripts/plot_ssd_ratio.py bench/results/e2e_32b_k8_p512_nvidia-h200-x2_2026-11-24.json \\
        bench/results/e2e_32b_k8_long_nvidia-h200-x2_2026-11-24.json --out ssd_over_sd.png

A cell compares the two modes of one file (one run); points a file lacks stay blank.
"""

from __future__ import annotations

import argparse
import json
import os


def ratios(paths: list[str], mode: str = "ssd", base: str = "sd", alpha: float | None = None
           ) -> dict[tuple[int, int], float]:
    """(prompt length, batch size) -> decode tokens/s of `mode` over `base`, temperature 0;
    alpha: the rows of that synthetic acceptance only (needed where a file holds several)."""
    out = {}
    for path in paths:
        with open(path) as f:
            rows = [r for r in json.load(f)["rows"] if r["temperature"] == 0
                    and (alpha is None or r.get("synthetic_acceptance") == alpha)]
        alphas = {r.get("synthetic_acceptance") for r in rows}
        if len(alphas) > 1:
            raise SystemExit(f"{path} holds rows at synthetic acceptance {sorted(alphas)}: name one with --alpha")
        rate = {(r["mode"], r["prompt_len"], r["batch_size"]): r["decode_tokens_per_s"] for r in rows}
        for (m, p, b), v in rate.items():
            if m == mode and (base, p, b) in rate:
                out[(p, b)] = v / rate[(base, p, b)]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("files", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--alpha", type=float, default=None, help="the synthetic acceptance whose rows to plot")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    r = ratios(args.files, alpha=args.alpha)
    if not r:
        raise SystemExit("no (prompt, batch) point has both SSD and SD rows")
    prompts, batches = sorted({p for p, _ in r}), sorted({b for _, b in r})
    grid = np.full((len(prompts), len(batches)), np.nan)
    for (pl, b), v in r.items():
        grid[prompts.index(pl), batches.index(b)] = v
    fig, ax = plt.subplots(figsize=(1.2 * len(batches) + 2, 0.8 * len(prompts) + 1.6))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=1.5, aspect="auto")
    for i in range(len(prompts)):
        for j in range(len(batches)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(batches)), [str(b) for b in batches])
    ax.set_yticks(range(len(prompts)), [str(pl) for pl in prompts])
    ax.set_xlabel("batch size")
    ax.set_ylabel("prompt tokens")
    ax.set_title("SSD / SD, decode tokens/s", fontsize=10)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {os.path.abspath(args.out)}")


if __name__ == "__main__":
    main()
