"""The dlcp packet: a fixed 64-byte header, a payload, and a keyed MAC.

Layout (network byte order; offsets in bytes):

    0  magic u16 (0xD1CF)   2 version u8   3 type u8   4 flags u8   5 priority u8
    6  codec u8             7 reserved u8 (0)
    8  job u32             12 round u32   16 bucket u32
   20  shard u16           22 layer u16   24 sender u16   26 contributors u16
   28  offset u32          32 count u32   36 total u32
   40  param f32           44 aux u32
   48  mac 16 bytes: BLAKE2b-128 keyed with the job key over bytes 0..47 and the payload
       (or the job's other MAC function, see dlcp/wire/mac.py)

Every packet says where its data belongs (job, round, bucket, shard, element
offset and count in a bucket of `total` lanes), so receivers write it in place
in any arrival order. `param` and `aux` are per type: data packets carry the
codec scale in `param` and the block's max magnitude in `aux` (float bits);
result packets carry the shard's observed max in `param`; DONE packets carry
the loss bound in `param`.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace

from dlcp.errors import Reason, WireError
from dlcp.wire.mac import MacKey, blake2b_tag

__all__ = [
    "HEADER_SIZE",
    "MAC_SIZE",
    "MAGIC",
    "MAX_DATAGRAM",
    "MAX_PRIORITY",
    "VERSION",
    "Codec",
    "Flags",
    "Header",
    "PacketType",
    "decode",
    "encode",
    "lane_bytes",
    "mac_key",
    "payload_length_ok",
]

MAGIC = 0xD1CF
VERSION = 1
HEADER_SIZE = 64
MAC_OFFSET = 48
MAC_SIZE = 16
MAX_PRIORITY = 7
MAX_DATAGRAM = 65507  # largest UDP payload over IPv4
MAX_PAYLOAD = MAX_DATAGRAM - HEADER_SIZE

_STRUCT = struct.Struct("!HBBBBBBIIIHHHHIIIfI")
assert _STRUCT.size == MAC_OFFSET


class PacketType(enum.IntEnum):
    DATA = 1  # a sender's contribution to a shard
    RESULT = 2  # the shard owner's aggregated sums
    NACK = 3  # request for missing packets (payload: u32 packet indices, within the
    # job's payload budget: more go in several NACKs, `offset` each one's place in the list)
    DONE = 4  # end of a sender's packets for a shard (payload: droppable bitmap of its
    # packets offset .. offset+count-1, within the job's payload budget: larger shards in parts)
    ACK = 5  # a result receiver holds the whole shard; the owner may free it
    CONTROL = 6  # daemon to daemon (payload: kind u8, then per kind; kind 1, a flow-control
    # credit: epoch u64, bytes taken from the sockets u64, flags u8, window granted u64;
    # engine.credit_of, docs/operations.md; kinds 2 and 3, a path probe and its echo:
    # path u8, sequence number u32; wire/probe.py)


class Flags(enum.IntFlag):
    NONE = 0
    DROPPABLE = 0x01  # may be lost without recovery, within the loss bound
    RETRANSMIT = 0x02  # sent again in answer to a NACK
    LAST = 0x04  # the sender's last data packet of this shard in this round
    SUMMED = 0x08  # payload lanes are sums (result lane width), not single values
    RESULT_LEG = 0x10  # NACK/DONE/ACK about result packets, not data packets
    # NACK: the asker lacks the sender's DONE manifest. On the result leg: resend
    # it too. On the data leg a NACK without packets asks for it; one with packets
    # (found lost before it came) is answered with the non-droppable ones only
    NEED_MANIFEST = 0x20
    # RESULT: sent before its shard completed, its every contribution in
    # (dlcp.core.early); its place in the owner's order says nothing of others'
    EARLY = 0x40


ALL_FLAGS = int(
    Flags.DROPPABLE
    | Flags.RETRANSMIT
    | Flags.LAST
    | Flags.SUMMED
    | Flags.RESULT_LEG
    | Flags.NEED_MANIFEST
    | Flags.EARLY
)


class Codec(enum.IntEnum):
    FP32 = 0
    FP16 = 1
    THC8 = 2
    THC4 = 3
    # the sketch codec's two exchanges (dlcp/codecs/sketch.py, docs/shim-protocol.md)
    UNION = 4  # 1-bit lanes: a worker's nonzero bitmap; summed lanes are the OR
    SKETCH = 5  # fp32 count-sketch cells, summed like FP32 lanes
    # 7: kept for fft-sim's block payloads (dlcp/codecs/fft.py)
    FFT8 = 6  # fft coefficients on an agreed set: 8-bit range floats (dlcp/codecs/rangefloat.py)
    # THC's sums in the bits they need, in RESULT packets only: an owner sends a
    # shard's sums so when every sum fits (dlcp/codecs/lanes.py, narrow_sums)
    THC8_SUM10 = 8  # THC8 sums up to 1023 (4 contributions) in 10-bit lanes
    THC4_SUM8 = 9  # THC4 sums up to 255 (17 contributions) in 8-bit lanes


# Codecs of result packets only (THC's narrow sums): no bucket, layout or data
# packet has them
RESULT_ONLY_CODECS = frozenset({Codec.THC8_SUM10, Codec.THC4_SUM8})

# Bits per element on the wire: (single contribution, summed lanes).
LANE_BITS: dict[int, tuple[int, int]] = {
    Codec.FP32: (32, 32),
    Codec.FP16: (16, 16),
    Codec.THC8: (8, 16),
    Codec.THC4: (4, 16),
    Codec.UNION: (1, 1),
    Codec.SKETCH: (32, 32),
    Codec.FFT8: (8, 32),
    Codec.THC8_SUM10: (8, 10),
    Codec.THC4_SUM8: (4, 8),
}


# THC's sums in the bits they need (`dlcp.codecs.lanes.narrow_sums`)
NARROW_SUMS: dict[int, int] = {Codec.THC8: Codec.THC8_SUM10, Codec.THC4: Codec.THC4_SUM8}


def narrow_fits(codec: int, contributions: int) -> bool:
    """Whether every sum of `contributions` lanes of `codec` (each at most its
    top, 255 for THC8) fits the codec's narrow sums: thc8 up to 4, thc4 up to
    17."""
    narrow = NARROW_SUMS.get(codec)
    if narrow is None or contributions < 1:
        return False
    return contributions * ((1 << LANE_BITS[codec][0]) - 1) < 1 << LANE_BITS[narrow][1]


def narrow_top(codec: int) -> int:
    """The largest of `codec`'s narrow sums (1023 for THC8)."""
    return (1 << LANE_BITS[NARROW_SUMS[codec]][1]) - 1


