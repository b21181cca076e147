"""Fuzz targets of dlcp.daemon._udp and dlcp.daemon._keys (and the
`_bulk.Datagrams` the split makes): the GRO split and the joins of drains,
the C loops over a `Datagrams`, and the outbox's packet keys, each against
its Python twin."""

from __future__ import annotations

import select
from collections import deque
from collections.abc import Callable
from typing import Any

from dlcp.daemon import netin, packet_keys, poll
from dlcp.daemon import transport as tr
from dlcp.wire import batch as batch_mod
from dlcp.wire.header import HEADER_SIZE
from fuzz.harness import Input, pack_datagrams, target
from fuzz.seeds import datagram_seeds

_keys, _udp, _bulk = packet_keys._keys, tr._udp, batch_mod._bulk

# --- the GRO split, drains joined ---------------------------------------------


def _gro_seeds() -> list[bytes]:
    out = []
    for dgs in datagram_seeds():
        size = max(len(d) for d in dgs)
        same = [d.ljust(size, b"\0") for d in dgs if len(d) == size] or dgs[:1]
        train = b"".join(same[:-1]) + same[-1][: max(size // 2, 1)]
        out.append(size.to_bytes(2, "little") + bytes((2,)) + train)
    return out


def _plain(split: tuple) -> tuple:
    segs, *rest = split
    return ([bytes(v) for v in segs], *rest)


@target(
    "udp_split_gro",
    covers=("_udp.split_gro", "_bulk.join", "_bulk.Datagrams", "_bulk.Segment"),
    seeds=_gro_seeds,
)
def udp_split_gro(inp: Input) -> None:
    seg = inp.uint(2) % 9100
    parts = inp.uint(1) % 4 + 1
    data = inp.rest()
    got = _udp.split_gro(data, seg)
    want = tr.split_gro(data, seg)
    assert _plain(got) == _plain(want), (len(data), seg)
    # the buffer as `parts` GRO buffers of whole segments, each split, then joined
    step = max(seg, 1) * max(len(data) // max(seg, 1) // parts, 1)
    bufs = [data[k : k + step] for k in range(0, len(data), step)] or [b""]
    splits = [_udp.split_gro(b, seg)[0] for b in bufs]
    joined = _bulk.join(splits)
    flat = [bytes(v) for s in splits for v in s]
    assert [bytes(v) for v in joined] == flat == [bytes(v) for v in netin._join(splits)]
    assert len(joined) == len(flat)
    if flat:
        k = inp.below(len(flat))
        assert bytes(joined[k]) == flat[k] and bytes(joined[-1]) == flat[-1]
    # the C loops read a Datagrams in place: the same as from a list of bytes
    tables, args = batch_mod._CHECK_TABLES, batch_mod._CHECK_ARGS
    assert _bulk.heads(joined, HEADER_SIZE) == _bulk.heads(flat, HEADER_SIZE)
    assert _bulk.checked_heads(joined, tables, *args) == _bulk.checked_heads(flat, tables, *args)


# --- receives: recvmmsg and the split, runs of buffers joined --------------------

_PAIR: list[tr.UdpPath] = []  # a sender and a receiver on loopback, made once


def _pair() -> tuple[tr.UdpPath, tr.UdpPath]:
    if not _PAIR:
        _PAIR.extend((tr.UdpPath("127.0.0.1", 0), tr.UdpPath("127.0.0.1", 0)))
    return _PAIR[0], _PAIR[1]


def _drain(rx: tr.UdpPath, sent: int, take: Callable[[], tuple[int, list]]) -> list:
    """(splits, buffers) of each call of `take` until `sent` bytes came."""
    out, got = [], 0
    while got < sent:
        ready, _, _ = select.select([rx.sock], [], [], 5.0)
        assert ready, f"only {got} of {sent} bytes arrived on loopback"
        buffers, splits = take()
        assert 0 < buffers <= 7
        out.append(([_plain(x) for x in splits], buffers))
        got += sum(x[1] for x in splits)
    return out


def _recv_seeds() -> list[bytes]:
    out = []
    for dgs in datagram_seeds():
        sends = b""
        for d in dgs[:6]:  # one send a datagram (k = 1), its own length
            sends += len(d).to_bytes(2, "little") + b"\x00" + d
        out.append(bytes((len(dgs[:6]) - 1,)) + sends)
    return out


@target("udp_recv_runs", covers=("_udp.recv_runs", "_udp.recv_gro"), seeds=_recv_seeds)
def udp_recv_runs(inp: Input) -> None:
    """GSO sends of the input's datagrams over loopback, taken three ways in
    drains of 7 buffers: recvmsg and the Python split, `_udp.recv_gro` (the
    same, buffer for buffer) and `_udp.recv_runs` (`merge_splits` of them)."""
    tx, rx = _pair()
    dest = ("127.0.0.1", rx.sock.getsockname()[1])
    sends = []
    for _ in range(inp.uint(1) % 6 + 1):
        seg = inp.uint(2) % 1500 + 1
        k = inp.uint(1) % 8 + 1  # datagrams of `seg` bytes, the last maybe shorter
        body = inp.take(seg * k)
        if body:
            sends.append([body[i : i + seg] for i in range(0, len(body), seg)])
    if not sends:
        return
    sent = sum(len(d) for dgs in sends for d in dgs)
    drains = {}
    for mode in ("python", "gro", "runs"):
        for dgs in sends:
            assert tx.send(dgs, dest, 0) == len(dgs)
        if mode == "python":
            rx.native_recv = False
            take = lambda: (len(s := rx.receive_split(7)), s)  # noqa: E731
        elif mode == "gro":
            take = lambda: (len(s := _udp.recv_gro(rx.sock.fileno(), 7)), s)  # noqa: E731
        else:
            take = lambda: _udp.recv_runs(rx.sock.fileno(), 7)  # noqa: E731
        drains[mode] = _drain(rx, sent, take)
    each = [x for out, _ in drains["python"] for x in out]
    assert [x for out, _ in drains["gro"] for x in out] == each
    at = 0
    for out, n in drains["runs"]:
        assert out == [_plain(x) for x in tr.merge_splits(each[at : at + n])]
        at += n
    assert at == len(each)


# --- the outbox's packet keys ---------------------------------------------------


def _key_seeds() -> list[bytes]:
    return [pack_datagrams(dgs, bytes((3, 1, 7, 0, 0))) for dgs in datagram_seeds()]


def _outcome(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), or the type of what it raised."""
    try:
        return fn(*args)
    except (ValueError, TypeError, IndexError) as exc:
        return type(exc)


@target(
    "keys",
    covers=(
        "_keys.identities",
        "_keys.identities_heads",
        "_keys.shard_keys",
        "_keys.unqueue",
        "_keys.take",
        "_keys.by_class",
        "_keys.clamped_classes",
        "_keys.Fifo.append",
        "_keys.Fifo.extend",
        "_keys.Fifo.popleft",
    ),
    seeds=_key_seeds,
)
def keys(inp: Input) -> None:
    pk = packet_keys
    n_done = inp.uint(1)
    top = inp.uint(1) % 9 + 1
    nbytes_k = inp.uint(1)
    count = inp.uint(1) % 70 + 1
    watch = inp.uint(1)
    dgs = inp.datagrams(limit=32, longest=128)
    long = [d for d in dgs if len(d) >= pk._ID_END]
    ids = pk._py_identities(long)
    assert _keys.identities(long) == ids
    assert _keys.identities_heads(long) == pk._py_identities_heads(long)
    assert _outcome(_keys.shard_keys, dgs) == _outcome(pk._py_shard_keys, dgs)
    # unqueue: the first n left a queue the batch heads; a pending set of most
    # of their identities and some others; the shards watched or not
    n = n_done % (len(long) + 2)
    pending = {i for k, i in enumerate(ids) if k % 5} | {bytes(29), bytes(range(29))}
    heads = [i[: pk._BKEY] for i in ids]
    watched = None if watch % 3 == 0 else set(heads[:: watch % 3 + 1])
    c_set, py_set = set(pending), set(pending)
    c_q, py_q = deque([*long, b"tail"]), deque([*long, b"tail"])
    want = _outcome(pk._py_unqueue, py_set, long, n, py_q.popleft, watched)
    assert _outcome(_keys.unqueue, c_set, long, n, c_q.popleft, watched) == want
    assert c_set == py_set and list(c_q) == list(py_q)
    if not isinstance(want, type):
        fifo, f_set = _keys.Fifo([*long, b"tail"]), set(pending)
        assert _keys.unqueue(f_set, long, n, fifo, watched) == want
        assert f_set == py_set and list(fifo) == list(py_q)
    # classes of the datagrams (some out of range), drop bytes
    classes = [
        (d[5] if len(d) > 5 else 0) % (top + 1) - (1 if len(d) % 11 == 0 else 0) for d in dgs
    ]
    drop = bytes(len(d) % 2 for d in dgs)
    assert _outcome(_keys.by_class, dgs, classes, drop, top) == _outcome(
        pk._py_by_class, dgs, classes, drop, top
    )
    prios = [(d[6] if len(d) > 6 else 0) - 100 for d in dgs]
    assert _keys.clamped_classes(prios, top) == pk._py_clamped_classes(prios, top)
    # take: the head of a queue (a deque or a Fifo) that fits a byte budget
    # (of datagrams, never empty ones: `_py_take` divides by the first's size)
    dgs = [d for d in dgs if d]
    if dgs:
        nbytes = nbytes_k * nbytes_k * 4
        q = deque(dgs)
        fifo = _keys.Fifo()
        fifo.extend(dgs[: len(dgs) // 2])
        for d in dgs[len(dgs) // 2 :]:
            fifo.append(d)
        want_head, want_sizes = pk._py_take(q, nbytes, count)
        for queue in (q, fifo):
            head, sizes = _keys.take(queue, nbytes, count)
            assert len(head) == len(want_head)
            assert all(a is b for a, b in zip(head, want_head, strict=True))
            assert list(sizes)[: len(head)] == list(want_sizes)
        assert list(fifo) == list(q) == dgs
        for _ in range(min(len(dgs), count)):
            assert fifo.popleft() is q.popleft()
        assert list(fifo) == list(q)


# --- a poll's drain in one call ---------------------------------------------------


@target("udp_drain", covers=("_udp.drain_buffers", "_udp.recv_drain"), seeds=_gro_seeds)
def udp_drain(inp: Input) -> None:
    """The input cut into GRO buffers of a few sources: `_udp.drain_buffers`
    is `poll.py_drain` of them; sent over loopback (GSO), `_udp.recv_drain`
    gives the same datagrams, jobs, kinds and lengths."""
    seg = inp.uint(2) % 1600
    parts = inp.uint(1) % 5 + 1
    data = inp.rest()
    step = max(len(data) // parts, 1)
    bufs = [
        (data[k : k + step], seg, f"10.0.0.{k % 3 + 1}") for k in range(0, len(data), step)
    ]
    got, want = _udp.drain_buffers(bufs), poll.py_drain(bufs)
    assert [bytes(x) for x in got[2]] == [bytes(x) for x in want[2]]
    assert got[:2] == want[:2] and got[3:] == want[3:], (len(data), seg)
    tx, rx = _pair()
    dest = ("127.0.0.1", rx.sock.getsockname()[1])
    dgs = [bytes(x) for x in want[2] if 0 < len(x) <= 9000]
    if not dgs:
        return
    assert tx.send(dgs, dest, 0) == len(dgs)
    came: list[bytes] = []
    kinds, sent = b"", sum(map(len, dgs))
    while sum(map(len, came)) < sent:
        ready, _, _ = select.select([rx.sock], [], [], 5.0)
        assert ready, "the datagrams did not arrive on loopback"
        d = _udp.recv_drain(rx.sock.fileno(), 7, 1 << 30)
        came += [bytes(x) for x in d[2]]
        kinds += d[6]
        assert d[3] in ([], ["127.0.0.1"]) and d[8] == 0
    assert came == dgs
    assert kinds == poll.py_drain([(x, 0, "127.0.0.1") for x in dgs])[6]
