"""Do the draft and the target speak the same token ids? Checked once both are loaded.

A draft proposes token ids that the target verifies, so both must read an id as the same
text. The tokenizers are compared by a fingerprint of their vocabulary (token -> id and
the special ids). The embedding sizes (Ready.vocab_size) may still differ when the
tokenizers agree: checkpoints of one family pad their embeddings differently (for
example Qwen2.5-0.5B has 151,936 rows and Qwen2.5-7B 152,064). A draft id the target
has no row for is then rejected by the verifier (target_proc.draft_link), never looked up.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging

from protocol.messages import Ready
from spec_runtime.config import RuntimeConfig

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def tokenizer_fingerprint(path: str) -> str | None:
    """sha256 of the tokenizer's vocabulary and special ids, or None if it has no tokenizer."""
    from spec_runtime.models.loader import load_tokenizer

    try:
        tok = load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - random-weight benchmark models have no tokenizer
        logger.info("no tokenizer for %r (%s); comparing vocabulary sizes only", path or "the default model", e)
        return None
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    blob = json.dumps([vocab, sorted(tok.all_special_ids)], ensure_ascii=False).encode("utf-8", "surrogatepass")
    return hashlib.sha256(blob).hexdigest()


def vocabulary_mismatch(cfg: RuntimeConfig, target: Ready, draft: Ready) -> str | None:
    """Why this draft cannot serve this target, or None when they agree."""
    if cfg.draft_name == "ngram":
        return None  # it proposes ids from the sequence itself
    t_fp, d_fp = tokenizer_fingerprint(cfg.target.path), tokenizer_fingerprint(cfg.draft_path)
    names = f"draft {cfg.draft_path!r} ({draft.vocab_size} token ids), target {cfg.target.path or 'default'!r} " \
            f"({target.vocab_size} token ids)"
    if t_fp is not None and d_fp is not None and t_fp != d_fp:
        return f"the draft and the target have different tokenizers: {names}. Use a draft of the target's model family."
    if draft.vocab_size != target.vocab_size:
        if t_fp is None or d_fp is None:
            return f"the draft and the target have different vocabulary sizes and no tokenizers to compare: {names}"
        logger.info("%s: one tokenizer, differently padded embeddings; draft ids >= %d are rejected by the target",
                    names, target.vocab_size)
    return None
