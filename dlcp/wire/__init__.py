"""Sans-IO wire format: the self-describing, authenticated dlcp packet."""

from dlcp.wire.batch import HEADER_DTYPE, Batch, decode_batch, encode_batch, split_segments
from dlcp.wire.header import (
    HEADER_SIZE,
    MAX_DATAGRAM,
    MAX_PAYLOAD,
    Codec,
    Flags,
    Header,
    PacketType,
    decode,
    encode,
    lane_bytes,
    mac_key,
)

__all__ = [
    "HEADER_DTYPE",
    "HEADER_SIZE",
    "MAX_DATAGRAM",
    "MAX_PAYLOAD",
    "Batch",
    "Codec",
    "Flags",
    "Header",
    "PacketType",
    "decode",
    "decode_batch",
    "encode",
    "encode_batch",
    "lane_bytes",
    "mac_key",
    "split_segments",
]
