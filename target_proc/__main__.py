"""`python -m target_proc --control ADDR`: started by spec_runtime's launcher."""

from __future__ import annotations

import os

import zmq

from protocol.messages import PROTOCOL_VERSION, ClientMessage, Ready, SpecLinkToTarget
from protocol.transport import Channel, RouterChannel
from spec_runtime.child import run_child
from target_proc.draft_link import DraftLink
from target_proc.worker import TargetWorker


def build(cfg, init):
    from spec_runtime.model.runner import ModelRunner

    # Verify forwards are padded to K+1 tokens per sequence, so one graph per batch size fits.
    q_lens = (1, cfg.spec.k + 1) if cfg.spec.mode != "ar" else (1,)
    runner = ModelRunner(cfg.target, num_slots=cfg.sched.max_batch_size, max_model_len=cfg.sched.max_model_len,
                         max_batch_size=cfg.sched.max_batch_size, graph_q_lens=q_lens)
    clients = RouterChannel(ClientMessage)
    clients.bind(init.client_addr)
    link = None
    if cfg.spec.uses_draft_process:
        link = DraftLink(Channel(zmq.PAIR, SpecLinkToTarget), init.spec_addr, cfg.spec.draft_timeout_s, cfg.spec.k)
        link.wait_connected(cfg.startup_timeout_s)
    worker = TargetWorker(cfg, runner, clients, link)
    ready = Ready(
        protocol_version=PROTOCOL_VERSION,
        role="target",
        pid=os.getpid(),
        vocab_size=runner.vocab_size,
        kv_capacity=runner.layout.num_rows,
        max_batch_size=runner.layout.num_slots,
        max_model_len=runner.layout.max_model_len,
        eos_token_ids=list(runner.eos_token_ids),
        graph_batch_sizes=list(getattr(runner, "graph_batch_sizes", [])),
        model_name=runner.model_name,
    )
    return ready, worker.run_forever


if __name__ == "__main__":
    run_child("target", build)
