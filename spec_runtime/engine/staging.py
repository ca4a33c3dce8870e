"""Small host arrays to the GPU in one copy, through pinned buffers used in turn.

A forward's metadata (token ids, positions, KV rows, page tables) goes to the device as
one int64 buffer: one copy instead of one per array. The copy leaves from pinned memory,
so it does not wait for the GPU to drain; pinning a fresh tensor each time costs an
allocation and a copy on the host, so the arrays are written straight into one of a few
pinned buffers, each reused once the copy that last read it has run (a CUDA event; with
the GPU more than `SLOTS` copies behind, the host waits for it there). A buffer grows to
the largest upload it has carried (8 bytes a value: a prefill of 32 sequences of 8K
tokens lists 256K KV rows, 2 MiB) and is kept for the thread's life.
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np
import torch

SLOTS = 16


class _Ring:
    """Pinned int64 buffers of one device, used in turn, each with the event of its last copy."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bufs: list[torch.Tensor | None] = [None] * SLOTS
        self.events: list[torch.cuda.Event | None] = [None] * SLOTS
        self.next = 0

    def copy(self, parts: Sequence[np.ndarray], total: int) -> torch.Tensor:
        i = self.next
        self.next = (i + 1) % SLOTS
        if self.events[i] is not None:
            self.events[i].synchronize()  # the copy that last read this buffer has run
        buf = self.bufs[i]
        if buf is None or buf.shape[0] < total:
            buf = self.bufs[i] = torch.empty(max(total, 1024), dtype=torch.int64, pin_memory=True)
        np.concatenate(parts, out=buf.numpy()[:total], casting="same_kind")
        out = buf[:total].to(self.device, non_blocking=True)
        event = self.events[i] = self.events[i] or torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return out


_local = threading.local()


def _ring(device: torch.device) -> _Ring:
    rings = getattr(_local, "rings", None)
    if rings is None:
        rings = _local.rings = {}
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    if key not in rings:
        rings[key] = _Ring(torch.device("cuda", key[1]))
    return rings[key]


def upload_int64(parts: Sequence[np.ndarray], device: torch.device | str, int32_tail: int = 0,
                 packed: int = 0) -> list[torch.Tensor]:
    """The arrays on `device` in one host-to-device copy: views of one buffer, in order,
    int64, except the last `int32_tail` arrays, which come back int32 (one conversion on
    the device for all of them). Each starts on a 16-byte boundary, as a tensor of its own
    does: Triton compiles a kernel per pointer alignment, so a view at another offset
    would meet a variant not compiled at start-up. The first `packed` arrays are laid
    back to back instead (a caller that copies them on in one piece), the first of them
    aligned. Every array must be an integer (or bool) array."""
    device = torch.device(device)
    if not parts:
        return []
    split = len(parts) - int32_tail
    flat = [np.asarray(a).ravel() for a in parts]
    sizes = [len(a) for a in flat]
    pieces, starts, at = [], [], 0
    for i, a in enumerate(flat):
        if i == split:
            tail_start, pad = at, 0  # the int32 arrays are a tensor of their own from here
        elif i > split:
            pad = -(at - tail_start) % 4  # 16 bytes: 4 int32 values
        else:
            pad = at % 2 if i >= packed else 0  # 16 bytes: 2 int64 values
        if pad:
            pieces.append(np.zeros(pad, dtype=np.int64))
            at += pad
        starts.append(at)
        pieces.append(a)
        at += len(a)
    if device.type == "cuda":
        buf = _ring(device).copy(pieces, at)
    else:
        buf = torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.int64) for a in pieces])).to(device)
    tail = buf[tail_start:].to(torch.int32) if int32_tail else None
    return [buf[s : s + n] if i < split else tail[s - tail_start : s - tail_start + n]
            for i, (s, n) in enumerate(zip(starts, sizes))]
