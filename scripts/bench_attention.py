"""The Triton paged attention of graph steps (kernels/paged.py) at the split counts and
launches a graph could be captured with: for each model shape, batch, q_len (decode, K + 1
verify, or with --tree a tree step's branches per request) and context length, us per
layer at the split count the runtime picks (kernels/paged.py::num_splits_for) and at
each of CANDIDATES; with --block-ns, --warps or --stages also at each of those kv
blocks and launches (the runtime's at each split count first); --splits names other split
counts than CANDIDATES. Needs a CUDA GPU.

Each point is captured in a CUDA graph of calls cycling over enough layers' KV (at least
COPY_BYTES) that it streams from memory as in a forward; the figure is us per call, and
`floor_us` the time to read the point's K and V once at the measured copy bandwidth.
A --tree point gives each request `context` rows of shared prefix and TREE_WIDTH own rows
per branch, of which each branch sees its own (forward_batch.TreeMask).

--cascade times each tree point also as flashinfer's two-level cascade: level 0 a
request's q_len branch queries over its shared prefix, level 1 each branch over its own
rows (each a BatchPrefillWithPagedKVCacheWrapper, fa2, planned for CUDA graphs), the two
merged by log-sum-exp (merge_state_in_place), as MultiLevelCascadeAttentionWrapper does
(which has no backend argument: on Hopper it would build fa3). `cascade_us` is its time
per call in the same graph harness, `cascade_err` its largest difference from the Triton
kernel's output at the same point.

    python3 scripts/bench_attention.py --out bench/results/bench_attention_<gpu>.json
    python3 scripts/bench_attention.py --models draft-1b --tree --q-lens 4,8,16 --block-ns 32,64,128 --warps 4,8
    python3 scripts/bench_attention.py --models draft-0.6b,draft-1b --tree --q-lens 8,32 --cascade
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COPY_BYTES = 400e6  # 8x an H100's L2
REPS = 32
SHAPES = {  # heads, kv heads, head dim
    "target-8b": (32, 8, 128),
    "target-32b": (64, 8, 128),
    "draft-1b": (32, 8, 64),
    "draft-0.6b": (16, 8, 128),
}
CANDIDATES = (1, 2, 3, 4, 5, 8, 9, 16, 32)  # powers of two, and 2 x SMs / (batch x kv heads) rounded up at batch 16, 8, 4
TREE_WIDTH = 9  # own rows per branch of a K = 4 tree step: accepted drafts, K scratch rows, the dummy row


def _ints(s: str | None) -> list:
    return [None] if s is None else [int(x) for x in s.split(",")]


def _copy_bandwidth(torch, dev) -> float:
    """Bytes/s of a device copy (read + write)."""
    x = torch.empty(int(1e9), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    y.copy_(x)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(5):
        y.copy_(x)
    e1.record()
    torch.cuda.synchronize()
    return 2 * 5 * x.numel() / (e0.elapsed_time(e1) / 1e3)


def _timed(torch, fn, n_layers: int) -> float:
    """us per call of fn(layer), REPS calls over n_layers layers in one CUDA graph, the best of 3 replays."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(2):
            fn(i % n_layers)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(REPS):
            fn(i % n_layers)
    g.replay()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(3):
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) * 1e3 / REPS)
    return best


def _tree_mask(torch, bs: int, q_len: int, ctx: int, dev):
    """A tree step's (prefix_len [R], lo [T], hi [T]): branch i of a request sees the prefix
    and rows [ctx + i W, ctx + i W + W - 1) of its own (W = TREE_WIDTH; the last is the dummy)."""
    i = torch.arange(q_len, dtype=torch.int32, device=dev).repeat(bs)
    lo = ctx + i * TREE_WIDTH
    return torch.full((bs,), ctx, dtype=torch.int32, device=dev), lo, lo + TREE_WIDTH - 1


def _cascade(torch, shape, bs: int, q_len: int, ctx: int, kv, q):
    """fn(layer) running flashinfer's two-level cascade over the tree step `_tree_mask`
    describes (module doc), its wrappers planned once for CUDA-graph capture."""
    import flashinfer

    hq, hkv, d = shape
    k, v, _, _, per_req = kv
    i32 = dict(dtype=torch.int32, device=k.device)
    own = TREE_WIDTH - 1  # the rows a branch sees of its own (the dummy row is not one)
    base = torch.arange(bs, **i32)[:, None] * per_req  # each request's first row
    prefix = (base + torch.arange(ctx, **i32)).flatten()
    branch = (base + ctx + torch.arange(q_len, **i32) * TREE_WIDTH).flatten()  # [T] first own row
    levels = [  # (qo_indptr, kv_indptr, kv_indices, last_page_len), page size 1
        (torch.arange(0, bs * q_len + 1, q_len, **i32), torch.arange(0, bs * ctx + 1, ctx, **i32), prefix,
         torch.ones(bs, **i32)),
        (torch.arange(bs * q_len + 1, **i32), torch.arange(0, bs * q_len * own + 1, own, **i32),
         (branch[:, None] + torch.arange(own, **i32)).flatten(), torch.ones(bs * q_len, **i32)),
    ]
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=k.device)
    wrappers = []
    for qo, kv_indptr, kv_indices, last in levels:  # fa2, as the runtime's flashinfer wrappers (attention/cuda.py)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=qo, paged_kv_indptr_buf=kv_indptr,
            paged_kv_indices_buf=kv_indices, paged_kv_last_page_len_buf=last, backend="fa2")
        w.plan(qo, kv_indptr, kv_indices, last, hq, hkv, d, 1, causal=False, sm_scale=d ** -0.5,
               q_data_type=k.dtype, kv_data_type=k.dtype)
        wrappers.append(w)

    def run(i):
        paged = (k[i].unsqueeze(1), v[i].unsqueeze(1))  # NHD pages of one row: [rows, 1, Hkv, D]
        out, lse = wrappers[1].run(q, paged, return_lse=True)
        flashinfer.merge_state_in_place(out, lse, *wrappers[0].run(q, paged, return_lse=True))
        return out

    return run


