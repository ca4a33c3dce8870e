"""A draft directory as one GGUF file (spec_runtime.distill.export), and the default draft.

- The exported file loads through the runtime's loader: F32 export gives the directory's
  logits, Q8_0 and Q5_1 within their quantization error; the tokenizer reads token ids
  as the directory's does; greedy SD and SSD with the file as the draft equal AR.
- With a GGUF target (the SmolLM2 file), the tokenizer keys are the target's, copied.
- Without --draft, the embedded target gets the shipped draft; --draft wins; ngram stays
  selectable; another target gets the n-gram speculator.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import save_tiny_model
from protocol.messages import SamplingParams
from spec_runtime import cli
from spec_runtime import config as config_mod
from spec_runtime.config import ModelConfig, RuntimeConfig, SpeculativeConfig
from spec_runtime.distill.export import export_gguf
from spec_runtime.engine.forward_batch import ForwardItem
from spec_runtime.engine.runner import ModelRunner
from spec_runtime.vocab_check import tokenizer_fingerprint


def _logits(path: str, tokens: list[int]) -> torch.Tensor:
    runner = ModelRunner(ModelConfig(path=path, gguf_cache=False), num_slots=1, max_model_len=64)
    return runner.run([ForwardItem(tokens, 0, runner.layout.slot_rows(0, len(tokens)), logits="all")])


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("export") / "draft", "llama", tie_word_embeddings=True)


def _round_trip(src: str, dst, qtype) -> tuple[str, dict[str, float]]:
    """A copy of `src` whose matrices went through `qtype` and back (gguf.quants), and each
    matrix's relative error: the model the GGUF file should hold."""
    import shutil

    import gguf
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(os.path.join(dst, "model.safetensors"))
    errors = {}
    for name, w in weights.items():
        if w.ndim == 2:
            q = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype)
            weights[name] = torch.from_numpy(q.copy()).reshape(w.shape)
            errors[name] = ((weights[name] - w).norm() / w.norm()).item()
    save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst), errors


@pytest.mark.parametrize("gguf_type,max_weight_error", [("f32", 0.0), ("q8_0", 0.01), ("q5_1", 0.06)])
def test_exported_logits_match_the_directory(tiny_draft, tmp_path, gguf_type, max_weight_error):
    import gguf

    out = str(tmp_path / f"draft-{gguf_type}.gguf")
    result = export_gguf(tiny_draft, out, gguf_type)
    qtype = getattr(gguf.GGMLQuantizationType, gguf_type.upper())
    # 2 layers x 7 matrices + the tied embedding; 2 x 2 layer norms + the final norm.
    assert result.tensor_types == ({"F32": 20} if gguf_type == "f32" else {qtype.name: 15, "F32": 5})
    tokens = torch.randint(3, 384, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = _logits(tiny_draft, tokens)
    # The file holds the directory's model with its matrices quantized, and nothing else:
    # its logits are those of the quantized-and-restored weights. (A random model this
    # small amplifies any weight error, so the raw logits are compared only for F32.)
    expected = ref
    if gguf_type != "f32":
        quantized_dir, errors = _round_trip(tiny_draft, tmp_path / "round-trip", qtype)
        assert 0 < max(errors.values()) <= max_weight_error, errors
        expected = _logits(quantized_dir, tokens)
    ours = _logits(out, tokens)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    # The comparison can fail: logits differ between positions by far more than 1e-4.
    assert (ref[1:] - ref[:-1]).abs().max().item() > 0.1


def test_the_embedding_takes_its_own_type(tiny_draft, tmp_path):
    """--embedding-type q5_1 with Q8_0 layers (the shipped draft's layout): the file holds
    exactly the directory's model with those two roundings, and is smaller than all-Q8_0."""
    from gguf import GGUFReader

    out = str(tmp_path / "mixed.gguf")
    result = export_gguf(tiny_draft, out, "q8_0", embedding_type="q5_1")
    assert result.tensor_types == {"Q8_0": 14, "Q5_1": 1, "F32": 5}
    types = {t.name: t.tensor_type.name for t in GGUFReader(out).tensors}
    assert types["token_embd.weight"] == "Q5_1" and types["blk.0.attn_q.weight"] == "Q8_0"
    assert result.num_bytes < export_gguf(tiny_draft, str(tmp_path / "q8.gguf")).num_bytes
    tokens = torch.randint(3, 384, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = _logits(out, tokens)
    import gguf
    from safetensors.torch import load_file, save_file

    expected_dir, _ = _round_trip(tiny_draft, tmp_path / "round-trip", gguf.GGMLQuantizationType.Q8_0)
    weights = load_file(os.path.join(expected_dir, "model.safetensors"))
    raw = load_file(os.path.join(tiny_draft, "model.safetensors"))
    emb = "model.embed_tokens.weight"
    q = gguf.GGMLQuantizationType.Q5_1
    weights[emb] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(raw[emb].numpy(), q), q).copy())
    save_file(weights, os.path.join(expected_dir, "model.safetensors"), metadata={"format": "pt"})
    torch.testing.assert_close(ours, _logits(expected_dir, tokens), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="gguf type"):
        export_gguf(tiny_draft, str(tmp_path / "x.gguf"), embedding_type="q4_k")


def test_exported_tokenizer_reads_ids_as_the_directory(tiny_draft, tmp_path):
    from spec_runtime.models.loader import load_tokenizer

    out = str(tmp_path / "draft.gguf")
    export_gguf(tiny_draft, out)
    assert tokenizer_fingerprint(out) == tokenizer_fingerprint(tiny_draft)
    text = "Hello, world! The quick brown fox."
    assert load_tokenizer(out, use_cache=False).encode(text) == load_tokenizer(tiny_draft).encode(text)


