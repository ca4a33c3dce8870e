"""`python -m target_proc.follower --rank R --world-size N --port P --device D`: rank R of
the target's tensor-parallel group, started by rank 0 (target_proc.model) through
spec_runtime.child_boot.

It joins the group, receives the runtime config from rank 0, builds the same runner,
then runs each forward rank 0 broadcasts until rank 0 stops the group. It talks to
nobody else; rank 0's death ends it (the parent-death signal).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal

logger = logging.getLogger(__name__)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m target_proc.follower")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--parent-pid", type=int, default=None, help="the target's pid (spec_runtime.child_boot)")
    args = p.parse_args()

    from spec_runtime.child import exit_with_parent, one_host_thread, setup_logging

    exit_with_parent(args.parent_pid)
    one_host_thread(args.device)
    role = f"target-rank{args.rank}"
    setup_logging(role, "WARNING")  # until the config arrives
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    group, runner = join(args.rank, args.world_size, args.device, args.port,
                         on_config=lambda cfg: setup_logging(role, cfg.log_level))
    runner.follow()
    group.stop()


def join(rank: int, world_size: int, device: str, port: int, host: str = "127.0.0.1", timeout_s: float = 600.0,
         on_config=None):
    """Join rank 0's group at host:port, receive the runtime config, build the same runner
    (on `device`): (group, runner), ready for runner.follow(). on_config(cfg) runs once the
    config has arrived (logging set-up)."""
    import msgspec

    from protocol.codec import decode_config
    from spec_runtime.engine.parallel import TPGroup
    from target_proc.model import target_runner

    group = TPGroup(world_size, rank, device, port, timeout_s=timeout_s, host=host)
    cfg = decode_config(msgspec.msgpack.decode(group.broadcast_bytes(None)))
    if on_config is not None:
        on_config(cfg)
    return group, target_runner(cfg, group)


if __name__ == "__main__":
    main()
