"""GPU path (flashinfer + CUDA graphs + fused ops) against the CPU SDPA path and transformers.

Skipped without CUDA. Models are random HF checkpoints saved with save_pretrained, with
head_dim 128 (flashinfer's kernels are built per head_dim; 128 is what the benchmarked
shapes use) and weights rounded to bf16 in the checkpoint. One scenario of forwards runs on a bf16 CUDA runner with graphs, one
without graphs, and a float32 CPU runner; logits must agree within bf16 tolerance
(relative error, Frobenius norm, below 1e-2), and with transformers' float32 forward
over the same token sequences:
  ragged prefill -> padded decode steps (3 requests on the 4-graph) -> verify of K+1 = 5
  tokens over the cache -> rollback and re-verify -> branch requests (prefix rows +
  scratch rows) -> a lone decode.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import save_tiny_model
from transformers import AutoModelForCausalLM

from spec_runtime.config import KernelConfig, ModelConfig
from spec_runtime.engine.forward_batch import ForwardItem
from spec_runtime.engine.runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = 1e-2
MAX_LEN = 128
SCRATCH = 16
VERIFY_Q = 5
MODELS = {
    # name: (model_type, overrides)
    "tiny-llama": ("llama", dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=512, num_hidden_layers=2, initializer_range=0.05)),
    "medium-llama": ("llama", dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
                                   intermediate_size=2048, num_hidden_layers=4, initializer_range=0.02)),
    "medium-qwen3": ("qwen3", dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                                   intermediate_size=1024, num_hidden_layers=3, initializer_range=0.02)),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm())


def _runner(path: str, device: str, graphs: bool = True, kernels: KernelConfig | None = None) -> ModelRunner:
    cfg = ModelConfig(path=path, device=device, cuda_graphs=graphs, gpu_memory_utilization=0.5)
    return ModelRunner.build(cfg, kernels=kernels, num_slots=4, max_model_len=MAX_LEN, num_scratch_rows=SCRATCH,
                             max_batch_size=4, graph_q_lens=(1, VERIFY_Q))


def scenario(runner: ModelRunner, vocab: int) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
    """Run the fixed list of forwards; return each forward's logits and each sequence's tokens."""
    rng = np.random.default_rng(1)
    tok = lambda n: [int(t) for t in rng.integers(3, vocab, n)]  # noqa: E731
    lay = runner.layout
    seqs = {s: tok(n) for s, n in zip(range(3), (20, 33, 7))}
    out = [runner.run([ForwardItem(seqs[s], 0, lay.slot_rows(s, len(seqs[s]))) for s in seqs])]
    for _ in range(2):  # decode: 3 requests on the batch-4 graph (one padding request)
        items = []
        for s in seqs:
            seqs[s].append(tok(1)[0])
            n = len(seqs[s])
            items.append(ForwardItem(seqs[s][-1:], n - 1, lay.slot_rows(s, n)))
        out.append(runner.run(items))
    for accept in (None, 2):  # verify K+1 tokens; then roll back to 2 accepted and verify again
        items = []
        for s in seqs:
            if accept is not None:
                del seqs[s][-(VERIFY_Q - accept):]
            start = len(seqs[s])
            seqs[s] += tok(VERIFY_Q)
            items.append(ForwardItem(seqs[s][start:], start, lay.slot_rows(s, len(seqs[s])), "all"))
        out.append(runner.run(items))
    # Branches of sequence 0 forked at position 15: prefix rows + their own scratch rows.
    fork, branches = 15, {}
    for step in range(2):
        items = []
        for i in range(2):
            key = f"b{i}"
            branches.setdefault(key, seqs[0][:fork])
            branches[key].append(tok(1)[0])
            n = len(branches[key])
            scratch = lay.scratch_base + 4 * i + np.arange(step + 1)
            rows = np.concatenate([lay.slot_rows(0, fork), scratch])
            items.append(ForwardItem(branches[key][-1:], n - 1, rows))
        out.append(runner.run(items))
    seqs[1].append(tok(1)[0])  # a lone decode: the batch-1 graph, no padding
    out.append(runner.run([ForwardItem(seqs[1][-1:], len(seqs[1]) - 1, lay.slot_rows(1, len(seqs[1])))]))
    return out, {**{str(s): v for s, v in seqs.items()}, **branches}


@pytest.fixture(scope="module", params=list(MODELS))
def model_dir(request, tmp_path_factory) -> str:
    """A checkpoint whose weights are exactly representable in bf16, so the float32 CPU
    path, transformers and the bf16 GPU path all run the *same* weights and the
    comparison measures the GPU path's arithmetic, not the rounding of the checkpoint."""
    model_type, overrides = MODELS[request.param]
    path = save_tiny_model(tmp_path_factory.mktemp(request.param), model_type, **overrides)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("attention", ["triton", "flashinfer"])
