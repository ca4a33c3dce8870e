"""`python -m draft_proc --control ADDR`: started by spec_runtime's launcher."""

from __future__ import annotations

import os

import zmq

from protocol.messages import PROTOCOL_VERSION, Ready, SpecLinkToDraft
from protocol.transport import Channel, set_curve_server
from spec_runtime.child import one_host_thread, run_child
from draft_proc.worker import DraftWorker


def build(cfg, init, *, spec_secret_key: bytes | None = None):
    """Load the draft and bind the spec link. With `spec_secret_key` (Ray deployments over
    tcp) the link is a CURVE server and may bind a non-loopback address."""
    from draft_proc.factory import make_speculators

    one_host_thread(cfg.draft.device)
    speculator, ssd, vocab_size, info = make_speculators(cfg)
    chan = Channel(zmq.PAIR, SpecLinkToDraft)
    if spec_secret_key is not None:
        set_curve_server(chan.socket, spec_secret_key)
    chan.bind(init.spec_addr, allow_remote=spec_secret_key is not None)
    num_slots = info["num_slots"]
    worker = DraftWorker(cfg, chan, speculator, vocab_size, num_slots, ssd=ssd, kv=info["kv"])
    ready = Ready(
        protocol_version=PROTOCOL_VERSION,
        role="draft",
        pid=os.getpid(),
        vocab_size=vocab_size,
        kv_capacity=info.get("kv_capacity", 0),
        max_batch_size=num_slots,
        max_model_len=info["max_model_len"],
        model_name=info.get("model_name", "ngram"),
    )
    return ready, worker.run_forever


if __name__ == "__main__":
    run_child("draft", build)
