"""scripts/real_pair.py end to end on a tiny pair: every mode runs, the JSON holds each figure."""

from __future__ import annotations

import json

import pytest
import real_pair  # scripts/ is on sys.path (conftest)

pytestmark = pytest.mark.slow  # three runtimes one after another


def test_report_on_a_tiny_pair(tiny_pair, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nthe quick brown fox\n")
    out = tmp_path / "report.json"
    rc = real_pair.main(["--target", tiny_pair.target, "--draft", tiny_pair.draft, "--prompts", str(prompts),
                         "--max-tokens", "8", "--ks", "2", "--ssd-k", "2", "--fan-outs", "2", "--temperatures", "0,0.7",
                         "--max-model-len", "128", "--draft-timeout-s", "30", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["complete"] and report["num_prompts"] == 2
    runs = {(r["mode"], r["temperature"]): r for r in report["runs"]}
    assert set(runs) == {(m, t) for m in ("ar", "sd", "ssd") for t in (0.0, 0.7)}
    for (mode, _), r in runs.items():
        assert r["num_generated_tokens"] > 0 and r["tokens_per_s"] > 0
        if mode != "ar":
            assert len(r["acceptance_per_position"]) == 2 and r["num_drafts"] > 0
    # The draft is a perturbed copy of the target: right some of the time.
    assert runs[("sd", 0.0)]["acceptance_rate"] > 0
    assert runs[("ssd", 0.0)]["fan_out"] == 2 and runs[("ssd", 0.0)]["cache_hit_rate"] > 0
    ranks = report["rank_distribution"]
    assert ranks["num_positions"] == runs[("ar", 0.0)]["num_generated_tokens"]
    assert abs(sum(ranks["measured"]) - 1) < 1e-3 and abs(sum(ranks["oracle_at_measured_alpha"]) - 1) < 1e-3
    assert ranks["measured"][0] > 0 and ranks["oracle_at_measured_alpha"][0] == ranks["measured"][0]
    assert "rank of the target's greedy token" in capsys.readouterr().out