def test_gpu_matches_cpu_graphs_and_transformers(model_dir: str, attention: str) -> None:
    # One-token steps: the one-token Triton projections with the Triton attention,
    # cuBLAS with flashinfer's, so each kind runs here whatever the timing would pick.
    kernels = KernelConfig(attention_backend=attention, small_linear="on" if attention == "triton" else "off")
    gpu = _runner(model_dir, "cuda", graphs=True, kernels=kernels)
    assert gpu.model.kernels.fused and gpu.model.kernels.small_linear == (attention == "triton")
    assert gpu.graphs is not None and len(gpu.graphs.graphs) == 3 * 2  # batch sizes 1, 2, 4 x q_len 1, 5
    vocab = gpu.vocab_size
    gpu_out, seqs = scenario(gpu, vocab)
    # Padding requests wrote only the dummy row: slot 3 and the rows past each live
    # sequence's end were never used and are still zero.
    lay = gpu.layout
    unused = np.concatenate([lay.slot_rows(3, MAX_LEN)] + [
        lay.slot_rows(s, MAX_LEN)[len(seqs[str(s)]):] for s in range(3)])
    for k, v in zip(gpu.kv_cache.k_cache, gpu.kv_cache.v_cache):
        assert float(k[unused].abs().max()) == 0.0 and float(v[unused].abs().max()) == 0.0
    del gpu
    eager = _runner(model_dir, "cuda", graphs=False)
    assert eager.graphs is None
    eager_out, _ = scenario(eager, vocab)
    del eager
    cpu = _runner(model_dir, "cpu")
    cpu_out, cpu_seqs = scenario(cpu, vocab)
    assert cpu_seqs == seqs
    errs: dict[str, float] = {}
    for i, (g, e, c) in enumerate(zip(gpu_out, eager_out, cpu_out)):
        assert g.shape == c.shape and g.dtype == torch.float32
        errs[f"{i} graphs/cpu"] = rel_err(g, c)
        errs[f"{i} eager/cpu"] = rel_err(e, c)
        errs[f"{i} graphs/eager"] = rel_err(g, e)
    # transformers (float32, CPU) over the final sequences: the last verify's K+1 logits
    # per sequence, and the last step of each branch.
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        verify = gpu_out[4].view(3, VERIFY_Q, -1)
        for s in range(3):
            seq = seqs[str(s)]
            if s == 1:
                seq = seq[:-1]  # the lone decode came after the verify
            ref = hf(torch.tensor([seq])).logits[0, -VERIFY_Q:]
            errs[f"verify {s}/hf"] = rel_err(verify[s], ref)
        for i in range(2):
            ref = hf(torch.tensor([seqs[f"b{i}"]])).logits[0, -1]
            errs[f"branch {i}/hf"] = rel_err(gpu_out[6][i], ref)
    table = ", ".join(f"{k}: {v:.1e}" for k, v in errs.items())
    print(f"relative errors: {table}")
    # Each GPU path against the float32 references within TOL. Graphs and eager may run
    # a step with different projection kernels (a graph pads one request to a batch of
    # two, which goes to cuBLAS, not triton_linear), so two independent bf16 roundings
    # separate them: up to about twice TOL.
    worst = max(v for k, v in errs.items() if not k.endswith("graphs/eager"))
    assert worst < TOL, f"relative errors above {TOL}: {table}"
    assert max(errs.values()) < 2 * TOL, f"graphs and eager differ by over {2 * TOL}: {table}"


