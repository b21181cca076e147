"""A scapy layer for the dlcp packet: `DLCP`, bound under UDP on the daemon's port.

    from scapy.layers.inet import IP, UDP
    from dlcp.wire.dissector import DLCP, bind, seal

    pkt = IP(raw_bytes)              # ... / UDP / DLCP / Raw (the payload lanes)
    pkt[DLCP].type, pkt[DLCP].flags  # 'DATA', <Flag 5 (DROPPABLE+LAST)>
    bind(7401)                       # also dissect another port (both directions)
    built = seal(DLCP(type="DATA", job=7, round=1, count=4, total=4) / lanes, key)

Every header field of `dlcp.wire.header` by the same name (the struct `_STRUCT`
then the 16-byte `mac`); type and codec as enums, flags as a FlagsField. The
payload after the 64-byte header is left to scapy's `Raw`. The layer does not
check anything: `dlcp.wire.decode` does (magic, version, ranges, length, MAC).
Importing this module binds the default daemon port (`Config.udp_port`, 7400).
"""

from __future__ import annotations

from scapy.fields import (
    ByteEnumField,
    ByteField,
    FlagsField,
    IEEEFloatField,
    IntField,
    ShortField,
    XByteField,
    XIntField,
    XShortField,
    XStrFixedLenField,
)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_bottom_up, bind_layers

from dlcp.wire.header import (
    HEADER_SIZE,
    MAC_OFFSET,
    MAC_SIZE,
    MAGIC,
    VERSION,
    Codec,
    Flags,
    PacketType,
    compute_mac,
)
from dlcp.wire.mac import MacKey

__all__ = ["DEFAULT_PORT", "DLCP", "FLAG_NAMES", "bind", "flag_names", "seal"]

DEFAULT_PORT = 7400  # dlcp.daemon.config.Config.udp_port (not imported: keeps this light)

# Bit i of the flags byte is FLAG_NAMES[i]; the unused bit gets a placeholder
# (a packet with them set is rejected by the decoder, bad_flags).
_FLAG_OF_BIT = {int(f): str(f.name) for f in Flags if int(f)}
FLAG_NAMES: list[str] = [_FLAG_OF_BIT.get(1 << i, f"BIT{i}") for i in range(8)]


class DLCP(Packet):
    """The 64-byte dlcp header (see `dlcp.wire.header` for the layout)."""

    name = "DLCP"
    fields_desc = [
        XShortField("magic", MAGIC),
        ByteField("version", VERSION),
        ByteEnumField("type", int(PacketType.DATA), {int(t): t.name for t in PacketType}),
        FlagsField("flags", 0, 8, FLAG_NAMES),
        ByteField("priority", 0),
        ByteEnumField("codec", int(Codec.FP32), {int(c): c.name for c in Codec}),
        XByteField("reserved", 0),
        IntField("job", 0),
        IntField("round", 0),
        IntField("bucket", 0),
        ShortField("shard", 0),
        ShortField("layer", 0),
        ShortField("sender", 0),
        ShortField("contributors", 1),
        IntField("offset", 0),
        IntField("count", 0),
        IntField("total", 0),
        IEEEFloatField("param", 0),
        XIntField("aux", 0),
        XStrFixedLenField("mac", bytes(MAC_SIZE), MAC_SIZE),
    ]

    def mysummary(self) -> str:
        return str(
            self.sprintf(
                "DLCP %DLCP.type% job=%DLCP.job% round=%DLCP.round% bucket=%DLCP.bucket% "
                "shard=%DLCP.shard% sender=%DLCP.sender% off=%DLCP.offset% n=%DLCP.count%"
            )
        )


assert len(DLCP()) == HEADER_SIZE


def flag_names(value: int) -> list[str]:
    """The names of the set bits of a flags byte, lowest bit first."""
    return [FLAG_NAMES[i] for i in range(8) if value >> i & 1]


def seal(pkt: DLCP, key: MacKey) -> DLCP:
    """A copy of `pkt` (with its payload) whose `mac` is the job key's tag, as
    `dlcp.wire.encode` computes it (raw key bytes: BLAKE2b; `mac.mac_state`)."""
    raw = bytes(pkt)
    tag = compute_mac(key, raw[:MAC_OFFSET], raw[HEADER_SIZE:])
    return DLCP(raw[:MAC_OFFSET] + tag + raw[HEADER_SIZE:])


_BOUND: set[int] = set()


def bind(port: int) -> None:
    """Dissect UDP datagrams from or to `port` as DLCP (idempotent). Building
    `UDP() / DLCP()` sets both ports to the last port bound."""
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be 1..65535, not {port}")
    if port in _BOUND:
        return
    # the first two: either direction is enough when dissecting; the last also
    # makes UDP()/DLCP() fill in sport and dport
    bind_bottom_up(UDP, DLCP, sport=port)
    bind_bottom_up(UDP, DLCP, dport=port)
    bind_layers(UDP, DLCP, sport=port, dport=port)
    _BOUND.add(port)


bind(DEFAULT_PORT)
