"""Wire codec: msgspec Structs to zmq frames and back, large arrays as zero-copy frames.

A message travels as a multipart zmq message:

    frame 0      msgpack of the Struct (tag first: every message is array_like)
    frame 1..n   the raw bytes of each large numpy array in the message, C-contiguous,
                 little-endian, in the order the encoder met them

Inside frame 0 each array is replaced by a small descriptor `[dtype_name, shape, data]`:
data is the index of the array's frame, e.g. `["int64", [4, 8], 2]`, or, for an array of
at most `INLINE_BYTES` bytes, its raw bytes (msgpack bin). Every frame costs the sender
and the receiver a zmq message part, and a step's messages on the spec link carry a few
arrays of a few hundred bytes each: inline, such a message is one frame. The decoder
checks the descriptor against the data before building the array: dtype in
`ALLOWED_DTYPES`, `prod(shape) * itemsize == len(data)`, a frame index in range, every
extra frame used exactly once. Frame count and frame size are bounded before msgpack is
touched.

Buffer ownership: `encode` returns memoryviews over the caller's large arrays (no copy
unless an array was not C-contiguous little-endian); the caller must not modify
them until the send completes (pyzmq `copy=False` holds a reference). Arrays from
`Decoder.decode` are read-only views over the received data and keep it alive; copy
one (`arr.copy()`) to write to it or to hold it for a long time.

Every decode failure raises `ProtocolError`; nothing else escapes `decode`.
No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import typing
from typing import Any, Sequence

import msgspec
import numpy as np

from protocol.messages import PLACEHOLDER_TOKEN_ID, PROTOCOL_VERSION

# dtype name on the wire -> the little-endian numpy dtype it means.
ALLOWED_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("bool", "int32", "int64", "float16", "float32")
}
# The same, keyed by the dtype itself (a dtype's .name is computed in Python on each read).
_WIRE_BY_DTYPE: dict[np.dtype, tuple[str, np.dtype]] = {
    wire: (name, wire) for name, wire in ALLOWED_DTYPES.items()
}
DEFAULT_MAX_FRAME_BYTES = 64 << 20
DEFAULT_MAX_FRAMES = 32
_MAX_NDIM = 8
_MAX_DIM = 1 << 40  # any larger dimension cannot match a frame under the limits
_HANDSHAKE_TAGS = ("hello", "init", "ready")
INLINE_BYTES = 4096  # arrays up to this size travel inside frame 0


class ProtocolError(ValueError):
    """A message that cannot be accepted. `code` goes into ErrorReply.code.

    Codes: "bad_message" (cannot be decoded), "too_large" (frame count or size),
    "version" (protocol version mismatch), "bad_request" (decoded but invalid,
    e.g. token ids out of range). `peer` is set by a ROUTER channel to the zmq
    identity of the sender, so the caller can reply to the right client.
    """

    def __init__(self, code: str, message: str, peer: bytes | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.peer = peer

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


# ---------------------------------------------------------------- encode

_enc_state = threading.local()


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        known = _WIRE_BY_DTYPE.get(obj.dtype)  # little-endian arrays of an allowed dtype
        if known is None:  # big-endian or not allowed
            name = obj.dtype.name
            wire_dtype = ALLOWED_DTYPES.get(name)
            if wire_dtype is None:
                raise ProtocolError("bad_message", f"cannot send arrays of dtype {name}; allowed: {sorted(ALLOWED_DTYPES)}")
        else:
            name, wire_dtype = known
        # No-op (no copy) for the usual C-contiguous little-endian array.
        arr = np.ascontiguousarray(obj, dtype=wire_dtype)
        if arr.nbytes <= _enc_state.inline_bytes:
            return [name, list(arr.shape), arr.tobytes()]
        frames = _enc_state.frames
        # A flat uint8 view: its memoryview has len == nbytes, even for bool and
        # zero-size arrays, which memoryview.cast would refuse.
        frames.append(memoryview(arr.reshape(-1).view(np.uint8)))
        return [name, list(arr.shape), len(frames) - 1]
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()  # numpy scalars in int/float fields
    raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(msg: msgspec.Struct, inline_bytes: int = INLINE_BYTES) -> list[bytes | memoryview]:
    """Message -> frames for `send_multipart(frames, copy=False)`; arrays of at most
    inline_bytes bytes go inside frame 0 (0: every array in a frame of its own).

    Raises ProtocolError for an array of a dtype outside ALLOWED_DTYPES or an
    unencodable field (a sender bug, reported before anything is sent).
    """
    _enc_state.frames = frames = [b""]
    _enc_state.inline_bytes = inline_bytes
    try:
        frames[0] = _encoder.encode(msg)
    except ProtocolError:
        raise
    except (TypeError, ValueError, NotImplementedError, OverflowError) as e:
        raise ProtocolError("bad_message", f"cannot encode {type(msg).__name__}: {e}") from e
    finally:
        _enc_state.frames = None
    return frames


# ---------------------------------------------------------------- decode


def _as_buffer(frame: Any) -> memoryview:
    # zmq.Frame (copy=False) exposes .buffer; bytes/bytearray/memoryview pass through.
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    view = memoryview(buf)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


class Decoder:
    """Typed decoder for one union of messages, e.g. `Decoder(SpecLinkToDraft)`.

    Thread-safe: per-call state lives in a thread-local. Build one per link
    direction and reuse it (msgspec decoders are cheap to call, costly to build).
    """

    def __init__(
        self,
        union_type: Any,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_frames: int = DEFAULT_MAX_FRAMES,
    ) -> None:
        if max_frame_bytes < 1 or max_frames < 1:
            raise ValueError("max_frame_bytes and max_frames must be >= 1")
        self.union_type = union_type
        self.max_frame_bytes = max_frame_bytes
        self.max_frames = max_frames
        self._state = threading.local()
        self._decoder = msgspec.msgpack.Decoder(union_type, dec_hook=self._dec_hook)

    def decode(self, frames: Sequence[Any]) -> Any:
        """Frames (bytes, memoryview or zmq.Frame) -> message. Raises ProtocolError only."""
        try:
            return self._decode(frames)
        except ProtocolError:
            raise
        except Exception as e:  # anything from a hostile peer becomes one error type
            raise ProtocolError("bad_message", f"{type(e).__name__}: {e}") from e

    def _decode(self, frames: Sequence[Any]) -> Any:
        if not frames:
            raise ProtocolError("bad_message", "empty message (no frames)")
        if len(frames) > self.max_frames:
            raise ProtocolError("too_large", f"got {len(frames)} frames, limit {self.max_frames}")
        bufs = [_as_buffer(f) for f in frames]
        for i, b in enumerate(bufs):
            if b.nbytes > self.max_frame_bytes:
                raise ProtocolError(
                    "too_large", f"frame {i} has {b.nbytes} bytes, limit {self.max_frame_bytes}"
                )
        self._state.bufs = bufs
        self._state.used = set()
        try:
            msg = self._decoder.decode(bufs[0])
        except msgspec.ValidationError as e:
            _raise_if_version_mismatch(bufs[0])
            raise ProtocolError("bad_message", f"invalid {_union_name(self.union_type)}: {e}") from e
        except msgspec.DecodeError as e:
            raise ProtocolError("bad_message", f"malformed msgpack: {e}") from e
        finally:
            used, self._state.bufs, self._state.used = self._state.used, None, None
        if len(used) != len(bufs) - 1:
            raise ProtocolError(
                "bad_message", f"{len(bufs) - 1} array frames sent but {len(used)} referenced"
            )
        return msg

    def _dec_hook(self, type_: type, obj: Any) -> Any:
        if type_ is not np.ndarray:
            raise TypeError(f"unsupported type {type_}")
        # ValueErrors here come back from msgspec as ValidationError with the field path.
        if not (isinstance(obj, (list, tuple)) and len(obj) == 3):
            raise ValueError("array descriptor must be [dtype, shape, frame index or bytes]")
        name, shape, index = obj
        dtype = ALLOWED_DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise ValueError(f"array dtype {name!r} not allowed; allowed: {sorted(ALLOWED_DTYPES)}")
        if not (
            isinstance(shape, (list, tuple))
            and len(shape) <= _MAX_NDIM
            and all(type(d) is int and 0 <= d < _MAX_DIM for d in shape)
        ):
            raise ValueError(f"bad array shape {shape!r}")
        if type(index) is bytes:  # inline
            buf, where = memoryview(index), "inline array"
        else:
            bufs, used = self._state.bufs, self._state.used
            if type(index) is not int or not 1 <= index < len(bufs):
                raise ValueError(f"array frame index {index!r} out of range 1..{len(bufs) - 1}")
            if index in used:
                raise ValueError(f"array frame {index} referenced twice")
            used.add(index)
            buf, where = bufs[index], f"array frame {index}"
        expected = math.prod(shape) * dtype.itemsize
        if expected != buf.nbytes:
            raise ValueError(f"{where}: shape {list(shape)} of {name} needs {expected} bytes, got {buf.nbytes}")
        arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
        arr.flags.writeable = False  # a view of the network buffer: never written in place
        return arr


def _union_name(union_type: Any) -> str:
    return getattr(union_type, "__name__", None) or str(union_type).replace("protocol.messages.", "")


def _raise_if_version_mismatch(frame0: memoryview) -> None:
    """A handshake message from another protocol version may not match our fields;
    report the version instead of a confusing field error."""
    try:
        raw = msgspec.msgpack.decode(frame0)
    except Exception:
        return
    if (
        isinstance(raw, list)
        and len(raw) >= 2
        and raw[0] in _HANDSHAKE_TAGS
        and type(raw[1]) is int
        and raw[1] != PROTOCOL_VERSION
    ):
        raise ProtocolError("version", _version_text(raw[1]))


def _version_text(got: int) -> str:
    return f"protocol version {got}, expected {PROTOCOL_VERSION}: both processes must run the same spec-runtime"


def check_version(msg: Any) -> None:
    """Raise ProtocolError("version") if a handshake message speaks another version."""
    got = getattr(msg, "protocol_version", None)
    if got is None:
        raise ProtocolError("bad_message", f"{type(msg).__name__} carries no protocol_version")
    if got != PROTOCOL_VERSION:
        raise ProtocolError("version", _version_text(got))


# ---------------------------------------------------------------- validation helpers


def check_token_ids(arr: np.ndarray, vocab_size: int, name: str, allow_placeholder: bool = False) -> None:
    """Raise ProtocolError("bad_request") unless every id is in [0, vocab_size).

    With allow_placeholder, PLACEHOLDER_TOKEN_ID (-1) is accepted too (e.g. the
    padding of SpecResponse.draft_token_ids past num_draft_tokens).
    """
    if not np.issubdtype(arr.dtype, np.integer):
        raise ProtocolError("bad_request", f"{name} must be an integer array, got {arr.dtype}")
    if arr.size == 0:
        return
    ids = arr[arr != PLACEHOLDER_TOKEN_ID] if allow_placeholder else arr
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        raise ProtocolError(
            "bad_request",
            f"{name} has {bad.size} token id(s) outside [0, {vocab_size}), e.g. {int(bad[0])}",
        )


# ---------------------------------------------------------------- config


def encode_config(cfg: Any) -> dict:
    """RuntimeConfig -> plain dict for Init.config, exactly as the receiver will see it
    (tuples become lists; decode_config turns them back into tuples)."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(cfg))


def decode_config(d: dict) -> Any:
    """Init.config -> RuntimeConfig. Unknown keys and invalid values raise ProtocolError."""
    # Imported here so `import protocol` stays free of spec_runtime (config imports no torch).
    from spec_runtime.config import RuntimeConfig

    _check_known_keys(d, RuntimeConfig, "config")
    try:
        return msgspec.convert(d, RuntimeConfig)
    except (msgspec.ValidationError, ValueError, TypeError) as e:
        raise ProtocolError("bad_message", f"invalid config: {e}") from e


def _check_known_keys(d: Any, cls: type, path: str) -> None:
    if not isinstance(d, dict):
        return  # msgspec.convert reports the type error with its path
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in d if k not in names)
    if unknown:
        raise ProtocolError("bad_message", f"unknown config key(s) at {path}: {unknown}")
    for key, value in d.items():
        sub = hints.get(key)
        if dataclasses.is_dataclass(sub):
            _check_known_keys(value, sub, f"{path}.{key}")
