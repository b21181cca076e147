"""The UDP paths' C parts (dlcp/daemon/_udp.c) against their Python
definitions in dlcp.daemon.transport:

- `UdpPath.send` (batches of sendmmsg) against its Python loop (one sendmsg
  per super-datagram): over loopback, the same datagrams arrive in the same
  order, cut into the same GSO super-datagrams (seen by a receiver with
  UDP_GRO, which gets each one whole), with the same sendmsg count, and the
  errors the Python loop deals with (a datagram too large for UDP, a
  destination given by name) are dealt with the same way;
- `_udp.split_gro` against `transport.split_gro` on GRO buffers of every
  shape (segment sizes around the header's, shorter last datagrams, single
  datagrams, several jobs in one buffer), and over loopback `_udp.recv_gro`
  (recvmmsg and the split in one call) against recvmsg and the Python split,
  and `UdpPath.receive_split` in C (`_udp.recv_runs`: runs of buffers of one
  source, job and datagram size joined) against `transport.merge_splits` of
  those.

The project's install builds the extension (setup.py), so its absence fails
here; set DLCP_ALLOW_NO_NATIVE=1 to run the suite where it cannot be built.
"""

from __future__ import annotations

import itertools
import os
import random
import select
import socket
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from dlcp.codecs import lanes
from dlcp.daemon import transport
from dlcp.daemon.transport import (
    MAX_GSO_BYTES,
    MAX_GSO_SEGMENTS,
    UdpPath,
    merge_splits,
    split_gro,
)
from dlcp.wire.header import HEADER_SIZE

SEGMENT = memoryview if lanes._bulk is None else lanes._bulk.Segment

if transport._udp is None and os.environ.get("DLCP_ALLOW_NO_NATIVE") == "1":
    pytest.skip("dlcp.daemon._udp is not built (DLCP_ALLOW_NO_NATIVE=1)", allow_module_level=True)


@pytest.fixture
def pair() -> Iterator[tuple[UdpPath, UdpPath]]:
    """A sender and a receiver (UDP_GRO on) on loopback, ephemeral ports."""
    tx = UdpPath("127.0.0.1", 0)
    rx = UdpPath("127.0.0.1", 0)
    try:
        yield tx, rx
    finally:
        tx.close()
        rx.close()


def _drain(rx: UdpPath, expect_bytes: int) -> list[tuple[bytes, int]]:
    """(buffer, GRO segment size) of everything that arrives, until
    `expect_bytes` have (loopback delivers at once; the wait is a safety net)."""
    got: list[tuple[bytes, int]] = []
    total = 0
    while total < expect_bytes:
        ready, _, _ = select.select([rx.sock], [], [], 5.0)
        assert ready, f"only {total} of {expect_bytes} bytes arrived"
        for data, seg, _src in rx.receive_buffers(256):
            got.append((data, seg))
            total += len(data)
    return got


def _split(bufs: list[tuple[bytes, int]]) -> list[bytes]:
    out: list[bytes] = []
    for data, seg in bufs:
        if seg and seg < len(data):
            out += [data[i : i + seg] for i in range(0, len(data), seg)]
        else:
            out.append(data)
    return out