def _point(torch, args, shape, bs, q_len, ctx, kv, num_sms, launches):
    """{(splits, block_n, warps, stages): us} of one point, the runtime's own launch first
    (its split count, kv_block, 4 warps, Triton's default stages: None)."""
    from spec_runtime.kernels.paged import kv_block, num_splits_for, paged_attention

    hq, hkv, d = shape
    k, v, indptr, indices, rows_per_req = kv
    dev = k.device
    q = torch.randn(bs * q_len, hq, d, dtype=k.dtype, device=dev)
    tree = _tree_mask(torch, bs, q_len, ctx, dev) if args.tree else None
    tile = q_len * (hq // hkv)
    runtime = num_splits_for(bs, hkv, num_sms, rows_per_req, tile_rows=tile, head_dim=d)
    keys = dict.fromkeys([(runtime, kv_block(d, tile), 4, None)] + [
        (splits, block_n or kv_block(d, tile), warps or 4, stages)
        for splits in sorted({runtime, *(args.splits or CANDIDATES)}) for block_n, warps, stages in launches])
    us = {}
    for key in keys:
        splits, block_n, warps, stages = key
        kw = dict(q_len=q_len, num_splits=splits, scale=d ** -0.5, tree=tree, block_n=block_n, num_warps=warps,
                  num_stages=stages)
        us[key] = _timed(torch, lambda i: paged_attention(q, k[i], v[i], indptr, indices, **kw), k.shape[0])
    if not args.cascade:
        return runtime, us, None
    run = _cascade(torch, shape, bs, q_len, ctx, kv, q)
    kw = dict(q_len=q_len, num_splits=runtime, scale=d ** -0.5, tree=tree)
    err = (run(0).float() - paged_attention(q, k[0], v[0], indptr, indices, **kw).float()).abs().max().item()
    return runtime, us, (_timed(torch, run, k.shape[0]), err)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="target-8b,target-32b,draft-1b")
    p.add_argument("--batches", default="1,4,8,16,32")
    p.add_argument("--q-lens", default="1,5,9")
    p.add_argument("--contexts", default="512,2048,4096,8192")
    p.add_argument("--tree", action="store_true", help="tree steps: q_len branches per request under the tree mask")
    p.add_argument("--cascade", action="store_true", help="tree points also through flashinfer's cascade (module doc)")
    p.add_argument("--splits", type=_ints, default=None, help="split counts to time (default: CANDIDATES)")
    p.add_argument("--block-ns", default=None, help="kv blocks to time (default: the runtime's, kv_block)")
    p.add_argument("--warps", default=None, help="num_warps to time (default: the runtime's, 4)")
    p.add_argument("--stages", default=None, help="num_stages to time (default: Triton's)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.cascade and not args.tree:
        p.error("--cascade times tree steps: add --tree")

    import torch

    from spec_runtime.kernels.paged import MAX_TILE_M

    dev = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    copy_bw = _copy_bandwidth(torch, dev)
    launches = list(itertools.product(_ints(args.block_ns), _ints(args.warps), _ints(args.stages)))
    rows = []
    for model in args.models.split(","):
        hq, hkv, d = SHAPES[model]
        for ctx, bs, q_len in itertools.product(_ints(args.contexts), _ints(args.batches), _ints(args.q_lens)):
            if q_len * (hq // hkv) > MAX_TILE_M:
                continue
            per_req = ctx + (q_len * TREE_WIDTH if args.tree else 0)
            n_rows = bs * per_req
            layer_bytes = 2 * n_rows * hkv * d * 2
            n_layers = max(1, min(REPS, math.ceil(COPY_BYTES / layer_bytes)))
            k = torch.randn(n_layers, n_rows, hkv, d, dtype=torch.bfloat16, device=dev)
            kv = (k, torch.randn_like(k), torch.arange(0, n_rows + 1, per_req, dtype=torch.int32, device=dev),
                  torch.arange(n_rows, dtype=torch.int32, device=dev), per_req)
            runtime, us, cascade = _point(torch, args, (hq, hkv, d), bs, q_len, ctx, kv, num_sms, launches)
            default = next(iter(us))  # the runtime's launch
            best = min(us, key=us.get)
            label = lambda key: "/".join("-" if x is None else str(x) for x in key)  # noqa: E731
            row = dict(model=model, tree=args.tree, batch=bs, q_len=q_len, context=ctx, runtime=runtime,
                       runtime_us=us[default], best=label(best), best_us=us[best],
                       floor_us=1e6 * layer_bytes / copy_bw, us={label(key): t for key, t in us.items()})
            if cascade is not None:
                row.update(cascade_us=cascade[0], cascade_err=cascade[1])
            rows.append(row)
            print(f"{model:10} {'tree ' if args.tree else ''}ctx {ctx:5d} b {bs:2d} q {q_len:2d}: runtime "
                  f"{runtime:2d} splits {row['runtime_us']:7.1f} us, best {row['best']} {row['best_us']:7.1f} us, "
                  f"floor {row['floor_us']:6.1f} us" + ("" if cascade is None else
                                                       f", cascade {cascade[0]:7.1f} us (err {cascade[1]:.1e})"),
                  flush=True)
            del k, kv
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(dev), num_sms=num_sms, copy_bw_bytes_per_s=copy_bw,
                           reps=REPS, key="splits/block_n/num_warps/num_stages", rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