def lane_bytes(codec: int, count: int, summed: bool) -> int:
    """Payload bytes of `count` lanes of `codec`."""
    bits = LANE_BITS[codec][1 if summed else 0]
    return (count * bits + 7) // 8


@dataclass(frozen=True, slots=True)
class Header:
    type: PacketType
    job: int
    round: int
    bucket: int
    flags: Flags = Flags.NONE
    priority: int = 0
    codec: Codec = Codec.FP32
    shard: int = 0
    layer: int = 0
    sender: int = 0
    contributors: int = 1
    offset: int = 0
    count: int = 0
    total: int = 0
    param: float = 0.0
    aux: int = 0

    def with_(self, **changes: object) -> Header:
        return replace(self, **changes)  # type: ignore[arg-type]

    def pack(self) -> bytes:
        """The first 48 header bytes (everything the MAC covers but the payload)."""
        try:
            return _STRUCT.pack(
                MAGIC,
                VERSION,
                int(self.type),
                int(self.flags),
                self.priority,
                int(self.codec),
                0,
                self.job,
                self.round,
                self.bucket,
                self.shard,
                self.layer,
                self.sender,
                self.contributors,
                self.offset,
                self.count,
                self.total,
                self.param,
                self.aux,
            )
        except struct.error as exc:
            raise ValueError(f"header field out of range: {exc}") from exc


def mac_key(secret: bytes | str, job: int) -> bytes:
    """Derive a job's 32-byte MAC key from a shared secret."""
    raw = secret.encode() if isinstance(secret, str) else secret
    salt = job.to_bytes(8, "big")
    return hashlib.blake2b(raw, digest_size=32, person=b"dlcp-job-key", salt=salt).digest()


