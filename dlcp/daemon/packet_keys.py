"""The keys the outbox files packets under, and its bookkeeping of them in bulk.

A packet's identity (type and the header from job to element count), its
barrier key (leg, job, round, bucket, shard: what a DONE vouches for), and
the batch operations `Outbox` does with them: identities of a batch, runs of
shard keys, a sent batch off a queue (`unqueue`), a batch off a queue's head
(`take`), a run split by class. Each is defined here in Python (`_py_*`) and
built in C as dlcp/daemon/_keys.c, which tests/test_outbox_keys.py holds equal
to these definitions; `NATIVE_KEYS` picks the C ones where they are built.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate, islice

from dlcp.wire.header import Flags

try:
    from dlcp.daemon import _keys  # type: ignore[attr-defined]
except ImportError:  # not built: the Python definitions below
    _keys = None

_DATA, _RESULT, _DONE = 1, 2, 4  # PacketType values, byte 3 of the header
_F_RESULT_LEG = int(Flags.RESULT_LEG)
_DR = frozenset((_DATA, _RESULT))
_DATA_LEG, _RESULT_LEG = bytes((_DATA,)), bytes((_RESULT,))
_BKEY = 15  # `_barrier_key` of a DATA/RESULT packet: the first bytes of its identity
_ID_END = 36  # an identity takes the header up to here
_DISTINCT_MAX = 64  # `_shard_keys` gives up on batches of more shards and legs


def _identity(datagram: bytes) -> bytes:
    """What makes a packet itself, whatever its flags, class or MAC: the type
    byte and the header fields from job to element count (bytes 8..35). A NACK
    for a packet still queued here must not queue it again."""
    return datagram[3:4] + datagram[8:36]


def _py_identities(datagrams: Iterable[bytes]) -> list[bytes]:
    """`_identity` of each datagram (one list comprehension, no call apiece)."""
    return [dg[3:4] + dg[8:36] for dg in datagrams]


def _py_identities_heads(datagrams: Iterable[bytes]) -> tuple[list[bytes], list[bytes]]:
    """`_identities` and the first `_BKEY` bytes of each (its `_barrier_key`)."""
    ids = _py_identities(datagrams)
    return ids, [i[:_BKEY] for i in ids]


def _py_shard_keys(
    datagrams: Sequence[bytes],
) -> tuple[bytes, list[bytes | None], list[bytes] | None]:
    """The type and flags bytes (header bytes 3 and 4) of each datagram, two a
    datagram; the `_barrier_key` of each DATA/RESULT packet (None for the
    others), one object for each run of one key; and the distinct keys, in
    order of first appearance, or None when some key's packets are not one run
    of increasing offsets (then two of them may be the same packet) or there
    are more than `_DISTINCT_MAX` keys."""
    bkeys: list[bytes | None] = []
    distinct: list[bytes] | None = []
    prev: bytes | None = None
    prev_offset = 0
    for dg in datagrams:
        if len(dg) < _ID_END:
            raise ValueError(
                f"datagram {len(bkeys)} is {len(dg)} bytes: shorter than the {_ID_END} "
                "header bytes an identity takes"
            )
        if dg[3] not in _DR:
            bkeys.append(None)
            continue
        key = bytes(dg[3:4]) + bytes(dg[8:22])
        offset = int.from_bytes(dg[28:32], "big")
        if key == prev:
            assert prev is not None
            key = prev
            if offset <= prev_offset:
                distinct = None
        else:
            if distinct is not None:
                if key in distinct or len(distinct) >= _DISTINCT_MAX:
                    distinct = None
                else:
                    distinct.append(key)
            prev = key
        prev_offset = offset
        bkeys.append(key)
    return b"".join([bytes(dg[3:5]) for dg in datagrams]), bkeys, distinct


def _py_shards_left(heads: list[bytes]) -> list[tuple[bytes, int]]:
    """(barrier key, packets) of each shard and leg among the DATA/RESULT
    packets whose identities begin with `heads` (`_BKEY` bytes), in the order
    of its last packet: a shard's held DONEs go when its last packet has left."""
    if not heads:
        return []
    first = heads[0]
    if heads.count(first) == len(heads):  # one shard and leg (the usual batch)
        return [(first, len(heads))] if first[0] in _DR else []
    counts = Counter(reversed([b for b in heads if b[0] in _DR]))
    return [(bkey, counts[bkey]) for bkey in reversed(counts)]  # in the order of their last packet


