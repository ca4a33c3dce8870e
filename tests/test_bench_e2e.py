"""scripts/bench_e2e.py on a tiny pair on the CPU: a matrix at two synthetic acceptances in
one command, each row naming its own, the oracle's acceptance following it, greedy output
compared per acceptance, scripts/plot_ssd_ratio.py picking one of them, a run cut short
keeping the points it measured, and each point's prompts its own."""

from __future__ import annotations

import json

import bench_e2e  # scripts/ is on sys.path (conftest)
import plot_ssd_ratio
import pytest


def test_a_points_prompts_depend_on_nothing_but_the_point():
    prompts = bench_e2e.point_prompts(1000, 8, 4)
    assert len(prompts) == 4 and all(len(p) == 8 and all(10 <= t < 1000 for t in p) for p in prompts)
    assert bench_e2e.point_prompts(1000, 8, 4) == prompts  # whichever points ran before it
    assert bench_e2e.point_prompts(1000, 8, 2) != prompts[:2]  # another point draws its own
    assert len({tuple(p) for p in prompts}) == 4


@pytest.mark.slow  # runtimes one after another
def test_a_matrix_at_two_acceptances_in_one_run(tiny_pair, tmp_path, capsys, monkeypatch):
    out = tmp_path / "e2e.json"
    bench_e2e.main(["--target", tiny_pair.target, "--draft", tiny_pair.draft, "--target-device", "cpu",
                    "--draft-device", "cpu", "--modes", "sd,ssd", "--k", "2", "--synthetic-acceptance", "0.95,0.3",
                    "--synthetic-ranks", "0.5", "--prompt-lens", "8", "--batch-sizes", "2", "--temperatures", "0",
                    "--max-tokens", "24", "--warmup-tokens", "0", "--out", str(out)])
    data = json.loads(out.read_text())
    rows = {(r["synthetic_acceptance"], r["mode"]): r for r in data["rows"]}
    assert set(rows) == {(a, m) for a in (0.95, 0.3) for m in ("sd", "ssd")}
    # The oracle sets the draft's agreement: far more tokens per round at 0.95 than at 0.3.
    assert rows[(0.95, "sd")]["mean_tokens_per_round"] > rows[(0.3, "sd")]["mean_tokens_per_round"] + 0.5
    assert data["greedy_identical"] is True  # SD and SSD agree at each acceptance
    printed = capsys.readouterr()
    assert "[sd] P=8 T=0.0 B=2 alpha=0.95:" in printed.err
    assert any(line.split()[:2] == ["ssd", "0.30"] for line in printed.out.splitlines())
    png = tmp_path / "ratio.png"
    monkeypatch.setattr("sys.argv", ["plot_ssd_ratio.py", str(out), "--out", str(png)])
    with pytest.raises(SystemExit, match="--alpha"):
        plot_ssd_ratio.main()
    monkeypatch.setattr("sys.argv", ["plot_ssd_ratio.py", str(out), "--out", str(png), "--alpha", "0.95"])
    plot_ssd_ratio.main()
    assert png.stat().st_size > 0
    assert set(plot_ssd_ratio.ratios([str(out)], alpha=0.3)) == {(8, 2)}


@pytest.mark.slow
def test_a_run_cut_short_keeps_the_points_it_measured(tiny_pair, tmp_path, monkeypatch):
    out, measured = tmp_path / "e2e.json", []
    real_row = bench_e2e._row

    def row_then_stop(*args, **kwargs):  # the second point is cut short (as a time limit would)
        if measured:
            raise RuntimeError("cut short")
        measured.append(real_row(*args, **kwargs))
        return measured[-1]

    monkeypatch.setattr(bench_e2e, "_row", row_then_stop)
    with pytest.raises(RuntimeError, match="cut short"):
        bench_e2e.main(["--target", tiny_pair.target, "--draft", tiny_pair.draft, "--target-device", "cpu",
                        "--draft-device", "cpu", "--modes", "sd", "--k", "2", "--prompt-lens", "8",
                        "--batch-sizes", "1,2", "--temperatures", "0", "--max-tokens", "8", "--warmup-tokens", "0",
                        "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["batch_size"]) for r in rows] == [("sd", 1)]
