"""The GGUF conversion cache: keyed by the file, under XDG_CACHE_HOME, read instead of
the GGUF file once written, with bit-identical weights."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import save_tiny_model, tiny_tokenizer
from spec_runtime.models import gguf_cache
from spec_runtime.models.loader import load_model, load_tokenizer


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


def test_cache_root_follows_xdg(cache_home, monkeypatch):
    assert gguf_cache.cache_root() == os.path.join(str(cache_home), "spec-runtime", "gguf")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert gguf_cache.cache_root() == os.path.join(os.path.expanduser("~"), ".cache", "spec-runtime", "gguf")


def test_key_changes_with_content_size_and_mtime(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(bytes(3 << 20))
    k0 = gguf_cache.file_key(str(f))
    assert gguf_cache.file_key(str(f)) == k0
    data = bytearray(3 << 20)
    data[-5] = 1  # the last MiB is hashed
    f.write_bytes(bytes(data))
    os.utime(f, ns=(os.stat(f).st_atime_ns, os.stat(f).st_mtime_ns))
    k1 = gguf_cache.file_key(str(f))
    assert k1 != k0
    os.utime(f, ns=(0, 12345))
    assert gguf_cache.file_key(str(f)) != k1
    f.write_bytes(bytes(data) + b"x")
    assert gguf_cache.file_key(str(f)) not in (k0, k1)


def test_a_cached_file_loads_from_the_cache(tmp_path, cache_home):
    """A stored conversion is what loading the .gguf path returns (the file itself is
    never parsed: here it is not even a valid GGUF file)."""
    src = save_tiny_model(tmp_path / "tiny", "llama")
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    fake = tmp_path / "tiny.gguf"
    fake.write_bytes(os.urandom(4096))
    assert gguf_cache.lookup(str(fake)) is None
    stored = gguf_cache.store(str(fake), AutoConfig.from_pretrained(src), hf.state_dict(), tiny_tokenizer())
    assert stored is not None and stored.startswith(str(cache_home))
    assert gguf_cache.lookup(str(fake)) == stored
    model, arch, tok = load_model(str(fake))
    ref, _, _ = load_model(src)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    assert tok.chat_template == tiny_tokenizer().chat_template
    assert load_tokenizer(str(fake)).encode("Hello, world!") == tiny_tokenizer().encode("Hello, world!")
    # gguf_cache=False reads the file itself (which is not a GGUF file here).
    with pytest.raises(Exception):
        load_model(str(fake), use_cache=False)


def test_an_unwritable_cache_is_skipped_with_a_warning(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"x" * 100)
    src = save_tiny_model(tmp_path / "tiny", "llama")
    from transformers import AutoConfig

    assert gguf_cache.store(str(fake), AutoConfig.from_pretrained(src), {}, None) is None
    assert "could not cache" in caplog.text


@pytest.mark.slow
def test_smollm2_conversion_is_cached_and_identical(smollm2_gguf_path, cache_home):
    first, arch1, tok1 = load_model(smollm2_gguf_path)  # de-quantizes and writes the cache
    cached = gguf_cache.lookup(smollm2_gguf_path)
    assert cached is not None and cached.startswith(str(cache_home))
    second, arch2, tok2 = load_model(smollm2_gguf_path)  # reads the cache
    assert arch1 == arch2
    for (n1, p1), (n2, p2) in zip(first.state_dict().items(), second.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    text = "What is the capital of France?"
    assert tok1.encode(text) == tok2.encode(text) and tok1.chat_template == tok2.chat_template
