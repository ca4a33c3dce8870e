"""spec_runtime.kernels.forks (a work-ahead's forks chosen and its first tree step written in
one kernel), run on the CPU by Triton's interpreter, against draft_proc/fork_device.py's
torch statement of both: the same forks (depth, token, rank, validity) and the same step
inputs (token ids, positions, window ends, kv rows), over random rankings with ties,
sequences of different drafts counts and fan-outs, wide and narrow rankings."""

from __future__ import annotations

import numpy as np
import triton_interp  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

from test_fork_device import kernel_against_torch  # noqa: E402


def test_the_kernel_chooses_and_writes_what_the_torch_statement_does():
    checked, narrow = kernel_against_torch("cpu", np.random.default_rng(8), trials=60)
    assert checked > 30 and narrow > 2
