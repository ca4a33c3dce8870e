"""spec_runtime.engine.staging.upload_int64: the arrays come back in order, as int64 views of
one buffer, the last int32_tail of them as int32 views, each aligned to 16 bytes but the
`packed` ones, which lie back to back; on a GPU through pinned buffers reused in turn, the
copies a later reuse overwrites having run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spec_runtime.engine.staging import SLOTS, upload_int64


def _parts():
    return [np.array([1, -2, 3], dtype=np.int64), np.array([True, False]), np.arange(5, dtype=np.int32),
            np.array([], dtype=np.int64), np.array([2**40, 7]), np.array([4, 5, 6], dtype=np.int32)]


def test_views_in_order_with_an_int32_tail():
    parts = _parts()
    views = upload_int64(parts, "cpu", int32_tail=2)
    assert [v.dtype for v in views] == [torch.int64] * 4 + [torch.int32] * 2
    assert views[0].untyped_storage().data_ptr() == views[2].untyped_storage().data_ptr()
    assert views[4].untyped_storage().data_ptr() == views[5].untyped_storage().data_ptr()
    assert [v.storage_offset() * v.element_size() % 16 for v in views] == [0] * 6  # each 16-byte aligned
    want = [a.astype(np.int64) for a in parts]
    want[4] = want[4].astype(np.int32)  # 2**40 wraps, as any int32 conversion does
    for v, w in zip(views, want):
        assert v.tolist() == w.tolist()
    packed = upload_int64(parts, "cpu", int32_tail=2, packed=3)
    assert [v.storage_offset() for v in packed[:4]] == [0, 3, 5, 10]  # three back to back, then aligned
    assert [v.tolist() for v in packed] == [v.tolist() for v in views]
    assert upload_int64([], "cpu") == []
    assert [v.tolist() for v in upload_int64(parts[:2], "cpu")] == [[1, -2, 3], [1, 0]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_every_upload_lands_though_its_buffer_is_reused():
    torch.cuda.synchronize()
    big = torch.empty(1 << 26, device="cuda")
    got, want = [], []
    for i in range(4 * SLOTS):
        if i % SLOTS == 0:
            big.mul_(1.0)  # keep the GPU busy while the host refills the buffers
        parts = [np.full(1000 + i, i, dtype=np.int64), np.arange(i + 1, dtype=np.int32)]
        got.append(upload_int64(parts, "cuda", int32_tail=1))
        want.append(parts)
    torch.cuda.synchronize()
    for views, parts in zip(got, want):
        for v, p in zip(views, parts):
            assert v.cpu().tolist() == p.tolist()
