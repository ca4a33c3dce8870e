"""Checks on what a caller hands the Client, run in the caller's thread before anything
is queued: text must encode as UTF-8 and token ids must be int64 ints."""

from __future__ import annotations

import numpy as np


def check_text(value: str, what: str) -> None:
    """ValueError unless `value` encodes as UTF-8 (a lone surrogate does not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid UTF-8 text ({e.reason} at index {e.start})") from None


def as_token_ids(prompt) -> list[int]:
    """A list of ints from token ids; ValueError for anything else (bools, floats, strings)."""
    ids = []
    for t in prompt:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"token ids must be ints, got {type(t).__name__}")
        t = int(t)
        if not -(2**63) <= t < 2**63:
            raise ValueError(f"token id {t} does not fit in int64")
        ids.append(t)
    return ids