def test_flashinfer_causal_is_bottom_right() -> None:
    """flashinfer prefill with q_len < kv_len against SDPA with the bottom-right mask, per request."""
    from spec_runtime.attention.sdpa import SDPABackend
    from spec_runtime.attention.cuda import CudaAttentionBackend
    from spec_runtime.engine.forward_batch import build_forward_batch
    from spec_runtime.engine.kv_cache import KVCache

    hq, hkv, d, rows = 8, 2, 128, 256
    torch.manual_seed(0)
    kv = KVCache(1, rows, hkv, d, torch.bfloat16, "cuda")
    kv.k_cache[0].normal_()
    kv.v_cache[0].normal_()
    # q_len 3 over 40 rows, q_len 6 over 6 rows (pure prefill), q_len 1 over 17 rows, scattered rows.
    perm = torch.randperm(rows - 1).numpy()
    items = [ForwardItem([1] * 3, 37, perm[:40]), ForwardItem([1] * 6, 0, perm[40:46]),
             ForwardItem([1], 16, perm[46:63])]
    batch = build_forward_batch(items, "cuda")
    t = batch.input_ids.shape[0]
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    fi = CudaAttentionBackend(hq, hkv, d, torch.bfloat16, "cuda")
    fi.begin(batch)
    out = fi.forward(0, q, k_new, v_new, kv, batch)
    ref_kv = KVCache(1, rows, hkv, d, torch.float32, "cuda")
    ref_kv.k_cache[0].copy_(kv.k_cache[0])
    ref_kv.v_cache[0].copy_(kv.v_cache[0])
    sdpa = SDPABackend(hq, hkv, d)
    sdpa.begin(batch)
    ref = sdpa.forward(0, q.float(), k_new.float(), v_new.float(), ref_kv, batch)
    assert rel_err(out, ref) < TOL, f"flashinfer vs SDPA: {rel_err(out, ref):.2e}"


