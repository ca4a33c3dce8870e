"""Tensor parallelism of one model over N processes: rank 0 leads, ranks 1..N-1 follow.

Rank 0 is the process that owns the model's job (the target process). It starts the
followers (`start_followers`), each on the next device, and forms the group with them
(torch.distributed over 127.0.0.1: NCCL on CUDA, gloo on the CPU). Rank 0 then
broadcasts the runtime config once, so every rank builds the same runner, in the same
order, and their collectives (sizing, graph capture) pair up.

Each forward rank 0 runs is broadcast first as its ForwardItems packed into one int64
tensor (a two-integer header, then the payload): the followers rebuild the same
ForwardBatch and run the same forward, whose row-parallel layers all-reduce. Nothing
is pickled. An empty message stops the followers.

Failure: rank 0 watches its followers; if one exits, rank 0 exits too, which is a
target death for the launcher. A follower dies with rank 0 (its parent) by the
parent-death signal that spec_runtime.child_boot sets.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from spec_runtime.engine.forward_batch import ForwardItem

logger = logging.getLogger(__name__)

_LOGITS = ("last", "all", "none")
_STOP = 0
_ITEMS = 1


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the r-th after `device` (cuda:i -> cuda:i+r); cpu stays cpu."""
    if device == "cpu":
        return "cpu"
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pack_items(items: Sequence[ForwardItem]) -> np.ndarray:
    """[n, then per item (tokens, start_pos, rows, logits kind), then every item's token
    ids and kv rows] as one int64 array."""
    head = [len(items)]
    for it in items:
        head += [len(it.token_ids), it.start_pos, len(it.kv_rows), _LOGITS.index(it.logits)]
    parts = [np.asarray(head, dtype=np.int64)]
    for it in items:
        parts += [np.asarray(it.token_ids, dtype=np.int64), np.asarray(it.kv_rows, dtype=np.int64)]
    return np.concatenate(parts)


def unpack_items(data: np.ndarray) -> list[ForwardItem]:
    n = int(data[0])
    meta = data[1: 1 + 4 * n].reshape(n, 4)
    pos = 1 + 4 * n
    items = []
    for num_tokens, start_pos, num_rows, kind in meta.tolist():
        tokens = data[pos: pos + num_tokens]
        pos += num_tokens
        rows = data[pos: pos + num_rows]
        pos += num_rows
        items.append(ForwardItem(tokens, int(start_pos), rows, _LOGITS[kind]))
    if pos != data.shape[0]:
        raise ValueError(f"packed forward has {data.shape[0]} integers, its header describes {pos}")
    return items


class TPGroup:
    """This process's place in a tensor-parallel group, and the step broadcast."""

    def __init__(self, size: int, rank: int, device: str, port: int, timeout_s: float = 600.0,
                 followers: Sequence[subprocess.Popen] = (), backend: str | None = None,
                 host: str = "127.0.0.1") -> None:
        """followers (rank 0): the processes of ranks 1..size-1, watched from now on, so
        one that dies before joining ends this process instead of the join's wait.
        backend: default NCCL on CUDA, gloo on the CPU (gloo also carries CUDA tensors,
        through the host, where ranks share one GPU, which NCCL refuses). host, port:
        where rank 0 meets the others (a Ray deployment's ranks may sit on other nodes)."""
        self.size, self.rank = size, rank
        self.device = torch.device(device)
        self.followers = list(followers)
        self._stopped = False
        if self.followers:
            self.watch_followers()
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        addr = f"[{host}]" if ":" in host else host
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", world_size=size, rank=rank,
                                timeout=datetime.timedelta(seconds=timeout_s))

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def _broadcast(self, data: np.ndarray | None, kind: int) -> tuple[int, np.ndarray | None]:
        """Rank 0 sends [kind, len(data)] then data; the others receive them. Rank 0 gets
        its own (kind, data) back without reading anything from the device."""
        if self.is_leader:
            n = 0 if data is None else data.shape[0]
            dist.broadcast(torch.tensor([kind, n], dtype=torch.int64, device=self.device), 0)
            if n:
                dist.broadcast(torch.from_numpy(data).to(self.device), 0)
            return kind, data
        head = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.broadcast(head, 0)
        kind, n = head.tolist()
        payload = torch.empty(n, dtype=torch.int64, device=self.device)
        if n:
            dist.broadcast(payload, 0)
        return kind, payload.cpu().numpy()

    def send_items(self, items: Sequence[ForwardItem]) -> None:
        """Rank 0: tell the followers to run this forward."""
        self._broadcast(pack_items(items), _ITEMS)

    def recv_items(self) -> list[ForwardItem] | None:
        """Followers: the next forward's items, or None when rank 0 stops the group."""
        kind, data = self._broadcast(None, 0)
        return None if kind == _STOP else unpack_items(data)

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's bytes on every rank (the runtime config, at start-up): [length, the
        bytes padded to whole int64s]."""
        arr = None
        if data is not None:
            padded = np.frombuffer(data + b"\0" * (-len(data) % 8), dtype=np.int64)
            arr = np.concatenate([np.array([len(data)], dtype=np.int64), padded])
        _, out = self._broadcast(arr, _ITEMS)
        return out[1:].tobytes()[: int(out[0])]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (e.g. the KV slots that fit on each device)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def watch_followers(self, poll_s: float = 0.5) -> threading.Thread:
        """Rank 0: exit this process if a follower dies before stop() (rank 0's next
        collective would wait for it forever)."""

        def watch() -> None:
            while not self._stopped:
                for rank, p in enumerate(self.followers, start=1):
                    code = p.poll()
                    if code is not None and not self._stopped:
                        logger.error("tensor-parallel rank %d exited with code %s; the target stops", rank, code)
                        for q in self.followers:
                            if q.poll() is None:
                                q.kill()
                        os._exit(1)
                time.sleep(poll_s)

        t = threading.Thread(target=watch, name="tp-followers", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        """Rank 0: stop the followers and leave the group (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        everyone = all(p.poll() is None for p in self.followers)
        if self.is_leader and everyone:
            try:
                self._broadcast(None, _STOP)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the stop has reached every rank
            except Exception:  # noqa: BLE001 - a follower already gone: nothing to tell
                logger.warning("could not tell the tensor-parallel followers to stop")
                everyone = False
        # Every rank leaves the group at the same time (NCCL's teardown waits for the
        # others), before rank 0 waits for the followers to exit; with a rank gone, nobody
        # would answer, so the process exits without it.
        if dist.is_initialized() and everyone:
            dist.destroy_process_group()
        for p in self.followers:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def start_followers(size: int, port: int, device: str) -> list[subprocess.Popen]:
    """Rank 0 (on `device`): start ranks 1..size-1 (target_proc.follower) on the devices
    after it, each tied to this process's life."""
    procs = []
    for rank in range(1, size):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "spec_runtime.child_boot", "target-rank", "--parent-pid", str(os.getpid()),
             "--rank", str(rank), "--world-size", str(size), "--port", str(port),
             "--device", rank_device(device, rank)],
        ))
    return procs


