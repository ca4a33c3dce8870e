"""The model-execution layer against transformers' own implementation, on CPU.

Each tiny random checkpoint is loaded twice from the same directory: by our
ModelRunner and by transformers' AutoModelForCausalLM (float32). Our logits for
prefill, decode, verify chunks, ragged batches, rollback and branch rows must
equal transformers' full-sequence logits at the same positions.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import save_tiny_model, tiny_tokenizer
from transformers import AutoModelForCausalLM

from spec_runtime.config import ModelConfig
from spec_runtime.engine.cuda_graphs import pad_to_graph
from spec_runtime.engine.forward_batch import ForwardItem, build_forward_batch
from spec_runtime.engine.kv_cache import KVCache, kv_bytes_per_token
from spec_runtime.engine.runner import ModelRunner
from spec_runtime.models.hf_config import arch_from_config
from spec_runtime.models.loader import default_model_path, load_model

ATOL = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
VARIANTS = {
    "llama": ("llama", {}),
    "llama3-rope-tied": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0, "tie_word_embeddings": True}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qknorm": ("qwen3", {}),
}


class Pair:
    """Our runner and transformers' model on one saved checkpoint."""

    def __init__(self, path: str, num_scratch_rows: int = 0) -> None:
        self.runner = ModelRunner(ModelConfig(path=path), num_slots=4, max_model_len=64,
                                  num_scratch_rows=num_scratch_rows)
        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def ref(self, tokens) -> torch.Tensor:
        """transformers' logits [len(tokens), V] for one sequence from position 0."""
        with torch.no_grad():
            return self.hf(torch.tensor([list(tokens)])).logits[0].float()

    def rows(self, slot: int, n: int) -> np.ndarray:
        return self.runner.layout.slot_rows(slot, n)


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory) -> Pair:
    model_type, overrides = VARIANTS[request.param]
    path = save_tiny_model(tmp_path_factory.mktemp(request.param), model_type, **overrides)
    return Pair(path, num_scratch_rows=16)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


def test_full_prefill(pair: Pair) -> None:
    toks = _tokens(23, seed=1)
    ours = pair.runner.run([ForwardItem(toks, 0, pair.rows(0, 23), logits="all")])
    ref = pair.ref(toks)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    # The comparison can fail: logits are O(1) and differ between positions.
    assert (ref[1:] - ref[:-1]).abs().max() > 0.1


def test_prefix_then_decode_steps(pair: Pair) -> None:
    toks = _tokens(18, seed=2)
    ref = pair.ref(toks)
    prefix = 10
    last = pair.runner.run([ForwardItem(toks[:prefix], 0, pair.rows(1, prefix))])
    torch.testing.assert_close(last[0], ref[prefix - 1], atol=ATOL, rtol=0)
    for p in range(prefix, len(toks)):
        out = pair.runner.run([ForwardItem([toks[p]], p, pair.rows(1, p + 1))])
        torch.testing.assert_close(out[0], ref[p], atol=ATOL, rtol=0)


def test_verify_chunk_after_prefix(pair: Pair) -> None:
    toks = _tokens(16, seed=3)
    ref = pair.ref(toks)
    pair.runner.run([ForwardItem(toks[:12], 0, pair.rows(2, 12), logits="none")])
    out = pair.runner.run([ForwardItem(toks[12:16], 12, pair.rows(2, 16), logits="all")])
    torch.testing.assert_close(out, ref[12:16], atol=ATOL, rtol=0)


def test_ragged_batch_equals_requests_alone(pair: Pair) -> None:
    a, b, c = _tokens(9, seed=4), _tokens(14, seed=5), _tokens(7, seed=6)
    # Prefixes of b and c first (slots 1, 2), then one forward: a prefill, b decode, c verify.
    pair.runner.run([ForwardItem(b[:13], 0, pair.rows(1, 13), "none"),
                     ForwardItem(c[:3], 0, pair.rows(2, 3), "none")])
    items = [ForwardItem(a, 0, pair.rows(0, 9), "all"),
             ForwardItem(b[13:], 13, pair.rows(1, 14), "last"),
             ForwardItem(c[3:], 3, pair.rows(2, 7), "all")]
    batched = pair.runner.run(items)  # [9 + 1 + 4, V]
    alone = torch.cat([pair.runner.run([it]) for it in items])
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)
    ref = torch.cat([pair.ref(a), pair.ref(b)[13:], pair.ref(c)[3:]])
    torch.testing.assert_close(batched, ref, atol=ATOL, rtol=0)


