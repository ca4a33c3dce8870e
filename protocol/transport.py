"""ZeroMQ transport for both links: addresses, safe binds, and typed channels.

Socket patterns (chosen once, here):
  - spec link (target <-> draft) and handshake links: PAIR <-> PAIR, an exclusive
    1:1 link. A bound PAIR refuses a second peer, so a stray connection can never
    take half the messages (which a bound DEALER would allow). Use `Channel`.
  - client link (many clients -> target_proc): one DEALER per client, a ROUTER in
    target_proc. `RouterChannel.recv` returns (identity, msg); `send_to(identity,
    msg)` answers that client. Clients use `Channel` with zmq.DEALER.

Addresses: same host, `ipc://` inside a fresh 0700 directory (`private_ipc_dir`),
so no other user can connect. The directory records its owner's pid; its owner
removes it on the way out, and `remove_stale_ipc_dirs` removes those of owners that
died without doing so (kill -9). Across hosts, `tcp://` with CURVE (set the keys
before bind/connect). Binding a non-loopback tcp host needs allow_remote=True.

Every socket gets LINGER 0 (close never blocks on unsent messages), bounded
high-water marks, and ZMQ_MAXMSGSIZE = max_frame_bytes, so libzmq disconnects a
peer that sends an oversized frame before allocating it. The codec checks the
same limits again after receipt.

Errors: `recv` raises `ProtocolError` for a message it cannot decode; the socket
stays usable, and the caller decides whether to answer with `send_error`. A
RouterChannel sets `err.peer` to the sender's identity for that answer.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import stat
import tempfile
from typing import Any

import msgspec
import zmq

from protocol.codec import DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_FRAMES, Decoder, ProtocolError, encode
from protocol.messages import ErrorReply

logger = logging.getLogger(__name__)

# sun_path is 108 bytes on Linux (104 on macOS) including the NUL; stay under both.
MAX_IPC_PATH_BYTES = 100
DEFAULT_HWM = 1000


# ---------------------------------------------------------------- addresses


IPC_OWNER_FILE = "owner.pid"


def private_ipc_dir(prefix: str = "spec-rt-") -> str:
    """A fresh directory only this user can enter (mode 0700) for ipc sockets; it holds
    `owner.pid` (this process's pid) so a later start can tell it is stale."""
    path = tempfile.mkdtemp(prefix=prefix)
    st = os.stat(path)
    mode = stat.S_IMODE(st.st_mode)
    if mode != 0o700 or st.st_uid != os.getuid():
        raise RuntimeError(f"ipc dir {path} has mode {oct(mode)} owner {st.st_uid}; expected 0o700 owned by us")
    with open(os.path.join(path, IPC_OWNER_FILE), "w") as f:
        f.write(str(os.getpid()))
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def remove_stale_ipc_dirs(prefix: str = "spec-rt-") -> list[str]:
    """Remove this user's ipc directories whose owner process is gone; returns them.

    Only directories with an `owner.pid` naming a dead process are touched, so a
    runtime starting beside this one (no owner file yet) is never disturbed.
    """
    root = tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            with open(os.path.join(path, IPC_OWNER_FILE)) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            logger.info("removed the stale ipc directory %s (owner pid %d is gone)", path, pid)
    return removed


def ipc_address(directory: str, name: str) -> str:
    """`ipc://<directory>/<name>`; ValueError if the path exceeds the unix socket limit."""
    if not name or "/" in name:
        raise ValueError(f"ipc socket name must be a plain file name, got {name!r}")
    path = os.path.join(directory, name)
    if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
        raise ValueError(
            f"ipc path {path!r} is {len(os.fsencode(path))} bytes; unix sockets allow "
            f"{MAX_IPC_PATH_BYTES} here. Use a shorter TMPDIR or name."
        )
    return f"ipc://{path}"


def tcp_address(host: str = "127.0.0.1", port: int = 0) -> str:
    """`tcp://host:port`; port 0 means any free port (read the real one from bind)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"tcp://{host}:{port if port else '*'}"


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a hostname: may be reachable from outside


def bind(sock: zmq.Socket, address: str, allow_remote: bool = False) -> str:
    """Bind and return the actual endpoint (ZMQ_LAST_ENDPOINT, e.g. the chosen port).

    Refuses a tcp host that is not loopback unless allow_remote=True (use CURVE then).
    """
    if address.startswith("tcp://") and not allow_remote:
        host = address[len("tcp://"):].rsplit(":", 1)[0]
        if not _is_loopback(host):
            raise ValueError(
                f"refusing to bind {address}: not a loopback address. Pass allow_remote=True "
                "(and set CURVE keys) to accept connections from other hosts."
            )
    sock.bind(address)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


# ---------------------------------------------------------------- CURVE


def curve_keypair() -> tuple[bytes, bytes]:
    """(public_key, secret_key), Z85-encoded, for CURVE encryption over tcp."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    return zmq.curve_keypair()


def set_curve_server(sock: zmq.Socket, secret_key: bytes) -> None:
    """Make `sock` a CURVE server (before bind). Clients need its public key.

    Without a ZAP handler any client that knows the server's public key is
    accepted; the server key itself is the shared secret of the deployment.
    """
    sock.curve_secretkey = secret_key
    sock.curve_server = True


def set_curve_client(sock: zmq.Socket, server_public_key: bytes, keypair: tuple[bytes, bytes] | None = None) -> None:
    """Make `sock` a CURVE client of the server with `server_public_key` (before connect)."""
    public, secret = keypair or curve_keypair()
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = server_public_key


# ---------------------------------------------------------------- channels


def _make_socket(
    ctx: zmq.Context | None, socket_type: int, max_frame_bytes: int, hwm: int
) -> zmq.Socket:
    sock = (ctx or zmq.Context.instance()).socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    return sock


def _poll_recv(sock: zmq.Socket, timeout_s: float | None) -> list[zmq.Frame] | None:
    timeout_ms = None if timeout_s is None else max(0, int(timeout_s * 1000))
    if not sock.poll(timeout_ms, zmq.POLLIN):
        return None
    return sock.recv_multipart(copy=False)


def _error_reply(code: str, message: str, request_id: str, seq_id: int) -> ErrorReply:
    return ErrorReply(code=code, message=message, request_id=request_id, seq_id=seq_id)


class Channel:
    """One PAIR or DEALER socket that sends and receives typed messages.

    `recv_type` is the union this side accepts (e.g. SpecLinkToDraft in draft_proc).
    Not thread-safe (zmq sockets never are): use a channel from one thread.
    """

    def __init__(
        self,
        socket_type: int,
        recv_type: Any,
        *,
        ctx: zmq.Context | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_frames: int = DEFAULT_MAX_FRAMES,
        hwm: int = DEFAULT_HWM,
    ) -> None:
        if socket_type not in (zmq.PAIR, zmq.DEALER):
            raise ValueError("Channel takes zmq.PAIR or zmq.DEALER; use RouterChannel for ROUTER")
        self.socket = _make_socket(ctx, socket_type, max_frame_bytes, hwm)
        self.decoder = Decoder(recv_type, max_frame_bytes=max_frame_bytes, max_frames=max_frames)

    def bind(self, address: str, allow_remote: bool = False) -> str:
        return bind(self.socket, address, allow_remote)

    def connect(self, address: str) -> None:
        self.socket.connect(address)

    def send(self, msg: msgspec.Struct) -> None:
        # copy=False: zmq keeps a reference to each array buffer until it is sent.
        self.socket.send_multipart(encode(msg), copy=False)

    def recv(self, timeout_s: float | None = None) -> Any | None:
        """The next message, or None after timeout_s (None: wait forever).

        Raises ProtocolError if the message cannot be decoded; the channel stays usable.
        """
        frames = _poll_recv(self.socket, timeout_s)
        return None if frames is None else self.decoder.decode(frames)

    def send_error(self, code: str, message: str, request_id: str = "", seq_id: int = -1) -> None:
        self.send(_error_reply(code, message, request_id, seq_id))

    def try_send(self, msg: msgspec.Struct) -> bool:
        """Send without blocking: False when the peer is absent or not reading (its queue is full)."""
        try:
            self.socket.send_multipart(encode(msg), copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def pending(self) -> bool:
        """Whether a message is waiting (recv would not block)."""
        return bool(self.socket.poll(0, zmq.POLLIN))

    def close(self) -> None:
        self.socket.close(linger=0)

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RouterChannel:
    """A ROUTER socket serving many DEALER clients (the client link in target_proc).

    Sends never block and never drop silently: ROUTER_MANDATORY makes an unknown
    or departed identity an error, and a full client queue (slow reader) is
    reported too; `send_to` returns False in both cases and the caller decides.
    """

    def __init__(
        self,
        recv_type: Any,
        *,
        ctx: zmq.Context | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_frames: int = DEFAULT_MAX_FRAMES,
        hwm: int = DEFAULT_HWM,
    ) -> None:
        self.socket = _make_socket(ctx, zmq.ROUTER, max_frame_bytes, hwm)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.decoder = Decoder(recv_type, max_frame_bytes=max_frame_bytes, max_frames=max_frames)

    def bind(self, address: str, allow_remote: bool = False) -> str:
        return bind(self.socket, address, allow_remote)

    def recv(self, timeout_s: float | None = None) -> tuple[bytes, Any] | None:
        """(identity, message), or None after timeout_s.

        Raises ProtocolError with `.peer` = identity if the message cannot be decoded.
        """
        frames = _poll_recv(self.socket, timeout_s)
        if frames is None:
            return None
        identity = frames[0].bytes
        try:
            return identity, self.decoder.decode(frames[1:])
        except ProtocolError as e:
            e.peer = identity
            raise

    def send_to(self, identity: bytes, msg: msgspec.Struct) -> bool:
        """Send to one client; False (logged) if it is gone or not reading."""
        try:
            self.socket.send_multipart([identity, *encode(msg)], copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            logger.warning("client %r is not reading (queue full); dropped %s", identity, type(msg).__name__)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            logger.info("client %r is gone; dropped %s", identity, type(msg).__name__)
        return False

    def send_error_to(
        self, identity: bytes, code: str, message: str, request_id: str = "", seq_id: int = -1
    ) -> bool:
        return self.send_to(identity, _error_reply(code, message, request_id, seq_id))

    def close(self) -> None:
        self.socket.close(linger=0)

    def __enter__(self) -> "RouterChannel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