def test_flashinfer_plans_queued_back_to_back() -> None:
    """Prefill pieces queued with no sync between them (a long prompt's chunks while
    nothing decodes): each forward gets its own plan, though the host plans the next
    one while the GPU is still busy. Equal to the same forwards run one at a time."""
    from spec_runtime.attention.cuda import CudaAttentionBackend
    from spec_runtime.engine.forward_batch import build_forward_batch
    from spec_runtime.engine.kv_cache import KVCache

    hq, hkv, d, rows = 32, 8, 128, 16384
    torch.manual_seed(0)
    kv = KVCache(1, rows, hkv, d, torch.bfloat16, "cuda")
    kv.k_cache[0].normal_()
    kv.v_cache[0].normal_()
    rng = np.random.default_rng(0)
    batches, qs = [], []
    for i in range(16):  # pieces of 1,000-2,000 tokens at offsets up to 6,000, sometimes with a short prompt
        q_len, start = int(rng.integers(1000, 2000)), int(rng.integers(0, 6000))
        items = [ForwardItem([1] * q_len, start, rng.choice(rows, start + q_len, replace=False), "none")]
        if i % 2:
            n = int(rng.integers(20, 200))
            items.insert(0, ForwardItem([1] * n, 0, rng.choice(rows, n, replace=False), "last"))
        batches.append(build_forward_batch(items, "cuda"))
        qs.append(torch.randn(batches[-1].input_ids.shape[0], hq, d, device="cuda", dtype=torch.bfloat16))
    fi = CudaAttentionBackend(hq, hkv, d, torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # the host runs ahead of the GPU from here on
        busy = busy @ busy / 64
    queued = []
    for batch, q in zip(batches, qs):
        fi.begin(batch)
        queued.append(fi.attend(0, q, kv, batch))
    torch.cuda.synchronize()
    for i, (batch, q) in enumerate(zip(batches, qs)):
        fi.begin(batch)
        alone = fi.attend(0, q, kv, batch)
        torch.cuda.synchronize()
        assert rel_err(queued[i], alone) < 1e-3, f"forward {i}: {rel_err(queued[i], alone):.2e}"


def test_triton_attention_compiles_once_per_tile_shape() -> None:
    """Eager forwards of any q_len and split count reuse the kernel of their tile shape:
    q_len and the split count are arguments, not compile-time constants."""
    from spec_runtime.kernels.paged import _attn_split_kernel, paged_attention

    caches = getattr(_attn_split_kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton version keeps no per-device kernel cache to count")
    hq, hkv, d, rows, kv = 16, 8, 128, 2048, 700
    k = torch.randn(rows, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    indices = torch.arange(kv, device="cuda", dtype=torch.int32)
    indptr = torch.tensor([0, kv], device="cuda", dtype=torch.int32)
    before = sum(len(c[0]) for c in caches.values())
    block_ms = set()
    for q_len in range(1, 10):
        block_ms.add(max(16, 1 << (q_len * (hq // hkv) - 1).bit_length()))
        for splits in (1, 2, 5, 16, 26):
            q = torch.randn(q_len, hq, d, device="cuda", dtype=torch.bfloat16)
            paged_attention(q, k, v, indptr, indices, q_len=q_len, num_splits=splits, scale=d**-0.5)
    torch.cuda.synchronize()
    compiled = sum(len(c[0]) for c in caches.values()) - before
    assert compiled <= len(block_ms), f"{compiled} compiled split kernels for {len(block_ms)} tile shapes"


@pytest.mark.parametrize("hq,hkv,q_len,kv_lens", [
    (32, 8, 1, [1, 600, 37] + [300] * 13),  # 8B decode at batch 16
    (64, 8, 9, [9, 700, 128]),  # 32B verify of K+1 = 9: a 72-row tile
    (16, 8, 4, [2000, 4]),  # many rows per split
])
def test_triton_attention_matches_sdpa(hq: int, hkv: int, q_len: int, kv_lens: list[int]) -> None:
    """The Triton kernel with bf16 tensor-core dots against SDPA, head_dim 128."""
    from spec_runtime.attention.sdpa import SDPABackend
    from spec_runtime.engine.forward_batch import build_forward_batch
    from spec_runtime.engine.kv_cache import KVCache
    from spec_runtime.kernels.paged import num_splits_for, paged_attention

    d, rows = 128, 4096
    torch.manual_seed(0)
    kv = KVCache(1, rows, hkv, d, torch.bfloat16, "cuda")
    kv.k_cache[0].normal_()
    kv.v_cache[0].normal_()
    rng = np.random.default_rng(0)
    items = [ForwardItem([1] * q_len, n - q_len, rng.choice(rows, n, replace=False), "all") for n in kv_lens]
    batch = build_forward_batch(items, "cuda")
    q = torch.randn(batch.input_ids.shape[0], hq, d, device="cuda", dtype=torch.bfloat16)
    ref_kv = KVCache(1, rows, hkv, d, torch.float32, "cuda")
    ref_kv.k_cache[0].copy_(kv.k_cache[0])
    ref_kv.v_cache[0].copy_(kv.v_cache[0])
    sdpa = SDPABackend(hq, hkv, d)
    sdpa.begin(batch)
    w = batch.kv_write_rows
    ref = sdpa.forward(0, q.float(), ref_kv.k_cache[0][w].clone(), ref_kv.v_cache[0][w].clone(), ref_kv, batch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for splits in sorted({1, num_splits_for(len(kv_lens), hkv, sms), 7}):
        out = paged_attention(q, kv.k_cache[0], kv.v_cache[0], batch.kv_indptr, batch.kv_indices,
                              q_len=q_len, num_splits=splits, scale=d**-0.5)
        assert rel_err(out, ref) < TOL, f"{splits} splits: {rel_err(out, ref):.2e}"


def test_pick_small_linear_tunes_times_both_and_keeps_the_faster(model_dir: str) -> None:
    # (Imported here: importing Triton kernels at collection would compile them for the
    # GPU before tests/triton_interp.py can select the interpreter on a CPU host.)
    from spec_runtime.kernels import small_linear as triton_linear
    from spec_runtime.kernels.tuning import pick_small_linear

    gpu = _runner(model_dir, "cuda", graphs=False)  # KernelConfig's default: small_linear auto
    assert gpu.kernel_report["reason"] == "timed" and set(gpu.kernel_report["tuned"]) == {"qkv", "o", "gate_up", "down"}
    us_triton, us_cublas = pick_small_linear(gpu.model)
    assert us_triton > 0 and us_cublas > 0
    assert gpu.model.kernels.small_linear == (us_triton < us_cublas)
    # The tuning step chose the block sizes of the model's four projection shapes, each
    # one of the candidates (test_gpu_matches_cpu_graphs_and_transformers runs them).
    table = gpu.model.kernels.blocks
    for linear, kw in gpu.model.layers[0].one_token_projections():
        rows, k = linear.weight.shape
        shape = dict(norm=kw.get("norm") is not None, silu_mul=kw.get("silu_mul", False))
        assert table.is_tuned(rows, k, **shape)
        assert triton_linear.block_sizes(rows, k, **shape, table=table) in triton_linear.candidates(k, **shape)


def test_tree_graph_matches_cpu_per_branch(model_dir: str) -> None:
    """An SSD tree step replayed from a tree CUDA graph (shared-prefix mask, padded
    branches and sequences, later steps derived on the device) gives every branch the
    logits the float32 CPU runner gives it with the per-branch layout."""
    from spec_runtime.engine.forward_batch import TreeBranch, build_tree_batch, tree_step_batch

    cfg = ModelConfig(path=model_dir, device="cuda", cuda_graphs=True, gpu_memory_utilization=0.5)
    gpu = ModelRunner.build(cfg, num_slots=4, max_model_len=MAX_LEN, num_scratch_rows=32,
                            max_batch_size=4, graph_q_lens=(1,), tree_shapes=[(2, 4), (4, 4)], tree_local_rows=8)
    cpu = ModelRunner(ModelConfig(path=model_dir), num_slots=4, max_model_len=MAX_LEN, num_scratch_rows=32)
    assert (2, 4, True) in gpu.graphs.graphs
    lens, drafts = (40, 75, 9), 2
    for r in (gpu, cpu):
        for slot, n in enumerate(lens):
            toks = [int(t) for t in np.random.default_rng(slot).integers(3, r.vocab_size, n + drafts)]
            r.run([ForwardItem(toks, 0, r.layout.slot_rows(slot, n + drafts), "none")])
    forks = [(0, 0, 11), (0, 2, 12), (1, 1, 13), (1, 0, 14), (1, 2, 15), (2, 0, 16)]
    steps = 3  # also each branch's scratch rows

    def scratch_of(r, b):
        return np.arange(r.layout.scratch_base + b * steps, r.layout.scratch_base + (b + 1) * steps, dtype=np.int64)

    ref, prev = [], None
    for i in range(steps):
        items = []
        for b, (slot, j, t) in enumerate(forks):
            n = lens[slot]
            rows = np.concatenate([cpu.layout.slot_rows(slot, n + j), scratch_of(cpu, b)[: i + 1]])
            items.append(ForwardItem([t if prev is None else int(prev[b])], n + j + i, rows, "last"))
        logits = cpu.run(items)
        ref.append(logits)
        prev = logits.argmax(-1)
    prefixes = [gpu.layout.slot_rows(s, lens[s]) for s in range(3)]  # 3 sequences: one padding request
    branches, select = [[], [], []], []
    for b, (slot, j, t) in enumerate(forks):
        n, base = lens[slot], slot * MAX_LEN
        local = np.concatenate([np.arange(base + n, base + n + j), scratch_of(gpu, b)])
        branches[slot].append(TreeBranch(t, n + j, local, j + 1))
        select.append(slot * 4 + len(branches[slot]) - 1)
    first = build_tree_batch(prefixes, branches, 4, gpu.dummy_row, gpu.device)
    sel = torch.tensor(select, device=gpu.device)
    assert gpu.graphs.graph_for(first) is gpu.graphs.graphs[(4, 4, True)]
    prev = None
    for i in range(steps):
        batch = first if i == 0 else tree_step_batch(first, i, prev)
        logits = gpu.forward(batch)[sel]
        assert rel_err(logits, ref[i]) < TOL, i
        prev = torch.zeros(12, dtype=torch.int64, device=gpu.device)
        prev[sel] = ref[i].argmax(-1).to(gpu.device)  # follow the CPU's tokens so the rows stay comparable


_TP_RANK = r"""
import sys, torch
sys.path[:0] = [{root!r}, {tests!r}]
from spec_runtime.config import ModelConfig
from spec_runtime.engine.parallel import TPGroup
from spec_runtime.engine.runner import ModelRunner
from test_gpu import MAX_LEN, SCRATCH, VERIFY_Q, scenario
rank = {rank}
group = TPGroup(2, rank, "cuda:0", {port}, backend="gloo")
cfg = ModelConfig(path={path!r}, device="cuda:0", cuda_graphs=False, gpu_memory_utilization=0.3)
runner = ModelRunner.build(cfg, num_slots=4, max_model_len=MAX_LEN, num_scratch_rows=SCRATCH, max_batch_size=4,
                           graph_q_lens=(1, VERIFY_Q), tp=group)
if rank == 0:
    out, _ = scenario(runner, runner.vocab_size)
    torch.save([o.cpu() for o in out], {out!r})
    group.stop()
else:
    runner.follow()
"""


def test_two_tensor_parallel_ranks_on_one_gpu_match_one(model_dir: str, tmp_path) -> None:
    """TP=2 on one GPU (gloo: NCCL wants a GPU per rank) through the CUDA kernels at
    the split shapes (half the heads and KV heads per rank), eager, against TP=1."""
    import os
    import subprocess
    import sys

    from spec_runtime.engine.parallel import free_port
    from spec_runtime.models.hf_config import load_arch

    arch = load_arch(model_dir)
    if arch.num_kv_heads % 2:
        pytest.skip("one KV head does not split over two ranks")
    one = _runner(model_dir, "cuda", graphs=False)
    want, _ = scenario(one, one.vocab_size)
    del one
    torch.cuda.empty_cache()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port, out = free_port(), str(tmp_path / "tp2.pt")
    procs = [subprocess.Popen([sys.executable, "-c", _TP_RANK.format(
        root=root, tests=os.path.join(root, "tests"), rank=r, port=port, path=model_dir, out=out)],
        stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-2000:] for e in errs)
    got = torch.load(out)
    assert len(got) == len(want)
    worst = max(rel_err(g, w) for g, w in zip(got, want))
    print(f"TP=2 against TP=1 on one GPU: worst relative error {worst:.1e}")
    assert worst < TOL


def test_draft_race_kernel_matches_the_torch_race_on_the_gpu() -> None:
    """spec_runtime.kernels.race.draft_race against the torch race, on CUDA tensors (the
    interpreter's float64 log is NumPy's; here both sides use the device's)."""
    from spec_runtime.kernels.race import draft_race
    from spec_runtime.sampling import STREAM_DRAFT, draft_race_torch, stream_key

    g = torch.Generator(device="cuda").manual_seed(0)
    r, m = 4096, 64
    seeds = torch.randint(-(2**62), 2**62, (r,), device="cuda", generator=g)
    positions = torch.randint(0, 2**31, (r,), device="cuda", generator=g)
    ids = torch.randint(0, 150_000, (r, m), device="cuda", generator=g)
    probs = torch.softmax(torch.randn(r, m, device="cuda", generator=g), -1)
    torch.testing.assert_close(draft_race(seeds, positions, stream_key(STREAM_DRAFT), ids, probs),
                               draft_race_torch(seeds, positions, STREAM_DRAFT, ids, probs), rtol=0, atol=0)


def test_dense_race_and_uniforms_kernels_match_the_torch_ops_on_the_gpu() -> None:
    """The target's race over the whole vocabulary (sampling.sample) and the accept test's
    uniforms (sampling.uniform) in one kernel each, against the same functions in torch ops
    on CUDA tensors: the same bits, ties to the lowest token id."""
    from spec_runtime.sampling import STREAM_ACCEPT, STREAM_TARGET, sample, sample_torch, uniform, uniform_torch

    g = torch.Generator(device="cuda").manual_seed(0)
    b, vocab = 48, 151_936
    seeds = torch.randint(-(2**62), 2**62, (b,), device="cuda", generator=g)
    positions = torch.randint(0, 2**31, (b,), device="cuda", generator=g)
    probs = torch.softmax(3 * torch.randn(b, vocab, device="cuda", generator=g), -1)
    probs[:4, 1000:] = 0.0  # rows with few candidates and exact zeros
    probs[4:8] = 1.0  # equal weights: the race alone decides
    got = sample(probs, seeds, positions, STREAM_TARGET)
    torch.testing.assert_close(got, sample_torch(probs, seeds, positions, STREAM_TARGET), rtol=0, atol=0)
    assert bool((got[:4] < 1000).all())
    k = 9
    seeds_k, positions_k = seeds.unsqueeze(-1).expand(b, k), positions.unsqueeze(-1) + torch.arange(k, device="cuda")
    zero = torch.zeros(1, dtype=torch.int64, device="cuda")
    torch.testing.assert_close(uniform(seeds_k, positions_k, STREAM_ACCEPT, zero),
                               uniform_torch(seeds_k, positions_k, STREAM_ACCEPT, zero), rtol=0, atol=0)
    index = torch.randint(0, vocab, (b, 33), device="cuda", generator=g)
    torch.testing.assert_close(uniform(seeds, positions, STREAM_TARGET, index),
                               uniform_torch(seeds, positions, STREAM_TARGET, index), rtol=0, atol=0)


def test_sampling_kernels_compile_at_start_up_and_never_while_serving() -> None:
    """After sampling.warm_up_kernels (the processes' start-up), a verify's rejection
    sampling with drafts at temperature > 0, a plain step's sample and a draft's sampled
    token, at several batch sizes, compile no sampling kernel."""
    from spec_runtime.kernels import race
    from spec_runtime.rejection import rejection_sample
    from spec_runtime.sampling import SamplingTensors, draft_sample, warm_up_kernels

    kernels = (race._dense_race_kernel, race._uniform_kernel, race._draft_race_kernel)
    if any(getattr(k, "device_caches", None) is None for k in kernels):
        pytest.skip("this Triton version keeps no per-device kernel cache to count")
    vocab, top_k = 49_152, 64
    assert warm_up_kernels(torch.device("cuda"), vocab, top_k) > 0
    compiled = [sum(len(c[0]) for c in k.device_caches.values()) for k in kernels]
    assert all(n >= 1 for n in compiled)
    for b in (1, 3, 4, 7):
        st = SamplingTensors.from_params([(0.7, 0, 1.0, 100 + i) for i in range(b)], device="cuda")
        positions = torch.arange(b, device="cuda") + 300
        for k in (1, 4):
            drafts = torch.randint(0, vocab, (b, k), device="cuda")
            q_ids = torch.randint(0, vocab, (b, k, top_k), device="cuda")
            q_probs = torch.softmax(torch.randn(b, k, top_k, device="cuda"), -1)
            rejection_sample(torch.randn(b, k + 1, vocab, device="cuda"), drafts,
                             torch.full((b,), k, device="cuda"), q_ids, q_probs, st, positions)
        rejection_sample(torch.randn(b, 1, vocab, device="cuda"), torch.zeros(b, 0, dtype=torch.int64, device="cuda"),
                         torch.zeros(b, dtype=torch.int64, device="cuda"), None, None, st, positions)
        draft_sample(torch.randn(b, vocab, device="cuda"), st, positions, top_k)
    torch.cuda.synchronize()
    assert [sum(len(c[0]) for c in k.device_caches.values()) for k in kernels] == compiled
