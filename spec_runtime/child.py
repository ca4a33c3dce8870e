"""What both child processes do before their main loop: the Hello -> Init -> Ready
handshake with the launcher, log prefixes, and exiting when the parent dies.

A child that fails while loading sends ErrorReply(code="startup") naming itself and the
cause, then exits non-zero; the launcher reports it and cleans up.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Callable

import zmq

from protocol.codec import ProtocolError, check_version, decode_config
from protocol.messages import PROTOCOL_VERSION, ErrorReply, HandshakeMessage, Hello, Init, Ready
from protocol.transport import Channel
from spec_runtime.child_boot import PR_SET_PDEATHSIG

logger = logging.getLogger(__name__)


def setup_logging(role: str, level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.WARNING),
        format=f"({role} pid={os.getpid()}) %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def one_host_thread(device: str) -> None:
    """On a CUDA device, torch's CPU work in this process runs on one thread. torch spreads
    a CPU copy (pinning a batch's page table) over a thread per core from 32K entries on,
    and idle OpenMP threads spin for a while. With the target and the draft on one host and
    the default threads, a verify beside the draft's work-ahead at 16 sequences of 2K tokens
    took a median 22.4 ms against 14.1 ms without one (docs/benchmarks.md; the spinning
    threads are the likely cause, not profiled). CPU devices keep torch's threads: there
    they run the model."""
    if device.startswith("cuda"):
        import torch

        torch.set_num_threads(1)


def exit_with_parent(parent_pid: int | None) -> None:
    """Die with the parent: PR_SET_PDEATHSIG where Linux has it, plus a watchdog thread
    (other platforms, and a death the signal cannot report). The parent is the pid the
    launcher passed to spec_runtime.child_boot, which already checked it before the
    imports; a child started some other way (parent_pid None) watches the parent it has now."""
    parent = parent_pid if parent_pid is not None else os.getppid()
    if os.getppid() != parent:
        os._exit(1)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_child(role: str, build: Callable[[object, Init], tuple[Ready, Callable[[], None]]]) -> None:
    """Entry point of `python -m target_proc` / `python -m draft_proc`.

    build(config, init) loads the model and returns (Ready message, main loop).
    """
    parser = argparse.ArgumentParser(prog=f"python -m {role}_proc")
    parser.add_argument("--control", required=True, help="launcher's handshake address")
    parser.add_argument("--log-level", default="WARNING", help="log level until the config arrives")
    parser.add_argument("--parent-pid", type=int, default=None, help="the launcher's pid (spec_runtime.child_boot)")
    args = parser.parse_args()
    exit_with_parent(args.parent_pid)
    setup_logging(role, args.log_level)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    ctl = Channel(zmq.PAIR, HandshakeMessage)
    ctl.connect(args.control)
    ctl.send(Hello(protocol_version=PROTOCOL_VERSION, role=role, pid=os.getpid()))
    try:
        init = ctl.recv(timeout_s=60.0)
        if init is None:
            raise RuntimeError("no Init from the launcher within 60 s")
        if not isinstance(init, Init):
            raise RuntimeError(f"expected Init, got {type(init).__name__}")
        check_version(init)
        cfg = decode_config(init.config)
        setup_logging(role, cfg.log_level)
        ready, main_loop = build(cfg, init)
    except (ProtocolError, Exception) as e:  # noqa: BLE001 - every start-up failure is reported
        logger.debug("start-up failed:\n%s", traceback.format_exc())
        try:
            ctl.send(ErrorReply(code="startup", message=f"{role} process (pid {os.getpid()}): {type(e).__name__}: {e}"))
            time.sleep(0.2)  # let the frame leave before the process does
        finally:
            sys.exit(1)
    ctl.send(ready)
    try:
        main_loop()
    except KeyboardInterrupt:
        pass
    except Exception:
        logger.exception("%s main loop crashed", role)
        sys.exit(1)
    finally:
        ctl.close()
