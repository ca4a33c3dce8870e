"""spec_runtime.kernels.race.draft_race (the draft's exponential race in one kernel), run on
the CPU by Triton's interpreter, against the torch race it replaces: the same token for
every row, over seeds of both signs, large positions, ties and rows of one token."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton_interp  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

from spec_runtime.kernels.race import draft_race  # noqa: E402
from spec_runtime.sampling import STREAM_DRAFT, STREAM_TARGET, draft_race_torch, stream_key  # noqa: E402


@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("stream", [STREAM_DRAFT, STREAM_TARGET])
def test_the_kernel_picks_the_torch_race_s_token(m, stream):
    rng = np.random.default_rng(m + 10 * stream)
    r = 200
    seeds = torch.from_numpy(rng.integers(-(2**63), 2**63 - 1, size=r, dtype=np.int64))
    positions = torch.from_numpy(rng.integers(0, 2**32 - 1, size=r, dtype=np.int64))
    ids = torch.from_numpy(np.stack([rng.choice(200_000, m, replace=False) for _ in range(r)]).astype(np.int64))
    probs = torch.from_numpy(rng.dirichlet(np.ones(m), size=r).astype(np.float32))
    probs[:20] = 1.0 / m  # ties: the race, not the order, decides
    got = draft_race(seeds, positions, stream_key(stream), ids, probs)
    assert got.dtype == torch.int64 and got.shape == (r,)
    torch.testing.assert_close(got, draft_race_torch(seeds, positions, stream, ids, probs), rtol=0, atol=0)