def test_graph_padding_keeps_the_real_rows(pair: Pair) -> None:
    """Verify items of their real lengths, padded by the runner to a graph's q_len
    (cuda_graphs.pad_to_graph): the logits are those of the real tokens only, equal to
    the unpadded forward's, and the padding writes the dummy row, no sequence's rows."""
    runner = pair.runner
    seqs = [_tokens(n, seed=20 + n) for n in (11, 9, 6)]
    runner.run([ForwardItem(s[:-3], 0, pair.rows(i, len(s) - 3), "none") for i, s in enumerate(seqs)])
    fed = (1, 3, 2)  # [x_n] and m = 0, 2, 1 drafts
    items = [ForwardItem(s[len(s) - 3 : len(s) - 3 + f], len(s) - 3, pair.rows(i, len(s) - 3 + f), "all")
             for i, (s, f) in enumerate(zip(seqs, fed))]
    unpadded = runner.run(items)  # [6, V]
    padded = pad_to_graph(items, q_lens=(1, 5), max_requests=4, dummy_row=runner.dummy_row, max_kv_len=64)
    assert [len(it.token_ids) for it in padded] == [5, 5, 5] and [it.num_pad for it in padded] == [4, 2, 3]
    before = [runner.kv_cache.k_cache[0][pair.rows(i, 64)].clone() for i in range(3)]
    out = runner.forward(build_forward_batch(padded, runner.device))
    torch.testing.assert_close(out, unpadded, atol=1e-5, rtol=0)
    ref = torch.cat([pair.ref(s)[len(s) - 3 : len(s) - 3 + f] for s, f in zip(seqs, fed)])
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    for i, (s, f) in enumerate(zip(seqs, fed)):  # the slots hold what the unpadded verify wrote, nothing more
        after, n = runner.kv_cache.k_cache[0][pair.rows(i, 64)], len(s) - 3 + f
        torch.testing.assert_close(after[n:], before[i][n:], atol=0, rtol=0)  # no padding row landed here
        torch.testing.assert_close(after[:n], before[i][:n], atol=1e-5, rtol=0)  # recomputed: float32 noise
    # Left as they are: a batch that fits no q_len, one that is not all-logits, one too
    # near the context limit.
    assert pad_to_graph(items, (1, 2), 4, runner.dummy_row, 64) is items
    assert pad_to_graph(items[:1] + [ForwardItem([1], 3, pair.rows(3, 4), "last")], (1, 5), 4,
                        runner.dummy_row, 64)[1].num_pad == 0
    assert pad_to_graph(items, (1, 5), 4, runner.dummy_row, 12) is items


def test_rollback_by_shorter_kv_rows(pair: Pair) -> None:
    prefix, spec, fresh = _tokens(8, seed=7), _tokens(4, seed=8), _tokens(2, seed=9)
    pair.runner.run([ForwardItem(prefix, 0, pair.rows(3, 8), "none")])
    pair.runner.run([ForwardItem(spec, 8, pair.rows(3, 12), "all")])  # verify writes rows 8..11
    # Accept one speculative token: the length moves back to 9; rows 9.. are overwritten.
    out = pair.runner.run([ForwardItem(fresh, 9, pair.rows(3, 11), "all")])
    ref = pair.ref(prefix + spec[:1] + fresh)
    torch.testing.assert_close(out, ref[9:11], atol=ATOL, rtol=0)


def test_branch_rows_in_scratch(pair: Pair) -> None:
    """SSD tree decode: branches = prefix rows up to the fork + their own scratch rows."""
    runner = pair.runner
    base = runner.layout.scratch_base
    prefix = _tokens(10, seed=10)
    runner.run([ForwardItem(prefix, 0, pair.rows(0, 10), "none")])
    # Two branches decoded together one token per step: one forks after 10 tokens,
    # the other after 6 (it ignores the slot's rows 6..9).
    forks = {0: (10, _tokens(3, seed=11), base + 0), 1: (6, _tokens(3, seed=12), base + 8)}
    for step in range(3):
        items = []
        for fork, toks, scratch in forks.values():
            rows = np.concatenate([pair.rows(0, fork), np.arange(scratch, scratch + step + 1)])
            items.append(ForwardItem([toks[step]], fork + step, rows))
        out = runner.run(items)
        for b, (fork, toks, _) in enumerate(forks.values()):
            ref = pair.ref(prefix[:fork] + toks[: step + 1])
            torch.testing.assert_close(out[b], ref[-1], atol=ATOL, rtol=0)


def test_sharded_safetensors(tmp_path) -> None:
    src = save_tiny_model(tmp_path / "single", "llama")
    path = str(tmp_path / "sharded")
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(path, max_shard_size="60KB")
    tiny_tokenizer().save_pretrained(path)
    assert not os.path.exists(os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 2
    pair = Pair(path)
    toks = _tokens(12, seed=13)
    out = pair.runner.run([ForwardItem(toks, 0, pair.rows(0, 12), "all")])
    torch.testing.assert_close(out, pair.ref(toks), atol=ATOL, rtol=0)


def test_bad_paths_raise_clear_errors(tmp_path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path / "empty"))
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="w.bin"):
        load_model(str(tmp_path / "w.bin"))
    path = save_tiny_model(tmp_path / "noweights", "llama")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(path)
    path = save_tiny_model(tmp_path / "notokenizer", "llama")
    for f in os.listdir(path):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            os.remove(os.path.join(path, f))
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_model(path)


