"""Incremental detokenization (target_proc.sequence.IncrementalDetokenizer): the streamed
deltas join to exactly the text of decoding all tokens at once, multi-byte characters
included, through tokenizers' DecodeStream for a fast tokenizer and through the window
decoder otherwise."""

from __future__ import annotations

import pytest

from conftest import tiny_tokenizer
from target_proc.sequence import IncrementalDetokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Café naïve façade — déjà vu. Grüße aus Köln, ¿qué tal?",
    "東京は日本の首都です。中文测试，한국어 텍스트도.",
    "Emoji: 🌍🚀✨ family 👨‍👩‍👧‍👦 flags 🇫🇷 and math ∑∫√∞ ≠ ≤.",
    "def f(x):\n    return x ** 2  # ünïcödé\n\n\ttabs\tand  double  spaces",
]


def _stream(tok, prompt_ids, ids, skip=True, window=False):
    d = IncrementalDetokenizer(tok, prompt_ids, skip)
    if window:  # the path a slow tokenizer takes
        d._backend = None
        d.ids, d.prefix_offset = list(prompt_ids[-d._CONTEXT:]), 0
        d.read_offset = len(d.ids)
    deltas = [d.add(t) for t in ids]
    return deltas, d


def _check(tok, prompt: str):
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        want = tok.decode(ids, skip_special_tokens=True)
        for window in (False, True):
            deltas, d = _stream(tok, prompt_ids, ids, window=window)
            assert "".join(deltas) == want == d.text, (window, text)
            assert not any("\ufffd" in x for x in deltas), (window, deltas)
        # Special tokens: skipped, or kept as their text.
        eos = tok.convert_tokens_to_ids(tok.eos_token)
        ids2 = ids[:3] + [eos] + ids[3:]
        for skip in (True, False):
            deltas, _ = _stream(tok, prompt_ids, ids2, skip=skip)
            assert "".join(deltas) == tok.decode(ids2, skip_special_tokens=skip), skip


def test_fast_tokenizer_streams_through_decode_stream():
    tok = tiny_tokenizer()
    assert IncrementalDetokenizer(tok, [5, 6])._backend is not None
    _check(tok, "Say something:")


@pytest.mark.slow
def test_smollm2_streamed_text_equals_full_decode(smollm2_gguf_path):
    import os

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf_path),
                                        gguf_file=os.path.basename(smollm2_gguf_path))
    assert IncrementalDetokenizer(tok, [1])._backend is not None  # a fast tokenizer: DecodeStream
    _check(tok, "<|im_start|>user\nWrite something.<|im_end|>\n<|im_start|>assistant\n")


def test_decode_stream_and_window_decoder_agree_on_random_ids():
    """Random ids include invalid UTF-8 byte sequences; both paths hold back and emit alike,
    delta by delta. A prompt whose context ends inside a character takes the window decoder
    (DecodeStream would put the context's own text into the first delta)."""
    import random

    tok = tiny_tokenizer()
    rng = random.Random(0)
    num_stream = 0
    for _ in range(300):
        prompt = [rng.randrange(3, 384) for _ in range(5)]
        ids = [rng.randrange(3, 384) for _ in range(30)]
        streamed, d = _stream(tok, prompt, ids)
        num_stream += d._backend is not None
        assert (d._backend is None) == tok.decode(prompt[-d._CONTEXT:]).endswith("\ufffd")
        assert streamed == _stream(tok, prompt, ids, window=True)[0], (prompt, ids)
    assert 0 < num_stream < 300  # both kinds of prompt occurred
    cut = tok.encode("é", add_special_tokens=False)
    assert len(cut) == 2  # é as two byte tokens: a prompt ending after the first ends inside it
    d = IncrementalDetokenizer(tok, tok.encode("Say", add_special_tokens=False) + cut[:1])
    assert d._backend is None and "Say" not in d.add(cut[1])
