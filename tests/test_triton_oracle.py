"""spec_runtime.bench.oracle_device (the draft oracle's logits in one kernel), run on the
CPU by Triton's interpreter, against oracle.py's NumPy statement: the same logits, bit for
bit, for seeds of either sign and past 2**32, positions moved on by a step, vocabularies
of one and of several chunks, and acceptance settings with and without ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton_interp  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

from spec_runtime.bench import oracle  # noqa: E402
from spec_runtime.bench.oracle_device import CHUNK  # noqa: E402


@pytest.mark.parametrize("values", [(0.8, 0.5, 0.2, 0.1), (0.6,), (1.0,), (0.0, 1.0), (0.7, 0.3, 0.3)])
def test_the_kernel_writes_what_the_host_writes(values):
    tf = oracle.draft_oracle(values)
    seeds = np.array([3, 7, 7, -5, 11, 2**40 + 1, -(2**62)], dtype=np.int64)
    positions = np.array([10, 10, 400, 0, 33, 8191, 5], dtype=np.int64)
    for vocab, step in ((97, 0), (CHUNK + 513, 3)):
        like = torch.zeros(len(seeds), vocab)
        got = tf._on_device(like, torch.from_numpy(seeds), torch.from_numpy(positions), step)
        want = oracle.draft_oracle_logits(like, seeds, positions + step, tf.alpha, tf.ranks)
        assert torch.equal(got, want), (values, vocab, step)
