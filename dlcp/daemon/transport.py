"""UDP sockets of the daemon: one per local path address.

Sends take a list of datagrams for one destination and TOS byte and hand each
run of equal-sized ones to the kernel as one UDP_SEGMENT (GSO) super-datagram
where the kernel allows it, else one datagram per message; with the C part
(dlcp/daemon/_udp.c) many messages go per sendmmsg call. Receives use UDP_GRO:
one recvmsg can return many coalesced datagrams plus their segment size, split
here (`split_gro`, or in C with the recvmsg calls). IP_TOS travels as
ancillary data per message, so one socket serves every priority class.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import struct
import termios
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from dlcp.wire.batch import split_segments
from dlcp.wire.header import HEADER_SIZE

try:
    from dlcp.daemon import _udp  # type: ignore[attr-defined]
except ImportError:  # not built: one sendmsg per super-datagram, from Python
    _udp = None

__all__ = [
    "MAX_GSO_SEGMENTS",
    "NATIVE_RECV",
    "NATIVE_SEND",
    "Split",
    "UdpPath",
    "merge_splits",
    "split_gro",
]

SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104
MAX_GSO_SEGMENTS = 64
MAX_GSO_BYTES = 65000
_INT = struct.Struct("@i")
_ZERO = bytes(_INT.size)  # an int 0 (FIONREAD's argument and empty answer)
_U16 = struct.Struct("@H")
_RECV_SIZE = 65535
_CMSG_SPACE = socket.CMSG_SPACE(_INT.size)
# The grouping below, done in C with batches of sendmmsg (dlcp/daemon/_udp.c,
# built by setup.py): one call per flush instead of one per super-datagram.
# DLCP_NATIVE_SEND=0 turns it off.
NATIVE_SEND = _udp is not None and os.environ.get("DLCP_NATIVE_SEND", "1") != "0"
_SENT_ALL = 0
_FULL = frozenset((errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS))
# ... and receives: recvmsg and `split_gro` in one C call per readable event
# (DLCP_NATIVE_RECV=0 turns it off).
NATIVE_RECV = _udp is not None and os.environ.get("DLCP_NATIVE_RECV", "1") != "0"
_JOB_IDS = np.dtype(">u4")  # the header's job field (bytes 8-11)

# One GRO buffer (or, from `_udp.recv_runs`, a run of them: `merge_splits`)
# as the daemon takes it: its datagrams (a list of memoryviews,
# or from the C split a `dlcp.wire._bulk.Datagrams`: the same bytes as a
# sequence, with no object per datagram), its bytes, how many of the
# datagrams hold a whole header (all but a shorter last one, or none), the
# job those name (one int when they all name the same one, -1 when there are
# none, else the list of each one's), their type bytes, and the source IP.
Split = tuple[Sequence[memoryview], int, int, "int | list[int]", bytes, str]


def split_gro(data: bytes, seg: int) -> tuple[list[memoryview], int, int, int | list[int], bytes]:
    """`Split` of a buffer from recvmsg (`seg`: its GRO segment size, 0: none),
    less the source. The definition `_udp.split_gro` is held to."""
    segs = split_segments(data, seg)
    size = len(data)
    k = len(segs)
    if k == 1:  # one datagram, however long
        seg = size
    last = size - (k - 1) * seg
    full = 0 if seg < HEADER_SIZE else k if last >= HEADER_SIZE else k - 1
    if not full:
        return segs, size, 0, -1, b""
    ids: list[int] = np.ndarray((full,), _JOB_IDS, data, 8, (seg,)).tolist()
    job: int | list[int] = ids[0] if ids.count(ids[0]) == full else ids
    return segs, size, full, job, data[3 : (full - 1) * seg + 4 : seg]


def merge_splits(splits: Sequence[Split]) -> list[Split]:
    """`splits` with each run of consecutive ones that `NetworkIn._receive` can
    take as one joined: from one source, all their datagrams of one size but a
    shorter last one, each with a whole header naming one job. A split joins the
    one before it when that one's datagrams (a run's, its last buffer's) all
    have that size, and its own are of it. The definition `_udp.recv_runs` is
    held to (it joins them into one `Datagrams` over the buffers)."""
    out: list[Split] = []
    open_ = False  # whether the last split of `out` may be continued
    for segs, size, full, job, kinds, src in splits:
        k = len(segs)
        d = len(segs[0])
        joins = isinstance(job, int) and full == k
        if open_ and joins:
            psegs, psize, pfull, pjob, pkinds, psrc = out[-1]
            if pjob == job and psrc == src and len(psegs[0]) == d:
                out[-1] = ([*psegs, *segs], psize + size, pfull + full, job, pkinds + kinds, src)
                open_ = len(segs[-1]) == d
                continue
        out.append((segs, size, full, job, kinds, src))
        open_ = joins and len(segs[-1]) == d
    return out


def _buffers(datagrams: Sequence[Any]) -> list[Any]:
    """The buffers of `datagrams` for sendmsg: a `Gathered` datagram (made by
    `GhashAesKey.encode_gather`) is two, its header and its payload in place."""
    out: list[Any] = []
    for dg in datagrams:
        if isinstance(dg, bytes | bytearray | memoryview):
            out.append(dg)
        else:
            out += (dg.head, dg.payload)
    return out


def _native_dest(dest: tuple[str, int]) -> tuple[bytes, int] | None:
    """`dest` as `_udp.send_gso` takes it (IPv4 address bytes, port), or None
    where it takes no such address (names go through Python)."""
    try:
        return socket.inet_aton(dest[0]), int(dest[1])
    except (OSError, ValueError, TypeError, IndexError):
        return None


class UdpPath:
    """A non-blocking UDP socket bound to one local path address."""

    def __init__(
        self,
        address: str,
        port: int,
        *,
        gso: bool = True,
        gro: bool = True,
        buffer_bytes: int = 8 << 20,
    ) -> None:
        self.address = address
        self.port = port
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            # no SO_REUSEADDR: with it a second daemon on the same address and
            # port would bind too and take part of the first one's datagrams
            for force, opt in ((33, socket.SO_RCVBUF), (32, socket.SO_SNDBUF)):
                try:  # SO_RCVBUFFORCE/SO_SNDBUFFORCE pass net.core.*mem_max with CAP_NET_ADMIN
                    self.sock.setsockopt(socket.SOL_SOCKET, force, buffer_bytes)
                except OSError:
                    with contextlib.suppress(OSError):
                        self.sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
            try:
                self.sock.bind((address, port))
            except OSError as exc:
                raise OSError(
                    exc.errno, f"cannot bind UDP {address}:{port}: {exc.strerror}"
                ) from exc
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise
        self.gso = gso
        self.gro = False
        if gro:
            try:
                self.sock.setsockopt(SOL_UDP, UDP_GRO, 1)
                self.gro = True
            except OSError:
                pass
        self.gso_max_size = 65507  # largest segment GSO batching was accepted for
        self.native_send = NATIVE_SEND
        self.native_recv = NATIVE_RECV
        self._dests: dict[tuple[str, int], tuple[bytes, int] | None] = {}
        self.oversize_drops = 0
        self.sendmsg_calls = 0
        self.recvmsg_calls = 0  # buffers received (in C several come per recvmmsg call)

    def fileno(self) -> int:
        return self.sock.fileno()

    def empty(self) -> bool:
        """Whether no datagram waits in the socket now (FIONREAD: the next
        datagram's size, 0 when there is none; False on an error: no
        telling)."""
        try:
            return fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, _ZERO) == _ZERO
        except OSError:
            return False

    def close(self) -> None:
        self.sock.close()

    # -- send ---------------------------------------------------------------
    def send(self, datagrams: Sequence[bytes], dest: tuple[str, int], tos: int) -> int:
        """Send as many of `datagrams` as the socket takes now; returns how many.

        Stops early (returning the count sent) when the socket buffer is full.
        Consecutive datagrams of one size (and a shorter last one) go as one
        UDP_SEGMENT super-datagram of at most MAX_GSO_SEGMENTS segments and
        MAX_GSO_BYTES bytes.
        """
        if self.native_send and datagrams:
            # in C (`_udp.send_gso`), to IPv4 addresses: all go, or as many as
            # the socket takes; else (a name, an error) `_send_each` goes on
            # from what went and deals with the error as it always has
            addr = self._dests.get(dest, b"")
            if addr == b"":
                addr = self._dests[dest] = _native_dest(dest)
            if addr is None:
                return self._send_each(datagrams, dest, tos, 0)
            sent, calls, err = _udp.send_gso(
                self.sock.fileno(),
                datagrams if type(datagrams) is list else list(datagrams),
                0,
                addr[0],
                addr[1],
                tos,
                self.gso,
                self.gso_max_size,
            )
            self.sendmsg_calls += calls
            if err == _SENT_ALL or err in _FULL:
                return sent
            return self._send_each(datagrams, dest, tos, sent)
        return self._send_each(datagrams, dest, tos, 0)

    def _send_each(
        self, datagrams: Sequence[bytes], dest: tuple[str, int], tos: int, sent: int
    ) -> int:
        """`send` from datagram `sent` on, one sendmsg per super-datagram."""
        n = len(datagrams)
        tos_cmsg = (socket.IPPROTO_IP, socket.IP_TOS, _INT.pack(tos))
        while sent < n:
            size = len(datagrams[sent])
            k = 1
            if self.gso and size <= self.gso_max_size:
                limit = min(MAX_GSO_SEGMENTS, max(1, MAX_GSO_BYTES // size))
                while k < limit and sent + k < n and len(datagrams[sent + k]) == size:
                    k += 1
                # a shorter last segment is allowed
                if k < limit and sent + k < n and len(datagrams[sent + k]) < size:
                    k += 1
            try:
                if k > 1:
                    self.sock.sendmsg(  # gathered by the kernel: no joined copy here
                        _buffers(datagrams[sent : sent + k]),
                        [tos_cmsg, (SOL_UDP, UDP_SEGMENT, _U16.pack(size))],
                        0,
                        dest,
                    )
                else:
                    self.sock.sendmsg(_buffers([datagrams[sent]]), [tos_cmsg], 0, dest)
            except BlockingIOError:
                return sent
            except OSError as exc:
                if k > 1 and exc.errno == errno.EMSGSIZE:
                    # segments larger than the path MTU cannot be GSO-batched
                    self.gso_max_size = min(self.gso_max_size, size - 1)
                    continue
                if k > 1 and exc.errno in (errno.EINVAL, errno.EIO, errno.ENOPROTOOPT):
                    self.gso = False  # the kernel or device cannot segment: plain sends
                    continue
                if exc.errno == errno.EMSGSIZE:  # too large for any path: drop, count
                    self.oversize_drops += 1
                    sent += 1
                    continue
                if exc.errno in (errno.ENOBUFS, errno.EAGAIN):
                    return sent
                if exc.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH):
                    sent += k  # the peer is not there (yet): the datagrams are lost
                    continue
                raise
            self.sendmsg_calls += 1
            sent += k
        return sent

    # -- receive ------------------------------------------------------------
    def receive_buffers(self, budget: int = 64) -> list[tuple[bytes, int, str]]:
        """What up to `budget` recvmsg calls return now: (buffer, GRO segment
        size or 0, source IP) each. A buffer holds one datagram, or with a
        segment size `seg` (0 < seg < len) consecutive datagrams of `seg`
        bytes from one source, the last possibly shorter (`split_segments`)."""
        recvmsg = self.sock.recvmsg
        out: list[tuple[bytes, int, str]] = []
        for _ in range(budget):
            try:
                data, ancdata, _flags, addr = recvmsg(_RECV_SIZE, _CMSG_SPACE)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionRefusedError:  # ICMP from an earlier send
                continue
            seg = 0
            for level, kind, value in ancdata:
                if level == SOL_UDP and kind == UDP_GRO:
                    seg = _INT.unpack_from(value.ljust(_INT.size, b"\0"))[0]
            out.append((data, seg, addr[0]))
        self.recvmsg_calls += len(out)
        return out

    def receive_split(self, budget: int = 64) -> list[Split]:
        """`receive_buffers`, each buffer as `split_gro` makes it, with its
        source; in C (recvmmsg) each run of buffers `merge_splits` joins is one
        split."""
        if self.native_recv:
            buffers, out = _udp.recv_runs(self.sock.fileno(), budget)
            self.recvmsg_calls += buffers
            return out
        return [(*split_gro(data, seg), src) for data, seg, src in self.receive_buffers(budget)]

    def receive_drain(self, chunk: int, max_bytes: int) -> Any:
        """One poll's drain in one C call (`dlcp.daemon.poll.Drain`: `_udp.recv_drain`,
        `chunk` buffers a recvmmsg batch while they come full and, with
        max_bytes > 0, the drain is under max_bytes); None, taking nothing,
        where the C receive is off."""
        if not self.native_recv:
            return None
        drain = _udp.recv_drain(self.sock.fileno(), chunk, max_bytes)
        self.recvmsg_calls += drain[0]
        return drain

    def receive(self, budget: int = 64) -> Iterator[tuple[memoryview, str]]:
        """Datagrams waiting on the socket (GRO super-datagrams split), with source IP."""
        for data, seg, src in self.receive_buffers(budget):
            for dg in split_segments(data, seg):
                yield dg, src
