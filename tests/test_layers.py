"""The tensor-parallel linear layers at tp_size 1 and 2 on CPU: each rank loads its own
shard through the layer's weight_loader, and the ranks' outputs put together (column
parallel: concatenated; row parallel: summed, which all_reduce does across processes)
equal the whole layer's. (In one process the row layer's all_reduce is left to the test.)
With their weights packed for oneDNN (the CPU runner's default) they compute the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spec_runtime.kernels.plan import KernelPlan
from spec_runtime.layers.embedding import LMHead, VocabEmbedding
from spec_runtime.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    onednn_linear_available,
    pack_for_cpu,
    pack_weight,
)

H, D, HQ, HKV, I = 16, 4, 4, 2, 12


def _ranks(cls, tp: int, *args, bias: bool = True, **kw):
    return [cls(*args, bias=bias, dtype=torch.float32, plan=KernelPlan(), tp_size=tp, tp_rank=r, **kw)
            for r in range(tp)]


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_and_merged_shards_load_per_rank(tp: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, H, generator=g)
    wq, wk, wv = (torch.randn(n * D, H, generator=g) for n in (HQ, HKV, HKV))
    bq, bk, bv = (torch.randn(n * D, generator=g) for n in (HQ, HKV, HKV))
    outs = []
    for layer in _ranks(QKVParallelLinear, tp, H, D, HQ, HKV):
        for shard, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            layer.weight_loader(layer.weight, w, shard)
            layer.weight_loader(layer.bias, b, shard)
        outs.append(layer(x).split([HQ * D // tp, HKV * D // tp, HKV * D // tp], dim=-1))
    for j, (w, b) in enumerate(((wq, bq), (wk, bk), (wv, bv))):
        torch.testing.assert_close(torch.cat([o[j] for o in outs], dim=-1), F.linear(x, w, b))
    wg, wu = torch.randn(I, H, generator=g), torch.randn(I, H, generator=g)
    outs = []
    for layer in _ranks(MergedColumnParallelLinear, tp, H, [I, I], bias=False):
        layer.weight_loader(layer.weight, wg, 0)
        layer.weight_loader(layer.weight, wu, 1)
        outs.append(layer(x).chunk(2, dim=-1))
    torch.testing.assert_close(torch.cat([o[0] for o in outs], dim=-1), F.linear(x, wg))
    torch.testing.assert_close(torch.cat([o[1] for o in outs], dim=-1), F.linear(x, wu))


@pytest.mark.parametrize("tp", [1, 2])
def test_column_and_row_parallel_compose(tp: int) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, H, generator=g)
    w1, b1 = torch.randn(I, H, generator=g), torch.randn(I, generator=g)
    w2, b2 = torch.randn(H, I, generator=g), torch.randn(H, generator=g)
    partial_sums = []
    for col, row in zip(_ranks(ColumnParallelLinear, tp, H, I), _ranks(RowParallelLinear, tp, I, H, reduce_results=False)):
        col.weight_loader(col.weight, w1)
        col.weight_loader(col.bias, b1)
        row.weight_loader(row.weight, w2)
        row.weight_loader(row.bias, b2)
        partial_sums.append(row(col(x)))  # the column output feeds the row layer with no gather
    assert RowParallelLinear(I, H, bias=False, dtype=torch.float32, plan=KernelPlan()).reduce_results
    want = F.linear(F.linear(x, w1, b1), w2, b2)
    torch.testing.assert_close(sum(partial_sums), want, atol=1e-5, rtol=1e-5)


def test_loaders_refuse_wrong_shapes_and_shards() -> None:
    rep = ReplicatedLinear(H, I, bias=False, dtype=torch.float32, plan=KernelPlan())
    with pytest.raises(ValueError, match="shape"):
        rep.weight_loader(rep.weight, torch.zeros(I + 1, H))
    qkv = QKVParallelLinear(H, D, HQ, HKV, bias=False, dtype=torch.float32, plan=KernelPlan())
    with pytest.raises(ValueError, match="shards q, k, v"):
        qkv.weight_loader(qkv.weight, torch.zeros(HQ * D, H), "x")
    with pytest.raises(ValueError, match="do not split"):
        QKVParallelLinear(H, D, HQ, 1, bias=False, dtype=torch.float32, plan=KernelPlan(), tp_size=2)


needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear")


@needs_onednn
@pytest.mark.parametrize("tp", [1, 2])
def test_packed_layers_compute_what_plain_ones_do(tp: int) -> None:
    g = torch.Generator().manual_seed(2)
    w1, b1 = torch.randn(I, H, generator=g), torch.randn(I, generator=g)
    w2, b2 = torch.randn(H, I, generator=g), torch.randn(H, generator=g)
    for rows in (1, 3, 9):
        x = torch.randn(rows, H, generator=g)
        partial_sums = []
        for col, row in zip(_ranks(ColumnParallelLinear, tp, H, I),
                            _ranks(RowParallelLinear, tp, I, H, reduce_results=False)):
            for layer, w, b in ((col, w1, b1), (row, w2, b2)):
                layer.weight_loader(layer.weight, w)
                layer.weight_loader(layer.bias, b)
            plain = row(col(x))
            col.pack_for_cpu()
            row.pack_for_cpu()
            assert col.weight is None and row.weight is None  # one copy of each weight
            packed = row(col(x))
            torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)
            partial_sums.append(packed)
        want = F.linear(F.linear(x, w1, b1), w2, b2)
        torch.testing.assert_close(sum(partial_sums), want, atol=1e-4, rtol=1e-5)


@needs_onednn
def test_packed_lm_heads_and_the_model_walk() -> None:
    g = torch.Generator().manual_seed(3)
    vocab, hidden = torch.randn(50, H, generator=g), torch.randn(4, H, generator=g)
    model = torch.nn.ModuleDict({"embed": VocabEmbedding(50, H, torch.float32), "head": LMHead(50, H, torch.float32),
                                 "proj": ReplicatedLinear(H, I, bias=False, dtype=torch.float32, plan=KernelPlan())})
    for m in model.values():
        m.weight.data.copy_(vocab if m.weight.shape[0] == 50 else torch.randn(I, H, generator=g))
    proj_w = model["proj"].weight.detach().clone()
    ids = torch.tensor([3, 7])
    assert pack_for_cpu(model) == 3
    # The tied head keeps its plain weight for the lookups; the others hold only the packed copy.
    torch.testing.assert_close(model["embed"](ids), vocab[ids], atol=0, rtol=0)
    assert model["head"].weight is None and model["proj"].weight is None
    for m in (model["embed"], model["head"]):
        torch.testing.assert_close(m.logits(hidden), F.linear(hidden, vocab), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model["proj"](hidden), F.linear(hidden, proj_w), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="float32 CPU weight"):
        pack_weight(torch.zeros(4, 4, dtype=torch.bfloat16))