def test_untied_head_and_bad_input(tmp_path, capsys):
    untied = save_tiny_model(tmp_path / "untied", "llama", tie_word_embeddings=False)
    out = str(tmp_path / "untied.gguf")
    assert export_gguf(untied, out, "f32").tensor_types == {"F32": 21}  # output.weight too
    tokens = list(range(3, 20))
    torch.testing.assert_close(_logits(out, tokens), _logits(untied, tokens), atol=1e-4, rtol=0)

    qwen = save_tiny_model(tmp_path / "qwen", "qwen3")
    with pytest.raises(ValueError, match="llama family"):
        export_gguf(qwen, str(tmp_path / "q.gguf"))
    with pytest.raises(ValueError, match="gguf type"):
        export_gguf(untied, str(tmp_path / "x.gguf"), "q4_k")
    assert cli.main(["export-gguf", str(tmp_path / "missing"), "--out", str(tmp_path / "m.gguf")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert cli.main(["export-gguf", untied, "--out", str(tmp_path / "m.bin")]) == 2
    assert "must name a .gguf file" in capsys.readouterr().err


def test_greedy_sd_and_ssd_with_the_gguf_draft_equal_ar(tiny_pair, ar_reference, tmp_path):
    from e2e_util import make_config
    from spec_runtime.client import Client

    draft = str(tmp_path / "draft.gguf")
    assert cli.main(["export-gguf", tiny_pair.draft, "--out", draft]) == 0
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 14, 20], [30, 31, 32, 33, 34, 35, 36]]
    ar = ar_reference(tiny_pair.target, prompts, greedy.max_tokens)
    for mode in ("sd", "ssd"):
        with Client(make_config(tiny_pair.target, draft, mode=mode)) as client:
            out = client.generate_batch(prompts, greedy)
        assert [r.token_ids for r in out] == ar, mode
        assert sum(r.stats.num_accepted_tokens for r in out) > 0, mode


@pytest.mark.slow
def test_gguf_target_tokenizer_keys_are_copied(smollm2_gguf_path, tmp_path):
    import gguf

    from spec_runtime.models.loader import load_tokenizer

    draft = save_tiny_model(tmp_path / "smol-shaped", "llama", vocab_size=49152, tie_word_embeddings=True)
    load_tokenizer(smollm2_gguf_path).save_pretrained(draft)
    out = str(tmp_path / "draft.gguf")
    assert export_gguf(draft, out, tokenizer_from=smollm2_gguf_path).tokenizer_source == smollm2_gguf_path
    src, dst = gguf.GGUFReader(smollm2_gguf_path).fields, gguf.GGUFReader(out).fields
    keys = [k for k in src if k.startswith("tokenizer.")]
    assert "tokenizer.chat_template" in keys and "tokenizer.ggml.merges" in keys
    for key in keys:
        assert dst[key].contents() == src[key].contents(), key
    assert tokenizer_fingerprint(out) == tokenizer_fingerprint(smollm2_gguf_path)


# ---------------------------------------------------------------- the default draft


def test_default_draft_resolution(monkeypatch, tmp_path):
    shipped = tmp_path / "smollm2-draft.gguf"
    shipped.write_bytes(b"")
    monkeypatch.setattr(config_mod, "SHIPPED_DRAFT", str(shipped))
    assert RuntimeConfig().draft_name == str(shipped)  # embedded target, no --draft
    assert RuntimeConfig().draft_model.path == str(shipped)
    assert RuntimeConfig(spec=SpeculativeConfig(mode="ssd")).draft_name == str(shipped)
    assert RuntimeConfig(draft=ModelConfig(path="ngram")).draft_name == "ngram"
    assert RuntimeConfig(draft=ModelConfig(path="ngram")).draft_path == ""
    assert RuntimeConfig(draft=ModelConfig(path="/d")).draft_name == "/d"  # --draft wins
    assert RuntimeConfig(target=ModelConfig(path="/t")).draft_name == "ngram"  # another target
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "hi", "--draft", "ngram"])
    assert cli.config_from_args(args).draft_name == "ngram"
    assert cli.config_from_args(parser.parse_args(["generate", "hi"])).draft_name == str(shipped)

    monkeypatch.setattr(config_mod, "SHIPPED_DRAFT", str(tmp_path / "absent.gguf"))
    assert RuntimeConfig().draft_name == "ngram"  # an installation without the file
    with pytest.raises(ValueError, match="mode ssd needs a draft model"):
        RuntimeConfig(spec=SpeculativeConfig(mode="ssd"))


@pytest.mark.slow
def test_shipped_draft_serves_the_embedded_target(smollm2_gguf_path, capsys):
    """The package ships its SmolLM2 draft: small, the target's tokenizer, and the default
    of `generate` without --target and --draft, with greedy output equal to ar."""
    import json

    path = config_mod.SHIPPED_DRAFT
    assert os.path.isfile(path), f"{path} is missing: the package ships its SmolLM2 draft there"
    assert os.path.getsize(path) <= 18_000_000
    assert tokenizer_fingerprint(path) == tokenizer_fingerprint(smollm2_gguf_path)
    runs = {}
    for mode in ("ar", "sd"):
        argv = ["generate", "What is the capital of France?", "--mode", mode, "--max-tokens", "24", "--json",
                "--draft-timeout-s", "120"]
        assert cli.main(argv) == 0
        runs[mode] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["sd"]["draft"] == path
    assert runs["sd"]["token_ids"] == runs["ar"]["token_ids"]
    assert runs["sd"]["stats"]["num_draft_tokens"] > 0
