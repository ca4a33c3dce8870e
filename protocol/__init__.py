"""The messages of both links and their transport (msgspec + ZeroMQ, numpy arrays as frames).

Imports only msgspec, zmq, numpy and the standard library, never torch, so both
processes and the tests can use it cheaply. See `protocol.codec` for the wire
format and `protocol.transport` for the socket patterns.
"""

from protocol.codec import (
    ALLOWED_DTYPES,
    Decoder,
    ProtocolError,
    check_token_ids,
    check_version,
    decode_config,
    encode,
    encode_config,
)
from protocol.messages import PLACEHOLDER_TOKEN_ID, PROTOCOL_VERSION
from protocol.transport import (
    Channel,
    RouterChannel,
    bind,
    curve_keypair,
    ipc_address,
    private_ipc_dir,
    set_curve_client,
    set_curve_server,
    tcp_address,
)

__all__ = [
    "ALLOWED_DTYPES",
    "Channel",
    "Decoder",
    "PLACEHOLDER_TOKEN_ID",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "RouterChannel",
    "bind",
    "check_token_ids",
    "check_version",
    "curve_keypair",
    "decode_config",
    "encode",
    "encode_config",
    "ipc_address",
    "private_ipc_dir",
    "set_curve_client",
    "set_curve_server",
    "tcp_address",
]