def _py_unqueue(
    pending: set[bytes],
    datagrams: Sequence[bytes],
    n: int,
    popleft: Callable[[], bytes] | None = None,
    watched: set[bytes] | None = None,
) -> list[tuple[bytes, int]]:
    """The first `n` of `datagrams` left the queue: their identities leave
    `pending` (of the DATA/RESULT packets, only those of shards and legs in
    `watched`, when given: `Peer.watched`), `popleft` (the queue's, which the
    batch heads) takes them off it, and the DATA/RESULT packets among them are
    counted per shard and leg for `peer._release` (`_py_shards_left`)."""
    if not isinstance(pending, set):
        raise TypeError(f"pending must be a set, not {type(pending).__name__}")
    if watched is not None and not isinstance(watched, (set, frozenset)):
        raise TypeError(f"watched must be a set, not {type(watched).__name__}")
    if not 0 <= n <= len(datagrams):
        raise ValueError(f"{n} datagrams left the queue, of a batch of {len(datagrams)}")
    ids, heads = _py_identities_heads(datagrams[:n])
    if watched is None:
        pending.difference_update(ids)
    else:
        pending.difference_update(
            [i for i, h in zip(ids, heads, strict=True) if h[0] not in _DR or h in watched]
        )
    if popleft is not None:
        for i in range(n):
            if popleft() is not datagrams[i]:
                raise RuntimeError(f"datagram {i} popped off the queue is not the batch's")
    return _py_shards_left(heads)


def _py_by_class(
    datagrams: Sequence[bytes], classes: Sequence[int], drop: bytes, n: int
) -> tuple[list[list[bytes] | None], int]:
    """The datagrams of each class 0 .. n - 1, in their order (None: none of
    that class), and the highest class below n - 1 of those whose `drop` byte
    is 0 (-1: none): a run's queues and trail class (`Outbox._queue_run`)."""
    if not len(datagrams) == len(classes) == len(drop):
        raise ValueError(
            f"{len(datagrams)} datagrams, {len(classes)} classes and {len(drop)} drop bytes"
        )
    out: list[list[bytes] | None] = [None] * n
    trail = -1
    for i, (dg, c) in enumerate(zip(datagrams, classes, strict=True)):
        if not 0 <= c < n:
            raise ValueError(f"class {c} of datagram {i} is not in 0..{n - 1}")
        lst = out[c]
        if lst is None:
            lst = out[c] = []
        lst.append(dg)
        if not drop[i] and c < n - 1 and c > trail:
            trail = c
    return out, trail


def _py_by_path(
    datagrams: Sequence[bytes], paths: Sequence[int], n: int
) -> tuple[list[list[bytes] | None], list[list[int] | None], list[bytes | None], list[bool | None]]:
    """A multi-path batch cut by path (`paths`: one path in 0 .. n - 1 a
    datagram): for each path, its datagrams in their order, their places in
    the batch, their offset fields (header bytes 28..31, four a datagram) and
    whether those offsets strictly increase (four Nones: a path with none).
    `SendingHalf._send` sends each path's part and notes their offsets for
    NACKs (`SentPaths`) with no step a datagram."""
    if not 1 <= n <= 256:
        raise ValueError("n must be 1 to 256")
    if len(datagrams) != len(paths):
        raise ValueError(f"{len(datagrams)} datagrams but {len(paths)} paths")
    groups: list[list[bytes] | None] = [None] * n
    places: list[list[int] | None] = [None] * n
    for i, p in enumerate(paths):
        if not 0 <= p < n:
            raise ValueError(f"path {p} of datagram {i} is not in 0..{n - 1}")
    offsets: list[bytes | None] = [None] * n
    rising: list[bool | None] = [None] * n
    for i, (dg, p) in enumerate(zip(datagrams, paths, strict=True)):
        if len(dg) < _ID_END:
            raise ValueError(
                f"datagram {i} is {len(dg)} bytes: shorter than the {_ID_END} "
                "header bytes an identity takes"
            )
        g, x = groups[p], places[p]
        if g is None or x is None:
            g, x = groups[p], places[p] = [], []
            offsets[p], rising[p] = b"", True
        off = bytes(dg[28:32])
        prev = offsets[p]
        assert prev is not None
        if prev and off <= prev[-4:]:  # big endian: bytes compare as the numbers
            rising[p] = False
        offsets[p] = prev + off
        g.append(dg)
        x.append(i)
    return groups, places, offsets, rising