def compute_mac(key: MacKey, head: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    if isinstance(key, bytes):
        return blake2b_tag(key, head, payload)
    return key.tag(head, payload)


def encode(header: Header, payload: bytes | memoryview, key: MacKey) -> bytes:
    """Serialize one packet; checks the header against the payload first."""
    head = header.pack()
    payload = memoryview(payload).cast("B")
    reason = _check(header, len(payload))
    if reason is not None:
        raise ValueError(f"invalid packet: {reason[0].label}: {reason[1]}")
    return b"".join((head, compute_mac(key, head, payload), payload))


def payload_length_ok(ptype: int, codec: int, flags: int, count: int, length: int) -> bool:
    return length == expected_payload(ptype, codec, flags, count, length)


def expected_payload(ptype: int, codec: int, flags: int, count: int, length: int) -> int:
    if ptype in (PacketType.DATA, PacketType.RESULT):
        return lane_bytes(codec, count, ptype == PacketType.RESULT or bool(flags & Flags.SUMMED))
    if ptype == PacketType.NACK:
        return 4 * count
    if ptype == PacketType.DONE:
        return (count + 7) // 8
    if ptype == PacketType.ACK:
        return 0
    return count  # CONTROL: count is the payload length


def _check(h: Header, length: int) -> tuple[Reason, str] | None:
    """Semantic checks of a parsed header; None when valid."""
    if h.priority > MAX_PRIORITY:
        return Reason.BAD_PRIORITY, f"priority {h.priority} > {MAX_PRIORITY}"
    if h.type in (PacketType.DATA, PacketType.RESULT):
        if h.count == 0:
            return Reason.BAD_RANGE, "data packet with no elements"
        if h.offset + h.count > h.total:
            return Reason.BAD_RANGE, f"elements {h.offset}+{h.count} beyond bucket of {h.total}"
        if h.contributors == 0 and h.type == PacketType.DATA:
            return Reason.BAD_RANGE, "data packet with no contributors"
    if length > MAX_PAYLOAD:
        return Reason.BAD_LENGTH, f"payload of {length} bytes exceeds {MAX_PAYLOAD}"
    want = expected_payload(h.type, h.codec, h.flags, h.count, length)
    if want != length:
        return Reason.BAD_LENGTH, f"payload is {length} bytes, header says {want}"
    if not math.isfinite(h.param):
        return Reason.BAD_RANGE, "non-finite param"
    return None


def decode(datagram: bytes | memoryview, keys: Mapping[int, MacKey]) -> tuple[Header, memoryview]:
    """Parse and authenticate one datagram; raises `WireError` with a reason.

    `keys` maps job id to MAC key (`mac.mac_state`; bytes: BLAKE2b). Returns
    the header and a view of the payload.
    """
    view = memoryview(datagram).cast("B")
    if len(view) < HEADER_SIZE:
        raise WireError(Reason.TRUNCATED, f"{len(view)} bytes < header of {HEADER_SIZE}")
    (
        magic,
        version,
        ptype,
        flags,
        priority,
        codec,
        reserved,
        job,
        rnd,
        bucket,
        shard,
        layer,
        sender,
        contributors,
        offset,
        count,
        total,
        param,
        aux,
    ) = _STRUCT.unpack_from(view)
    if magic != MAGIC:
        raise WireError(Reason.BAD_MAGIC, f"magic {magic:#06x}")
    if version != VERSION:
        raise WireError(Reason.BAD_VERSION, f"version {version}")
    if ptype not in _TYPES:
        raise WireError(Reason.BAD_TYPE, f"type {ptype}")
    if flags & ~ALL_FLAGS:
        raise WireError(Reason.BAD_FLAGS, f"flags {flags:#04x}")
    if codec not in _CODECS:
        raise WireError(Reason.BAD_CODEC, f"codec {codec}")
    if reserved:
        raise WireError(Reason.RESERVED, f"reserved byte {reserved}")
    header = Header(
        type=_TYPE_OF[ptype],
        job=job,
        round=rnd,
        bucket=bucket,
        flags=_FLAGS_OF[flags],
        priority=priority,
        codec=_CODEC_OF[codec],
        shard=shard,
        layer=layer,
        sender=sender,
        contributors=contributors,
        offset=offset,
        count=count,
        total=total,
        param=param,
        aux=aux,
    )
    payload = view[HEADER_SIZE:]
    problem = _check(header, len(payload))
    if problem is not None:
        raise WireError(*problem)
    key = keys.get(job)
    if key is None:
        raise WireError(Reason.UNKNOWN_JOB, f"job {job}")
    if not hmac.compare_digest(
        compute_mac(key, view[:MAC_OFFSET], payload), view[MAC_OFFSET:HEADER_SIZE]
    ):
        raise WireError(Reason.BAD_MAC, "MAC does not verify")
    return header, payload


def header_of_valid(datagram: bytes | memoryview) -> Header:
    """The header of a datagram that `decode_batch` (or `decode`) already accepted."""
    (
        _magic,
        _version,
        ptype,
        flags,
        priority,
        codec,
        _reserved,
        job,
        rnd,
        bucket,
        shard,
        layer,
        sender,
        contributors,
        offset,
        count,
        total,
        param,
        aux,
    ) = _STRUCT.unpack_from(datagram)
    return Header(
        _TYPE_OF[ptype],
        job,
        rnd,
        bucket,
        _FLAGS_OF[flags],
        priority,
        _CODEC_OF[codec],
        shard,
        layer,
        sender,
        contributors,
        offset,
        count,
        total,
        param,
        aux,
    )


_TYPES = frozenset(int(t) for t in PacketType)
_CODECS = frozenset(int(c) for c in Codec)
# enum construction is slow on the per-packet path: look members up instead
_TYPE_OF = {int(t): t for t in PacketType}
_CODEC_OF = {int(c): c for c in Codec}
_FLAGS_OF = {f: Flags(f) for f in range(256) if not f & ~ALL_FLAGS}
