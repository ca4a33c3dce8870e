"""The socket under target_proc's spec link: whether the draft is up and answering.

A dead draft is noticed from the socket itself (a zmq monitor reports the disconnect),
and sends never block (NOBLOCK): a draft that does not take a message is *suspect*, as
is one that missed the draft timeout (target_proc.draft_link), and is probed until it
answers. Whenever the draft comes back (reconnected after a restart, or answering again
after a stall) `generation` grows: the link (DraftLink, built on this class) then
re-adds every sequence before it is speculated again.
"""

from __future__ import annotations

import logging
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol.codec import ProtocolError, encode
from protocol.messages import DraftStats, DraftStatsRequest
from target_proc.draft_timeout import DraftTimeout

logger = logging.getLogger(__name__)


class DraftSocket:
    def __init__(self, channel, address: str, timeout_s: float | None):
        """channel: an unconnected PAIR Channel; it is connected to `address` once its
        monitor is attached, so the first connect is seen too. timeout_s: None measures it."""
        self.channel = channel
        self.timeout = DraftTimeout(timeout_s)
        self.last_stats: DraftStats | None = None  # the counters the draft pushed last
        self.num_reconnects = 0
        # Bumped whenever the draft's state can no longer be trusted to match ours.
        self.generation = 0
        self.connected = False
        self.healthy = True
        self._probe_sent = 0.0
        # Up = the ZMTP handshake finished (with CURVE, the key check passed too), not
        # merely the transport connected. No ZMQ_IMMEDIATE: with it, a PAIR socket whose
        # peer re-binds after a restart refuses every send (EAGAIN) for good. Sends stay
        # non-blocking, and nothing is sent while the draft is known to be down.
        self._monitor = channel.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        channel.connect(address)

    @property
    def timeout_s(self) -> float:
        return self.timeout.value

    @property
    def alive(self) -> bool:
        return self.connected and self.healthy

    def poll_health(self) -> None:
        """Take socket events; while suspect, probe the draft and listen for any answer."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self.connected:
                self.connected = True
                self.healthy = True
                self._back()
                if self.generation > 1:
                    self.num_reconnects += 1
                    logger.warning("draft reconnected; re-adding every sequence and resuming speculation")
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected = False
                logger.warning("draft disconnected; decoding without speculation until it is back")
        if self.connected and not self.healthy:
            now = time.monotonic()
            if now - self._probe_sent > self.timeout_s:
                self._probe_sent = now
                self._send(DraftStatsRequest())
            while (msg := self._recv(0.0)) is not None:
                if isinstance(msg, DraftStats):
                    self.last_stats = msg
                    self.healthy = True
                    self._back()
                    logger.warning("draft answers again; re-adding every sequence and resuming speculation")
                    break

    def wait_connected(self, timeout_s: float) -> None:
        """Block until the spec link is up (start-up: Ready is sent only after this, so the
        first request is speculated like every other)."""
        deadline = time.monotonic() + timeout_s
        while not self.connected:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the draft process did not accept the spec link within {timeout_s:.0f} s")
            self.poll_health()
            time.sleep(0.01)

    def _back(self) -> None:
        """The draft is up again: nothing it holds can be trusted."""
        self.generation += 1

    def _send(self, msg) -> bool:
        try:
            self.channel.socket.send_multipart(encode(msg), copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            if self.healthy:
                logger.warning("draft is not accepting messages; decoding without speculation")
            self.healthy = False
            return False

    def _recv(self, timeout_s: float):
        try:
            return self.channel.recv(timeout_s=max(0.0, timeout_s))
        except ProtocolError as e:
            logger.warning("dropping a malformed message from the draft: %s", e)
            return None
