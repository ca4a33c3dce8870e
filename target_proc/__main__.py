"""`python -m target_proc --control ADDR`: started by spec_runtime's launcher."""

from __future__ import annotations

import os

import zmq

from protocol.messages import PROTOCOL_VERSION, ClientMessage, Ready, SpecLinkToTarget
from protocol.transport import Channel, RouterChannel, set_curve_client, set_curve_server
from spec_runtime.child import one_host_thread, run_child
from target_proc.draft_link import DraftLink
from target_proc.worker import TargetWorker


def build(cfg, init, *, client_secret_key: bytes | None = None, draft_public_key: bytes | None = None,
          tp_rendezvous: tuple[str, int] | None = None):
    """Load the target and open its links. The keys (Ray deployments over tcp) make the
    client ROUTER a CURVE server and the spec link a CURVE client of the draft; a CURVE
    server may bind a non-loopback address. tp_rendezvous (host, port): where the
    tensor-parallel ranks that a Ray deployment started join this rank 0."""
    from target_proc.model import resolved_config, start_tensor_parallel, target_runner

    one_host_thread(cfg.target.device)
    tp = start_tensor_parallel(cfg, tp_rendezvous)  # None on one device
    runner = target_runner(cfg, tp)
    runner.warm_sampling_kernels(cfg.spec.draft_top_k)
    cfg = resolved_config(cfg, runner)  # the worker schedules with the sized defaults
    clients = RouterChannel(ClientMessage)
    if client_secret_key is not None:
        set_curve_server(clients.socket, client_secret_key)
    clients.bind(init.client_addr, allow_remote=client_secret_key is not None)
    link = None
    if cfg.spec.uses_draft_process:
        spec_chan = Channel(zmq.PAIR, SpecLinkToTarget)
        if draft_public_key is not None:
            set_curve_client(spec_chan.socket, draft_public_key)
        link = DraftLink(spec_chan, init.spec_addr, cfg.spec.draft_timeout_s, cfg.spec.k, runner.vocab_size)
        link.wait_connected(cfg.startup_timeout_s)
    transform = None
    if cfg.spec.synthetic_acceptance:  # benchmarks only
        from spec_runtime.bench.oracle import target_oracle

        transform = target_oracle(cfg.spec.synthetic_acceptance)
    worker = TargetWorker(cfg, runner, clients, link, logits_transform=transform)
    ready = Ready(
        protocol_version=PROTOCOL_VERSION,
        role="target",
        pid=os.getpid(),
        vocab_size=runner.vocab_size,
        kv_capacity=runner.layout.num_rows,
        max_batch_size=cfg.sched.max_batch_size,
        max_model_len=runner.layout.max_model_len,
        eos_token_ids=list(runner.eos_token_ids),
        graph_batch_sizes=list(getattr(runner, "graph_batch_sizes", [])),
        model_name=runner.model_name,
        startup_phases=dict(runner.startup_phases),
    )
    if tp is None:
        return ready, worker.run_forever

    def run_and_stop_followers() -> None:
        try:
            worker.run_forever()
        finally:
            tp.stop()

    return ready, run_and_stop_followers


if __name__ == "__main__":
    run_child("target", build)