def _mix(seed: int) -> list[bytes]:
    """Runs of equal sizes (long and short ones, jumbo and small), a shorter
    last datagram after some runs, a longer one after others, single ones."""
    rng = random.Random(seed)
    out: list[bytes] = []
    while sum(map(len, out)) < 2_000_000:  # well within the receiver's 8 MB buffer
        size = rng.choice((64, 100, 1472, 8972, 9000, 20000, 40000))
        run = min(rng.choice((1, 2, 6, 7, 8, 45, 70)), 300_000 // size + 1)
        out += [rng.randbytes(size) for _ in range(run)]
        tail = rng.random()
        if tail < 0.3:
            out.append(rng.randbytes(rng.randrange(1, size)))  # a shorter last one
        elif tail < 0.5:
            out.append(rng.randbytes(min(65000, size + rng.randrange(1, 500))))
    return out


def _send(tx: UdpPath, rx: UdpPath, dgs: list[bytes], native: bool) -> list[tuple[bytes, int]]:
    """Send `dgs` natively or not; what arrived (buffers and GRO segment
    sizes) and, last, the sendmsg count."""
    tx.native_send = native
    calls = tx.sendmsg_calls
    assert tx.send(dgs, ("127.0.0.1", rx.sock.getsockname()[1]), 0x88) == len(dgs)
    bufs = _drain(rx, sum(map(len, dgs)))
    assert _split(bufs) == dgs
    return [(b, seg) for b, seg in bufs] + [(b"calls", tx.sendmsg_calls - calls)]


@pytest.mark.parametrize("seed", range(4))
def test_native_sends_the_same_super_datagrams_as_the_python_loop(
    pair: tuple[UdpPath, UdpPath], seed: int
) -> None:
    tx, rx = pair
    assert transport._udp is not None, "dlcp.daemon._udp was not built: pip install -e . builds it"
    dgs = _mix(seed)
    by_c = _send(tx, rx, dgs, native=True)
    by_py = _send(tx, rx, dgs, native=False)
    assert [(len(b), s) for b, s in by_c] == [(len(b), s) for b, s in by_py]
    assert by_c == by_py
    assert [len(b) for b, _ in by_c[:-1]] == _groups(dgs)
    assert by_c[-1] == (b"calls", len(_groups(dgs)))


def _ghash_built() -> bool:
    from dlcp.wire import mac

    return mac._ghash is not None


def _gathered_mix(seed: int) -> tuple[list[bytes], list[bytes]]:
    """`_mix` with about half the datagrams of 64 bytes or more made Gathered
    (their header bytes and their payload read in place from one buffer, the
    tag not yet computed), and the same datagrams as bytes (tags included)."""
    import numpy as np

    from dlcp.wire.mac import GhashAesKey
    from dlcp.wire.slices import Slices

    key = GhashAesKey(bytes(range(32)))
    rng = random.Random(seed)
    dgs: list[bytes] = _mix(seed)
    pick = [i for i, dg in enumerate(dgs) if len(dg) >= HEADER_SIZE and rng.random() < 0.5]
    store = bytearray(b"".join(dgs[i][HEADER_SIZE:] for i in pick))
    lengths = np.array([len(dgs[i]) - HEADER_SIZE for i in pick], np.int64)
    starts = np.cumsum(lengths) - lengths
    heads = b"".join(dgs[i][:HEADER_SIZE] for i in pick)
    made = key.encode_gather(heads, Slices(memoryview(store), starts, lengths))
    copied = key.encode(heads, Slices(memoryview(store), starts, lengths))
    want = list(dgs)
    for i, g, b in zip(pick, made, copied, strict=True):
        dgs[i], want[i] = g, b
    return dgs, want


@pytest.mark.skipif(
    transport._udp is None or not _ghash_built(), reason="dlcp.wire._ghash is not built"
)
@pytest.mark.parametrize("seed", range(3))
def test_gathered_datagrams_go_as_their_bytes_joined(
    pair: tuple[UdpPath, UdpPath], seed: int
) -> None:
    """A Gathered datagram (header bytes, payload in place) goes as two iovecs
    in C and two buffers in Python, its tag computed on the way: the receiver
    gets the bytes the copying encoder makes, in the same super-datagrams as
    those bytes would make."""
    tx, rx = pair
    dest = ("127.0.0.1", rx.sock.getsockname()[1])
    for native in (True, False):
        dgs, joined = _gathered_mix(seed)  # untagged until sent
        assert any(not isinstance(dg, bytes) for dg in dgs)
        tx.native_send = native
        calls = tx.sendmsg_calls
        assert tx.send(dgs, dest, 0x88) == len(dgs)
        bufs = _drain(rx, sum(map(len, joined)))
        assert _split(bufs) == joined
        assert [len(b) for b, _ in bufs] == _groups(joined)
        assert tx.sendmsg_calls - calls == len(_groups(joined))


@pytest.mark.skipif(
    transport._udp is None or not _ghash_built(), reason="dlcp.wire._ghash is not built"
)
def test_a_send_keeps_no_reference_to_its_datagrams(pair: tuple[UdpPath, UdpPath]) -> None:
    """send_gso holds each Gathered datagram (a reference) and views each
    other one only while it sends: afterwards, and after an item it cannot
    send stops it half-way (those before it taken, one of them put back
    when the next did not fit its super-datagram), every count is as
    before."""
    udp = transport._udp
    assert udp is not None
    tx, rx = pair
    port = rx.sock.getsockname()[1]
    dgs, joined = _gathered_mix(5)
    before = [sys.getrefcount(dg) for dg in dgs]
    sent, _calls, err = udp.send_gso(tx.sock.fileno(), dgs, 0, b"\x7f\0\0\1", port, 0, True, 65507)
    assert (sent, err) == (len(dgs), 0)
    assert [sys.getrefcount(dg) for dg in dgs] == before
    assert _split(_drain(rx, sum(map(len, joined)))) == joined
    with pytest.raises(TypeError):
        udp.send_gso(tx.sock.fileno(), [*dgs, 3], 0, b"\x7f\0\0\1", port, 0, True, 65507)
    assert [sys.getrefcount(dg) for dg in dgs] == before


@pytest.mark.skipif(
    transport._udp is None or not _ghash_built(), reason="dlcp.wire._ghash is not built"
)
def test_runs_of_gathered_datagrams_are_sealed_together_as_each_alone(
    pair: tuple[UdpPath, UdpPath],
) -> None:
    """The C send seals a Gathered datagram with the unsealed ones of its key
    that follow it (their tags' AES blocks at once, dlcp/wire/gathered.h):
    runs of every length around that batch, of two keys, a datagram already
    sealed amid them and bytes between them, arrive as the copying encoder
    makes each of them."""
    import numpy as np

    from dlcp.wire.mac import GhashAesKey
    from dlcp.wire.slices import Slices

    tx, rx = pair
    dest = ("127.0.0.1", rx.sock.getsockname()[1])
    keys = [GhashAesKey(bytes(range(32))), GhashAesKey(bytes(range(1, 33)))]
    rng = random.Random(5)
    dgs: list[bytes] = []
    want: list[bytes] = []
    for run in (1, 7, 8, 9, 16, 17, 3, 30):
        key = keys[run % 2]
        size = 200 + 16 * rng.randrange(4)  # one size per run: its own super-datagrams
        store = bytearray(rng.randbytes(run * size))
        lengths = np.full(run, size, np.int64)
        starts = np.arange(run, dtype=np.int64) * size
        heads = bytes(rng.randbytes(HEADER_SIZE * run))
        made = key.encode_gather(heads, Slices(memoryview(store), starts, lengths))
        if run == 17:
            bytes(made[4])  # read whole: sealed before the send
        dgs += made
        want += key.encode(heads, Slices(memoryview(store), starts, lengths))
        dgs.append(b"between" * 3)
        want.append(b"between" * 3)
    assert tx.send(dgs, dest, 0) == len(dgs)
    assert _split(_drain(rx, sum(map(len, want)))) == want


def _groups(dgs: list[bytes]) -> list[int]:
    """Bytes of each super-datagram the rule makes: a run of equal sizes, plus
    one shorter datagram after it, within MAX_GSO_SEGMENTS and MAX_GSO_BYTES."""
    out: list[int] = []
    i = 0
    while i < len(dgs):
        size = len(dgs[i])
        limit = min(MAX_GSO_SEGMENTS, max(1, MAX_GSO_BYTES // size))
        j = i + 1
        while j - i < limit and j < len(dgs) and len(dgs[j]) == size:
            j += 1
        if j - i < limit and j < len(dgs) and len(dgs[j]) < size:
            j += 1
        out.append(sum(map(len, dgs[i:j])))
        i = j
    assert len(out) < len(dgs), "the mix has nothing to group"
    return out


def test_without_gso_every_datagram_goes_alone(pair: tuple[UdpPath, UdpPath]) -> None:
    tx, rx = pair
    tx.gso = False
    dgs = [bytes([i]) * 1000 for i in range(50)]
    by_c = _send(tx, rx, dgs, native=True)
    assert by_c[-1] == (b"calls", 50)
    assert all(seg in (0, len(b)) for b, seg in by_c[:-1])


def test_a_datagram_too_large_for_udp_is_dropped_and_counted_the_rest_go(
    pair: tuple[UdpPath, UdpPath],
) -> None:
    tx, rx = pair
    port = rx.sock.getsockname()[1]
    dgs = [b"a" * 9000] * 5 + [b"x" * 65508] + [b"b" * 9000] * 5
    for native in (True, False):
        tx.native_send = native
        drops = tx.oversize_drops
        assert tx.send(dgs, ("127.0.0.1", port), 0) == len(dgs)
        assert tx.oversize_drops == drops + 1
        assert _split(_drain(rx, 10 * 9000)) == dgs[:5] + dgs[6:]


def test_a_destination_by_name_goes_through_python(pair: tuple[UdpPath, UdpPath]) -> None:
    tx, rx = pair
    port = rx.sock.getsockname()[1]
    dgs = [b"n" * 3000] * 10
    assert tx.send(dgs, ("localhost", port), 0) == 10
    assert _split(_drain(rx, 30000)) == dgs
    assert tx._dests[("localhost", port)] is None


def test_bad_arguments_raise() -> None:
    udp = transport._udp
    assert udp is not None, "dlcp.daemon._udp was not built: pip install -e . builds it"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        with pytest.raises(ValueError):
            udp.send_gso(s.fileno(), [b"x"], 0, b"\x7f\0\0", 9, 0, True, 65507)
        with pytest.raises(IndexError):
            udp.send_gso(s.fileno(), [b"x"], 2, b"\x7f\0\0\1", 9, 0, True, 65507)
        with pytest.raises(TypeError):
            udp.send_gso(s.fileno(), [b"x", 3], 0, b"\x7f\0\0\1", 9, 0, True, 65507)
        with pytest.raises(TypeError):
            udp.send_gso(s.fileno(), (b"x",), 0, b"\x7f\0\0\1", 9, 0, True, 65507)
    finally:
        s.close()


def _gro_buffers(seed: int) -> list[tuple[bytes, int]]:
    """(buffer, GRO segment size) of every shape `split_gro` meets."""
    rng = random.Random(seed)
    out: list[tuple[bytes, int]] = [(b"", 0), (b"x", 0), (b"y" * 63, 0), (b"z" * 64, 64)]
    for _ in range(300):
        seg = rng.choice((1, 5, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1, 100, 1500, 8972))
        k = rng.choice((1, 1, 2, 7, 45))
        jobs = [rng.choice((7, 7, 7, 0xDEADBEEF))] * k if rng.random() < 0.7 else None
        parts = []
        for i in range(k):
            dg = bytearray(rng.randbytes(seg))
            if len(dg) >= 12:
                job = jobs[i] if jobs else rng.choice((7, 8, 0xFFFFFFFF))
                dg[8:12] = job.to_bytes(4, "big")
            parts.append(bytes(dg))
        if rng.random() < 0.4:  # a shorter last one, sometimes without a whole header
            parts[-1] = parts[-1][: rng.choice((1, 11, HEADER_SIZE - 1, HEADER_SIZE, seg - 1))]
        data = b"".join(parts)
        gro = rng.choice((0, seg)) if k == 1 else seg
        out.append((data, gro if rng.random() < 0.9 else len(data)))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_native_split_is_the_python_split(seed: int) -> None:
    udp = transport._udp
    assert udp is not None, "dlcp.daemon._udp was not built: pip install -e . builds it"
    kinds = set()
    for data, seg in _gro_buffers(seed):
        want = split_gro(data, seg)
        got = udp.split_gro(data, seg)
        assert [bytes(v) for v in got[0]] == [bytes(v) for v in want[0]], (len(data), seg)
        assert got[1:] == want[1:], (len(data), seg)
        # each a Segment of the buffer (dlcp/wire/segment.h; a memoryview slice
        # where dlcp.wire._bulk is not built): no copy
        assert all(isinstance(v, SEGMENT) and v.obj is data for v in got[0])
        kinds.add((want[2] > 0, isinstance(want[3], list), want[2] == len(want[0])))
    # none full; one job, all full; one job, a short last; several jobs
    assert {(False, False, False), (True, False, True), (True, False, False)} <= kinds
    assert any(several for _, several, _ in kinds)


def _plain(split: tuple[object, ...]) -> tuple[object, ...]:
    segs, *rest = split
    return ([bytes(v) for v in segs], *rest)  # type: ignore[attr-defined]


def test_native_receive_is_recvmsg_and_the_python_split(pair: tuple[UdpPath, UdpPath]) -> None:
    """The same buffers sent three times over loopback and taken in drains of
    7: by recvmsg and the Python split, by `_udp.recv_gro` (recvmmsg and the
    split in C) and by `receive_split` in C (`_udp.recv_runs`, which also
    joins runs of buffers). recv_gro gives what Python does, buffer for
    buffer; each drain of recv_runs is `merge_splits` of those same buffers."""
    tx, rx = pair
    port = rx.sock.getsockname()[1]
    udp = transport._udp
    assert udp is not None, "dlcp.daemon._udp was not built: pip install -e . builds it"
    drains: dict[str, list[tuple[list[tuple[object, ...]], int]]] = {}
    other = UdpPath("127.0.0.2", 0)  # a second source: a run is one source's
    try:
        for mode in ("python", "gro", "runs"):
            rx.native_recv = mode == "runs"
            sent = 0
            for i, (data, seg) in enumerate(_gro_buffers(9)[4:80]):
                if not data:
                    continue
                dgs = [data[i : i + seg] for i in range(0, len(data), seg)] if seg else [data]
                by = other if i % 5 == 4 else tx
                assert by.send(dgs, ("127.0.0.1", port), 0) == len(dgs)
                sent += len(data)
                # twice more from the usual one: runs of one shape, among them
                # buffers with a shorter last datagram (i = 18, 58), which end a run
                for _ in range(2 if i % 5 == 4 or i % 4 == 2 else 0):
                    assert tx.send(dgs, ("127.0.0.1", port), 0) == len(dgs)
                    sent += len(data)
            total = 0
            drains[mode] = []
            while total < sent:
                ready, _, _ = select.select([rx.sock], [], [], 5.0)
                assert ready, f"only {total} of {sent} bytes arrived"
                calls = rx.recvmsg_calls
                if mode == "gro":
                    out = udp.recv_gro(rx.sock.fileno(), 7)
                    buffers = len(out)
                else:
                    out = rx.receive_split(7)
                    buffers = rx.recvmsg_calls - calls
                assert 0 < buffers <= 7
                drains[mode].append(([_plain(x) for x in out], buffers))
                total += sum(x[1] for x in out)
    finally:
        other.close()
    each = [x for out, n in drains["python"] for x in out]
    assert all(len(out) == n for out, n in drains["python"])  # one split a buffer
    assert [x for out, _ in drains["gro"] for x in out] == each
    assert {src for *_, src in each} == {"127.0.0.1", "127.0.0.2"}  # type: ignore[misc]
    at = 0
    for out, n in drains["runs"]:
        assert out == merge_splits(each[at : at + n])
        at += n
    assert at == len(each)
    assert sum(len(out) for out, _ in drains["runs"]) < len(each)  # some runs were joined


@pytest.mark.parametrize("seed", range(3))
def test_merge_splits_joins_what_one_engine_run_can_take(seed: int) -> None:
    """`merge_splits` keeps every datagram, byte and type byte in order, and
    each split it makes is one source's, one job's (or what it was given), of
    datagrams all of one size but the last; it joins every pair of
    consecutive splits that could be one so."""
    rng = random.Random(seed)
    shapes = [(d, g) for d, g in _gro_buffers(seed) if d]
    # shapes a run can go on after (one job, all of one size): often repeated
    common = [(d, g) for d, g in shapes if _open(split_gro(d, g))][:3]
    assert common
    splits = []
    for _ in range(400):
        data, seg = rng.choice(shapes) if rng.random() < 0.3 else rng.choice(common)
        splits.append((*split_gro(data, seg), rng.choice(("10.0.0.1", "10.0.0.1", "10.0.0.2"))))
    got = merge_splits(splits)
    flat = [bytes(v) for s in splits for v in s[0]]
    assert [bytes(v) for s in got for v in s[0]] == flat
    assert b"".join(s[4] for s in got) == b"".join(s[4] for s in splits)
    assert sum(s[1] for s in got) == sum(s[1] for s in splits)
    assert sum(s[2] for s in got) == sum(s[2] for s in splits)
    assert len(got) < len(splits)
    for segs, size, full, job, kinds, _src in got:
        sizes = [len(v) for v in segs]
        assert size == sum(sizes) and len(kinds) == full
        assert set(sizes[:-1]) <= {sizes[0]} and sizes[-1] <= sizes[0]
        assert kinds == bytes(bytes(v)[3] for v in segs[:full])
        if isinstance(job, int) and job >= 0:
            assert {int.from_bytes(bytes(v)[8:12], "big") for v in segs[:full]} == {job}
    for a, b in itertools.pairwise(got):  # nothing left that could be joined
        joinable = (
            _open(a)
            and b[2] == len(b[0]) > 0
            and isinstance(b[3], int)
            and (a[3], a[5], len(a[0][0])) == (b[3], b[5], len(b[0][0]))
        )
        assert not joinable


def _open(s: tuple[Any, ...]) -> bool:
    """Whether a run may go on after split `s`: all its datagrams name one
    job and have a whole header and one size."""
    segs, _size, full, job = s[:4]
    return isinstance(job, int) and full == len(segs) > 0 and len(segs[-1]) == len(segs[0])


def test_native_receive_starts_each_buffer_on_a_cache_line(pair: tuple[UdpPath, UdpPath]) -> None:
    """Each recvmsg buffer's first datagram starts on a 64-byte line, and so
    does every datagram of a whole number of lines (1472 bytes: MTU 1500's);
    malloc alone puts a buffer 16 bytes apart at best (20 aligned by chance:
    one chance in 4**20)."""
    tx, rx = pair
    port = rx.sock.getsockname()[1]
    assert transport._udp is not None, "dlcp.daemon._udp was not built: pip install -e . builds it"
    rx.native_recv = True
    rng = np.random.default_rng(5)
    sizes = [1472] * 12 + [1000] * 8
    for size in sizes:
        dgs = [rng.bytes(size) for _ in range(3)]
        assert tx.send(dgs, ("127.0.0.1", port), 0) == 3
    got: list[tuple[int, list[bytes], list[int]]] = []
    while sum(len(segs) for _, segs, _ in got) < 3 * len(sizes):
        ready, _, _ = select.select([rx.sock], [], [], 5.0)
        assert ready, "datagrams lost on loopback"
        for segs, size, *_ in rx.receive_split(64):
            addrs = [np.frombuffer(v, np.uint8).ctypes.data % 64 for v in segs]
            got.append((size, [bytes(v) for v in segs], addrs))
    assert rx.recvmsg_calls >= len(sizes)
    assert all(addrs[0] == 0 for _, _, addrs in got)
    assert all(addrs == [0] * len(addrs) for size, segs, addrs in got if len(segs[0]) == 1472)
    assert sorted({len(s) for _, segs, _ in got for s in segs}) == [1000, 1472]
