"""The datagram size a daemon's links carry: its payload follows the MTU.

`network.mtu` in the config is a number, or "auto" (the default): the
smallest MTU of the routes to the config's peers, as the kernel's route
lookup gives it (IP_MTU of a UDP socket connected to each peer address:
the interface's MTU, or a route's own; nothing is sent). Loopback peers,
peers without a route and configs without peers give no MTU: the payload
stays `DEFAULT_PAYLOAD`, which fits a 1500-byte link. The payload is the
MTU less the IP and UDP headers and dlcp's (`payload_for`); an explicit
`network.payload` overrides it. Jobs agree on the smallest payload of
their daemons (`dlcp.shim.rendezvous`), so hosts whose links differ still
agree.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterable

from dlcp.wire.header import HEADER_SIZE, MAX_PAYLOAD

__all__ = ["MIN_MTU", "link_mtu", "payload_for", "route_mtu"]

MIN_MTU = 576  # the smallest MTU IPv4 hosts must take
_IP_MTU = getattr(socket, "IP_MTU", 14)  # linux/in.h, linux/in6.h
_IPV6_MTU = getattr(socket, "IPV6_MTU", 24)
_UDP = 8


def _ip_header(address: str) -> int:
    return 40 if ipaddress.ip_address(address).version == 6 else 20


def payload_for(mtu: int, address: str = "0.0.0.0") -> int:
    """Payload bytes of a datagram that fills an `mtu`-byte link to `address`
    (IPv4: mtu - 20 - 8 - 64; 1500 gives 1408, 9000 gives 8908)."""
    return max(64, min(MAX_PAYLOAD, mtu - _ip_header(address) - _UDP - HEADER_SIZE))


def route_mtu(address: str, port: int = 9) -> int | None:
    """The MTU of the route to `address` (None: loopback, no route, or not Linux)."""
    ip = ipaddress.ip_address(address)
    if ip.is_loopback or ip.is_unspecified:
        return None
    family, level, opt = (
        (socket.AF_INET6, socket.IPPROTO_IPV6, _IPV6_MTU)
        if ip.version == 6
        else (socket.AF_INET, socket.IPPROTO_IP, _IP_MTU)
    )
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((address, port))  # a route lookup; nothing is sent
        mtu = s.getsockopt(level, opt)
        return mtu if mtu >= MIN_MTU else None
    return None


def link_mtu(addresses: Iterable[str]) -> int | None:
    """The smallest `route_mtu` over `addresses` (None where none is known)."""
    found = [m for m in map(route_mtu, addresses) if m is not None]
    return min(found) if found else None