def _py_clamped_classes(priorities: list[int], n: int) -> tuple[list[int], bool]:
    """`priorities` each clamped into 0 .. n - 1 (the same list where all are
    in range already), and whether they are all one class."""
    if not priorities:
        return priorities, True
    lo, hi = min(priorities), max(priorities)
    uniform = priorities.count(priorities[0]) == len(priorities)
    if lo >= 0 and hi < n:
        return priorities, uniform
    return [min(max(p, 0), n - 1) for p in priorities], uniform


# The same in C (dlcp/daemon/_keys.c, built by setup.py): one allocation a key
# instead of slices and a concatenation, `shard_keys` without a slice apiece,
# and `unqueue`, a sent batch's bookkeeping in one call (no lists of keys, no
# Python loop), and `take`, a batch off a queue's head with no int object made
# a packet. DLCP_NATIVE_KEYS=0 turns it off.
NATIVE_KEYS = _keys is not None and os.environ.get("DLCP_NATIVE_KEYS", "1") != "0"
if NATIVE_KEYS:
    _identities = _keys.identities
    _identities_heads = _keys.identities_heads
    _shard_keys = _keys.shard_keys
    _unqueue = _keys.unqueue
    _by_class = _keys.by_class
    _by_path = _keys.by_path
    _clamped_classes = _keys.clamped_classes
else:
    _identities = _py_identities
    _identities_heads = _py_identities_heads
    _shard_keys = _py_shard_keys
    _unqueue = _py_unqueue
    _by_class = _py_by_class
    _by_path = _py_by_path
    _clamped_classes = _py_clamped_classes


def _barrier_key(datagram: bytes) -> bytes:
    """The leg (the type byte of its DATA or RESULT packets) and (job, round,
    bucket, shard): what a DONE vouches for. For a DATA/RESULT packet it is the
    head of its identity (`_identity(dg)[:_BKEY]`)."""
    t = datagram[3]
    if t == _DONE:
        return (_RESULT_LEG if datagram[4] & _F_RESULT_LEG else _DATA_LEG) + datagram[8:22]
    return datagram[3:4] + datagram[8:22]


def _py_take(q: deque[bytes], nbytes: int, count: int) -> tuple[list[bytes], Sequence[int]]:
    """The batch at the head of `q`: as many packets as fit in `nbytes` (at
    least one, at most `count`), and their bytes so far, packet by
    packet (running sums)."""
    limit = min(len(q), count)
    take = min(limit, nbytes // len(q[0]) + 1)
    head = list(islice(q, take))
    sizes = list(accumulate(map(len, head)))
    while sizes[-1] <= nbytes and take < limit:  # all fit: there may be room for more
        take = min(limit, 2 * take)
        head = list(islice(q, take))
        sizes = list(accumulate(map(len, head)))
    k = max(1, bisect_right(sizes, nbytes))
    if k < len(head):
        del head[k:], sizes[k:]
    return head, sizes


_take = _keys.take if NATIVE_KEYS else _py_take


_DONE_BYTE = bytes((_DONE,))
_DONE_TOKEN = b"\xff"  # + position: a DONE's key in push_many (no identity starts with it)


def _not_repeats(
    pending: set[bytes], datagrams: Sequence[bytes], types: bytes
) -> tuple[list[int] | None, int]:
    """Put the identities of `datagrams` (their type bytes `types`) but
    DONEs in `pending`, leaving out (and counting) a repeat: one already
    queued, or earlier in the batch. Returns the positions of those that are
    not repeats, or None when all of them are new, and how many repeats
    there were (`Outbox.push_many`)."""
    ids = _identities(datagrams)
    k = types.find(_DONE_BYTE)
    if k >= 0:  # a DONE is never a repeat (see `push`): a key of its own, not kept
        tokens = []
        while k >= 0:
            ids[k] = _DONE_TOKEN + k.to_bytes(4, "little")
            tokens.append(ids[k])
            k = types.find(_DONE_BYTE, k + 1)
    else:
        tokens = None
    before = len(pending)
    repeats = 0
    kept: list[int] | None = None
    if pending.isdisjoint(ids):
        pending.update(ids)
        if len(pending) - before != len(ids):  # a repeat within the batch
            pending.difference_update(ids)  # all of them were new
            kept = []
    else:
        kept = []
    if kept is not None:
        seen: set[bytes] = set()
        for k, key in enumerate(ids):
            if key not in pending and key not in seen:
                seen.add(key)
                kept.append(k)
        repeats = len(ids) - len(kept)
        pending.update(seen)
    if tokens:
        pending.difference_update(tokens)
    return kept, repeats
