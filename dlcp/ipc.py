"""Framing and constants of the shim protocol (docs/shim-protocol.md).

A message is a 4-byte big-endian length and that many bytes of UTF-8 JSON
holding one object. Shared by the daemon (asyncio) and the shim (blocking).
"""

from __future__ import annotations

import json
import re
import socket
import struct
from typing import Any

from dlcp.errors import DlcpError

__all__ = [
    "CODEC_BY_NAME",
    "DEFAULT_SOCKET",
    "MAX_MESSAGE",
    "PROTOCOL_VERSION",
    "SEGMENT_NAME",
    "ProtocolError",
    "decode_body",
    "encode",
    "recv_message",
    "send_message",
]

PROTOCOL_VERSION = 1
DEFAULT_SOCKET = "/run/dlcp/dlcpd.sock"
MAX_MESSAGE = 1 << 20
SEGMENT_NAME = re.compile(r"dlcp-[A-Za-z0-9_.-]{1,200}")
_LEN = struct.Struct("!I")

CODEC_BY_NAME = {"fp32": 0, "fp16": 1, "thc8": 2, "thc4": 3, "fft": 6}
CODEC_BY_NAME.update({"union": 4, "sketch": 5})  # the sketch codec's two exchanges


class ProtocolError(DlcpError):
    """Broken framing: the connection cannot go on."""


def encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    return _LEN.pack(len(body)) + body


def decode_length(prefix: bytes) -> int:
    (n,) = _LEN.unpack(prefix)
    if n > MAX_MESSAGE:
        raise ProtocolError(f"message of {n} bytes exceeds {MAX_MESSAGE}")
    return int(n)


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, huge ints, depth
        raise ProtocolError(f"message is not JSON: {str(exc)[:200]}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("message is not a JSON object")
    return msg


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("daemon closed the connection")
        buf += chunk
    return bytes(buf)


def recv_message(sock: socket.socket) -> dict[str, Any]:
    n = decode_length(_recv_exact(sock, _LEN.size))
    return decode_body(_recv_exact(sock, n))


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(encode(message))
