"""The shim's own Gloo connections marked into the control class.

The ranks' agreement (`dlcp.shim.hedge`) is a few bytes over TCP after
every collective, and every rank's step waits for it. Unmarked, its
segments queue in the switch's best-effort class behind whatever else the
port carries: under the congested scenario's background TCP and UDP (100
Mbit/s, 3 hosts, a 0.67 MB fp32 DDP step) the agreements' p50 was 0.38-1.05
s a rank and their max 8.7 s, 20 of 23 over 0.1 s, and dlcp's step 18x
gloo-prio's. They are control traffic, as the daemons' NACKs are (class 0,
CS6 by default: `dlcp.policies.DEFAULT_DSCP`).

Gloo sets no TOS on its sockets and offers no way to, so the groups the
shim makes itself are marked from outside: the process's TCP sockets are
listed (/proc/self/fd) before and after the groups are made (Gloo
connects a group's full mesh in its constructor), and the new ones get
IP_TOS (IPV6_TCLASS) set on a duplicate of their descriptor, which sets it
on the socket itself. A socket another thread opens in that window is
marked too; the window is the groups' rendezvous. The user's own process
group is never marked. DLCP_AGREE_DSCP sets the DSCP (a number 0-63 or a
name: cs6, af41, ...); 0 leaves the sockets as Gloo made them.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterable
from typing import TypeVar

from dlcp.policies import DEFAULT_DSCP
from dlcp.tc.plan import parse_dscp

__all__ = [
    "CONTROL_DSCP",
    "DSCP_ENV",
    "dscp_from_env",
    "inet_stream_fds",
    "mark",
    "mark_new",
    "tos_of",
]

T = TypeVar("T")

DSCP_ENV = "DLCP_AGREE_DSCP"
CONTROL_DSCP = DEFAULT_DSCP[0]  # class 0: control (CS6)
_FD_DIR = "/proc/self/fd"


def dscp_from_env() -> int:
    """DLCP_AGREE_DSCP's DSCP, else `CONTROL_DSCP`; a bad value raises `LocalError`."""
    raw = os.environ.get(DSCP_ENV, "")
    return parse_dscp(raw) if raw.strip() else CONTROL_DSCP


def _socket_fds() -> set[int]:
    try:
        names = os.listdir(_FD_DIR)
    except OSError:  # no /proc: nothing is marked
        return set()
    fds = set()
    for name in names:
        try:
            if os.readlink(f"{_FD_DIR}/{name}").startswith("socket:"):
                fds.add(int(name))
        except (OSError, ValueError):  # closed meanwhile (the listing's own fd too)
            continue
    return fds


def _open(fd: int) -> socket.socket | None:
    """A socket object on a duplicate of `fd` (closing it leaves `fd` open)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _tcp(fd: int) -> socket.socket | None:
    """`_open(fd)` where `fd` is a TCP socket (IPv4 or IPv6), else None."""
    s = _open(fd)
    if s is not None and (
        s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6)
    ):
        s.close()
        return None
    return s


def inet_stream_fds() -> set[int]:
    """The process's open TCP (IPv4 and IPv6 stream) socket descriptors."""
    out = set()
    for fd in _socket_fds():
        s = _tcp(fd)
        if s is not None:
            s.close()
            out.add(fd)
    return out


def _set_tos(s: socket.socket, tos: int) -> None:
    if s.family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, tos)
        with contextlib.suppress(OSError):  # a dual-stack socket's IPv4 packets
            s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
    else:
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)


def mark(fds: Iterable[int], dscp: int) -> int:
    """Set DSCP `dscp` (ECN bits 0) on each TCP socket of `fds`; returns how
    many were marked (descriptors closed meanwhile, or not TCP, are skipped)."""
    tos, marked = dscp << 2, 0
    for fd in fds:
        s = _tcp(fd)
        if s is None:
            continue
        with s:
            try:
                _set_tos(s, tos)
            except OSError:
                continue
            marked += 1
    return marked


def mark_new(make: Callable[[], T], dscp: int) -> tuple[T, int]:
    """`make()`'s result, with the TCP connections it opened marked `dscp`
    (none with 0), and how many were."""
    if not dscp:
        return make(), 0
    before = inet_stream_fds()
    made = make()
    return made, mark(inet_stream_fds() - before, dscp)


def tos_of(fd: int) -> int | None:
    """The TOS byte (IPv6: traffic class) TCP socket `fd` sends with; None if
    `fd` is not one."""
    s = _tcp(fd)
    if s is None:
        return None
    with s:
        if s.family == socket.AF_INET6:
            return int(s.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS))
        return int(s.getsockopt(socket.IPPROTO_IP, socket.IP_TOS))
