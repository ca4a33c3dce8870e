"""The shared-prefix tree step (forward_batch.build_tree_batch / tree_step_batch).

A tree step runs each sequence's branches as the tokens of one request under the
TreeMask; it must give every branch exactly the logits the per-branch layout gives
(one request per branch, its rows listed in full), at step 0 and at later steps that
are derived on the device, with padding branches that touch nothing but the dummy row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import save_tiny_model
from spec_runtime.config import ModelConfig
from spec_runtime.engine.forward_batch import ForwardItem, TreeBranch, build_tree_batch, tree_step_batch
from spec_runtime.engine.runner import ModelRunner

MAX_LEN = 64
SCRATCH = 4  # rows per branch


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("tree") / "m", "qwen3")
    return ModelRunner(ModelConfig(path=path), num_slots=2, max_model_len=MAX_LEN, num_scratch_rows=8 * SCRATCH)


def _scratch(runner, i, length):
    base = runner.layout.scratch_base + i * SCRATCH
    return np.arange(base, base + length, dtype=np.int64)


def test_build_tree_batch_pads_and_moves_on():
    b = TreeBranch(token_id=7, position=10, local_rows=np.array([50, 51, 52]), num_visible=2)
    first = build_tree_batch([np.arange(10)], [[b]], 2, 99, "cpu")
    assert first.input_ids.tolist() == [7, 0] and first.positions.tolist() == [10, 0]
    assert first.kv_write_rows.tolist() == [51, 99]  # the pad writes the dummy row
    assert first.kv_indices.tolist() == list(range(10)) + [50, 51, 52, 99]
    assert first.tree.lo_cpu.tolist() == [10, 13] and first.tree.hi_cpu.tolist() == [12, 14]
    step = tree_step_batch(first, 1, torch.tensor([3, 0]))
    assert step.input_ids.tolist() == [3, 0] and step.positions.tolist() == [11, 0]
    assert step.kv_write_rows.tolist() == [52, 99]
    assert step.tree.hi.tolist() == [13, 14] and step.tree.hi_cpu.tolist() == [13, 14]
    with pytest.raises(ValueError, match="q_len"):
        build_tree_batch([np.arange(3)], [[b, b, b]], 2, 99, "cpu")


def test_tree_step_equals_per_branch_forwards(runner):
    rng = np.random.default_rng(0)
    lens = (9, 14)
    drafts = 3  # d_1..d_3 after each prompt, in the slot
    for slot, n in enumerate(lens):
        toks = rng.integers(3, 300, size=n + drafts).tolist()
        runner.run([ForwardItem(toks, 0, runner.layout.slot_rows(slot, n + drafts), "none")])
    # Branches (slot, depth j, token): fork after j accepted drafts.
    forks = [(0, 0, 11), (0, 2, 12), (0, 3, 13), (1, 1, 14), (1, 0, 15)]
    steps = 3
    # Per-branch layout: one request per branch, prefix [0, n + j) then its scratch rows.
    ref, prev = [], None
    for i in range(steps):
        items = []
        for b, (slot, j, t) in enumerate(forks):
            n = lens[slot]
            tok = t if prev is None else int(prev[b])
            rows = np.concatenate([runner.layout.slot_rows(slot, n + j), _scratch(runner, b, i + 1)])
            items.append(ForwardItem([tok], n + j + i, rows, "last"))
        logits = runner.run(items)
        ref.append(logits)
        prev = logits.argmax(-1)
    # Tree layout, q_len 4 (sequence 1 has a padding branch), later steps on the device.
    prefixes = [runner.layout.slot_rows(s, lens[s]) for s in (0, 1)]
    branches, select = [[], []], []
    for b, (slot, j, t) in enumerate(forks):
        n, base = lens[slot], slot * MAX_LEN
        local = np.concatenate([np.arange(base + n, base + n + j), _scratch(runner, b, SCRATCH)])
        branches[slot].append(TreeBranch(t, n + j, local, j + 1))
        select.append(slot * 4 + len(branches[slot]) - 1)
    first = build_tree_batch(prefixes, branches, 4, runner.dummy_row, "cpu")
    sel = torch.tensor(select)
    prev = None
    for i in range(steps):
        batch = first if i == 0 else tree_step_batch(first, i, prev)
        logits = runner.forward(batch)[sel]
        torch.testing.assert_close(logits, ref[i], rtol=1e-4, atol=1e-4)
        prev = torch.zeros(8, dtype=torch.int64)
        prev[sel] = logits.argmax(-1)
