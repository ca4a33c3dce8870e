"""Plot tokens/s against batch size for AR, SD and SSD from bench_e2e.py JSON files.

    python scripts/plot_e2e.py bench/results/e2e_32b_k8_nvidia-h200-x2_2026-11-22.json \\
        bench/results/e2e_8b_k2_nvidia-h200-x2_2026-11-22.json --out e2e.png
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("files", nargs="+")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for path in args.files:
        with open(path) as f:
            data = json.load(f)
        a = data["args"]
        # One panel per (synthetic acceptance, temperature): a run may hold several of each.
        keys = sorted({(r.get("synthetic_acceptance"), r["temperature"]) for r in data["rows"]}, key=str)
        for alpha, temp in keys:
            panels.append((a, alpha, temp, [r for r in data["rows"]
                                            if (r.get("synthetic_acceptance"), r["temperature"]) == (alpha, temp)]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (a, alpha, temp, rows) in zip(axes[0], panels):
        for mode, style, color in (("ar", "o-", "tab:blue"), ("sd", "s-", "tab:orange"), ("ssd", "^-", "tab:green")):
            pts = sorted((r["batch_size"], r["tokens_per_s"]) for r in rows if r["mode"] == mode)
            if pts:
                ax.plot(*zip(*pts), style, color=color, label=mode.upper())
        ideal = sorted((r["batch_size"], r["ideal_tokens_per_s"]) for r in rows if r["mode"] == "ssd")
        if ideal:
            ax.plot(*zip(*ideal), "k:", label="SSD all-hit ideal")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s")
        t, d = a["target"].split(":")[-1], a["draft"].split(":")[-1]
        ax.set_title(f"{t} + {d}, K={a['k']}, T={temp}\nsynthetic alpha {alpha}, "
                     f"ranks {','.join(str(x) for x in a['synthetic_ranks'])}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {os.path.abspath(args.out)}")


if __name__ == "__main__":
    main()