def test_config_parsing_and_rejections() -> None:
    base = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=128, vocab_size=100, eos_token_id=[2, 7])
    old_style = arch_from_config({**base, "rope_theta": 5e5, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert old_style.rope_theta == 5e5 and old_style.rope_scaling.factor == 8.0
    assert old_style.head_dim == 16 and old_style.eos_token_ids == (2, 7)
    assert arch_from_config({**base, "model_type": "qwen2"}).attention_bias
    assert not arch_from_config({**base, "model_type": "qwen2"}).o_proj_bias
    assert arch_from_config({**base, "model_type": "qwen3"}).qk_norm
    with pytest.raises(ValueError, match="gemma.*llama, qwen2, qwen3, mistral"):
        arch_from_config({**base, "model_type": "gemma"})
    assert arch_from_config({**base, "model_type": "mistral", "sliding_window": 8}).sliding_window == 8
    assert arch_from_config({**base, "model_type": "qwen2", "sliding_window": 8}).sliding_window is None
    with pytest.raises(ValueError, match="yarn"):
        arch_from_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="sliding"):
        arch_from_config({**base, "model_type": "qwen2", "use_sliding_window": True})


def test_kv_cache_layout(tiny_llama_dir) -> None:
    runner = ModelRunner(ModelConfig(path=tiny_llama_dir), num_slots=2, max_model_len=10_000,
                         num_scratch_rows=5)
    arch = runner.arch
    assert runner.layout.max_model_len == arch.max_position_embeddings == 512  # capped
    kv = runner.kv_cache
    # Slots, scratch rows, and the dummy row padded requests and branches write to.
    assert kv.k_cache[1].shape == (2 * 512 + 5 + 1, arch.num_kv_heads, arch.head_dim)
    assert runner.dummy_row == 2 * 512 + 5
    assert kv.k_cache[0].is_contiguous() and kv.v_cache[1].is_contiguous()
    assert kv_bytes_per_token(arch, torch.bfloat16) == 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
    assert runner.eos_token_ids == [2] and runner.vocab_size == 384
    # A forward writes exactly the rows it is given.
    runner.run([ForwardItem([5, 6, 7], 0, np.array([3, 1028, 9]))])
    written = kv.k_cache[0].abs().sum(dim=(1, 2)).nonzero().flatten().tolist()
    assert written == [3, 9, 1028]
    with pytest.raises(ValueError, match="max_model_len"):
        runner.run([ForwardItem(list(range(3)), 511, np.arange(514))])
    with pytest.raises(ValueError):
        KVCache(0, 4, 2, 8, torch.float32, "cpu")
    batch = build_forward_batch([ForwardItem([1], 0, np.array([0]))], "cpu")
    with pytest.raises(ValueError, match="begin"):
        runner.backend.forward(0, torch.zeros(1, 4, 16), torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), kv, batch)


def test_bfloat16_runs_close_to_float32(tiny_qwen3_dir) -> None:
    toks = _tokens(12, seed=14)
    outs = {}
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner(ModelConfig(path=tiny_qwen3_dir, dtype=dtype), num_slots=1, max_model_len=32)
        assert runner.dtype == getattr(torch, dtype) and runner.kv_cache.dtype == runner.dtype
        outs[dtype] = runner.run([ForwardItem(toks, 0, runner.layout.slot_rows(0, 12), "all")])
    assert outs["bfloat16"].dtype == torch.float32
    torch.testing.assert_close(outs["bfloat16"], outs["float32"], atol=0.15, rtol=0.05)


@pytest.mark.slow
def test_smollm2_gguf_greedy_matches_transformers(smollm2_gguf_path, smollm2_hf) -> None:
    assert default_model_path() == smollm2_gguf_path
    runner = ModelRunner(ModelConfig(path=smollm2_gguf_path), num_slots=1, max_model_len=256)
    assert runner.arch.model_type == "llama" and runner.model_name == "SmolLM2-135M-Instruct.Q4_1"
    tok = runner.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end in runner.eos_token_ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    ids = tok(prompt)["input_ids"]

    ours: list[int] = []
    logits = runner.run([ForwardItem(ids, 0, runner.layout.slot_rows(0, len(ids)))])
    while len(ours) < 24:
        ours.append(int(logits[0].argmax()))
        if ours[-1] in runner.eos_token_ids:
            break
        pos = len(ids) + len(ours) - 1
        logits = runner.run([ForwardItem([ours[-1]], pos, runner.layout.slot_rows(0, pos + 1))])

    with torch.no_grad():
        gen = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                  eos_token_id=runner.eos_token_ids, pad_token_id=im_end)
    theirs = gen[0, len(ids):].tolist()
    assert ours == theirs
    text = tok.decode(ours, skip_special_tokens=True)
    assert "Paris" in text, text
    assert sum(ch.isalpha() or ch in " .,'" for ch in text) > 0.9 * len(text), text
