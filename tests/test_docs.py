"""The docs and bench/results/ agree: every result file is cited, every citation exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CITATION = re.compile(r"bench/results/([A-Za-z0-9_.,\-]+)")


def _docs() -> dict[str, str]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in files}


def _cited() -> dict[str, set[str]]:
    """File name -> the docs that cite it as bench/results/NAME."""
    out: dict[str, set[str]] = {}
    for doc, text in _docs().items():
        for name in CITATION.findall(text):
            out.setdefault(name.rstrip(".,"), set()).add(doc)
    return out


def test_every_result_file_is_cited():
    cited = _cited()
    uncited = sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.name not in cited)
    assert not uncited, f"bench/results/ files no doc cites (cite them or remove them): {uncited}"


def test_every_cited_result_file_exists():
    missing = {name: sorted(docs) for name, docs in _cited().items() if not (RESULTS / name).is_file()}
    assert not missing, f"cited but not in bench/results/: {missing}"
