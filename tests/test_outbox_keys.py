"""The outbox's packet identities in C (dlcp/daemon/_keys.c) against their
Python definitions in dlcp.daemon.outbox: the same bytes for every datagram,
the same barrier keys and runs (`shard_keys`), the same pending set and shard
counts when a batch leaves the queue (`unqueue`), errors (not reads past the
end) for bad input.

The project's install builds the extension (setup.py), so its absence fails
here; set DLCP_ALLOW_NO_NATIVE=1 to run the suite where it cannot be built.
"""

from __future__ import annotations

import os
import random
import sys
from collections import deque
from collections.abc import Callable
from types import ModuleType

import pytest

from dlcp.daemon import packet_keys, peer

if packet_keys._keys is None and os.environ.get("DLCP_ALLOW_NO_NATIVE") == "1":
    pytest.skip("dlcp.daemon._keys is not built (DLCP_ALLOW_NO_NATIVE=1)", allow_module_level=True)


@pytest.fixture(scope="module")
def keys() -> ModuleType:
    assert packet_keys._keys is not None, (
        "dlcp.daemon._keys was not built: pip install -e . builds it"
    )
    return packet_keys._keys


def _datagrams(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.choice((36, 37, 64, 100, 8908, 9000))) for _ in range(n)]


@pytest.mark.parametrize("n", [0, 1, 2, 63, 64, 500])
def test_identities_and_heads_equal_the_python_definitions(keys: ModuleType, n: int) -> None:
    dgs = _datagrams(n, n)
    ids = [packet_keys._identity(dg) for dg in dgs]
    assert keys.identities(dgs) == ids
    assert keys.identities(tuple(dgs)) == ids
    assert keys.identities_heads(dgs) == (ids, [i[: packet_keys._BKEY] for i in ids])
    assert all(len(i) == 29 for i in ids)


def test_other_buffers_give_the_same_identities(keys: ModuleType) -> None:
    dgs = _datagrams(8, 7)
    others = [bytearray(dgs[0]), memoryview(dgs[1]), memoryview(b"xx" + dgs[2])[2:], *dgs[3:]]
    assert keys.identities(others) == [packet_keys._identity(dg) for dg in dgs]


def test_every_identity_byte_comes_from_its_header_byte(keys: ModuleType) -> None:
    base = bytes(64)
    positions = [3, *range(8, 36)]
    for k, pos in enumerate(positions):
        dg = bytearray(base)
        dg[pos] = 0xA5
        ident = keys.identities([bytes(dg)])[0]
        assert ident[k] == 0xA5 and ident.count(0xA5) == 1, pos
    for pos in [0, 1, 2, 4, 5, 6, 7, 36, 63]:  # flags, class, MAC, payload: not identity
        dg = bytearray(base)
        dg[pos] = 0xA5
        assert keys.identities([bytes(dg)])[0] == bytes(29), pos


def test_bad_input_raises_instead_of_reading_past_the_datagram(keys: ModuleType) -> None:
    with pytest.raises(ValueError, match="datagram 1 is 35 bytes"):
        keys.identities([bytes(36), bytes(35)])
    with pytest.raises(ValueError, match="datagram 0 is 0 bytes"):
        keys.identities_heads([b""])
    with pytest.raises(TypeError):
        keys.identities([bytes(40), 7])
    with pytest.raises(TypeError):
        keys.identities(5)
    with pytest.raises(BufferError):
        keys.identities([memoryview(bytes(80))[::2]])  # not contiguous


DATA, RESULT, NACK, DONE = 1, 2, 3, 4


def _batch(n: int, seed: int, shards: int) -> list[bytes]:
    """`n` datagrams of `shards` shards (the 14 bytes from job to shard),
    interleaved in runs, of every type the queues hold, with repeats: the same
    datagram again, or the same identity with other flags."""
    rng = random.Random(seed)
    pool = [rng.randbytes(14) for _ in range(shards)]
    out: list[bytes] = []
    shard = pool[0]
    while len(out) < n:
        if out and rng.random() < 0.08:
            dg = bytearray(rng.choice(out))
            if rng.random() < 0.5:
                dg[4] ^= 0x02  # a retransmission: other flags, same identity
            out.append(bytes(dg))
            continue
        if rng.random() < 0.15:
            shard = rng.choice(pool)
        dg = bytearray(rng.randbytes(rng.choice((36, 64, 1500))))
        dg[3] = rng.choice((DATA, DATA, DATA, RESULT, RESULT, DONE, NACK))
        dg[8:22] = shard
        out.append(bytes(dg))
    return out


def _packet(kind: int, shard: int, offset: int, flags: int = 0) -> bytes:
    """A 64-byte header: type, flags, shard (all 14 bytes from job to shard)
    and offset; the rest zeros."""
    return (
        bytes(3)
        + bytes((kind, flags))
        + bytes(3)
        + bytes((shard,)) * 14
        + bytes(6)
        + offset.to_bytes(4, "big")
        + bytes(32)
    )


def _bkey(kind: int, shard: int) -> bytes:
    return bytes((kind,)) + bytes((shard,)) * 14


@pytest.mark.parametrize("n", [0, 1, 2, 63, 500])
@pytest.mark.parametrize("shards", [1, 3, 100])
def test_shard_keys_equal_the_python_definition(keys: ModuleType, n: int, shards: int) -> None:
    dgs = _batch(n, 100 + n, shards)  # with repeats: runs broken, or None
    ordered = [  # increasing offsets per shard, shard after shard, DONEs between
        _packet(DONE if k % 7 == 6 else DATA, k * shards // max(n, 1), k) for k in range(n)
    ]
    for batch in (dgs, ordered):
        got = keys.shard_keys(batch)
        assert got == packet_keys._py_shard_keys(batch)
        heads, bkeys, _ = got
        assert heads == b"".join(dg[3:5] for dg in batch)
        assert bkeys == [
            packet_keys._barrier_key(dg) if dg[3] in (DATA, RESULT) else None for dg in batch
        ]
        others = [memoryview(dg) if k % 2 else bytearray(dg) for k, dg in enumerate(batch)]
        assert keys.shard_keys(others) == got == packet_keys._py_shard_keys(others)
    want = list(dict.fromkeys(packet_keys._barrier_key(dg) for dg in ordered if dg[3] == DATA))
    assert keys.shard_keys(ordered)[2] == (want if len(want) <= packet_keys._DISTINCT_MAX else None)


def test_shard_keys_say_when_a_packet_may_be_there_twice(keys: ModuleType) -> None:
    a = [_packet(DATA, 1, k) for k in (0, 5, 9)]
    b = [_packet(RESULT, 1, k) for k in (0, 5)]  # the result leg of shard 1: another key
    done, nack = _packet(DONE, 1, 0), _packet(NACK, 1, 0)
    for f in (keys.shard_keys, packet_keys._py_shard_keys):
        heads, bkeys, distinct = f([*a, done, nack, *b])
        assert distinct == [_bkey(DATA, 1), _bkey(RESULT, 1)]
        assert bkeys[3] is None and bkeys[4] is None
        assert bkeys[0] is bkeys[1] is bkeys[2]  # one object a run
        assert bkeys[5] is bkeys[6] and bkeys[5] == _bkey(RESULT, 1)
        assert heads[6:10] == bytes((DONE, 0, NACK, 0))
        # a DONE between packets of one shard does not break its run
        assert f([a[0], done, *a[1:]])[2] == [_bkey(DATA, 1)]
        # the same offset again, one going back, a shard met again after another
        assert f([*a, a[2]])[2] is None
        assert f([a[1], a[0]])[2] is None
        assert f([a[0], *b, a[1]])[2] is None
        many = [_packet(DATA, k, 0) for k in range(packet_keys._DISTINCT_MAX + 1)]
        assert f(many[:-1])[2] == [_bkey(DATA, k) for k in range(packet_keys._DISTINCT_MAX)]
        assert f(many)[2] is None
        assert f([]) == (b"", [], [])
        with pytest.raises(ValueError, match="datagram 1 is 35 bytes"):
            f([bytes(36), bytes(35)])
    with pytest.raises(TypeError):
        keys.shard_keys([bytes(40), 7])


@pytest.mark.parametrize("seed", range(3))
def test_unqueue_discards_only_watched_shards(keys: ModuleType, seed: int) -> None:
    """With `watched`, the identities of DATA/RESULT packets of other shards
    stay in the set (they were never put there: the outbox does not keep
    them); every other packet's leave it."""
    rng = random.Random(seed)
    dgs = _batch(300, seed, 6)
    ids = packet_keys._py_identities(dgs)
    heads = sorted({i[: packet_keys._BKEY] for i in ids if i[0] in (DATA, RESULT)})
    for watched in (set(), set(rng.sample(heads, 2)), set(heads)):
        pending = set(ids) | {bytes((DATA,)) + rng.randbytes(28) for _ in range(100)}
        c_set, py_set = set(pending), set(pending)
        n = rng.randrange(301)
        got = keys.unqueue(c_set, dgs, n, None, watched)
        assert got == packet_keys._py_unqueue(py_set, dgs, n, None, watched)
        assert got == keys.unqueue(set(pending), dgs, n)  # the same shards counted
        assert c_set == py_set
        bkey = packet_keys._BKEY
        gone = {i for i in ids[:n] if i[0] not in (DATA, RESULT) or i[:bkey] in watched}
        assert c_set == pending - gone
    for f in (keys.unqueue, packet_keys._py_unqueue):
        with pytest.raises(TypeError, match="watched must be a set"):
            f(set(), dgs, 1, None, list(heads))


def _unqueue_both(
    keys: ModuleType, pending: set[bytes], dgs: list[bytes], n: int
) -> tuple[list[tuple[bytes, int]], set[bytes]]:
    """`unqueue` in C and in Python on copies of `pending` (and of a queue that
    the batch heads): the same shards, sets and queues; returns them."""
    c_set, py_set = set(pending), set(pending)
    tail = [bytes(40)] * 3
    c_q, py_q = deque(dgs + tail), deque(dgs + tail)
    shards = keys.unqueue(c_set, dgs, n, c_q.popleft)
    assert shards == packet_keys._py_unqueue(py_set, dgs, n, py_q.popleft)
    assert c_set == py_set
    assert list(c_q) == list(py_q) == dgs[n:] + tail
    fifo, f_set = keys.Fifo(dgs + tail), set(pending)  # popped at once
    assert keys.unqueue(f_set, dgs, n, fifo) == shards
    assert f_set == c_set and list(fifo) == dgs[n:] + tail
    assert keys.unqueue(set(pending), dgs, n) == shards  # no queue: the same
    return shards, c_set


@pytest.mark.parametrize("shards", [1, 2, 5, 300])
@pytest.mark.parametrize("seed", range(4))
def test_unqueue_equals_the_python_definition(keys: ModuleType, shards: int, seed: int) -> None:
    rng = random.Random(seed)
    for size in (1, 2, 17, 1024):
        dgs = _batch(size, seed * 1000 + size, shards)
        ids = packet_keys._py_identities(dgs)
        # queued identities: most of the batch's, and many others
        pending = {i for i in ids if rng.random() < 0.9}
        pending |= {bytes((DATA,)) + rng.randbytes(28) for _ in range(2000)}
        for n in {0, 1, size // 2, size - 1, size}:
            got, left = _unqueue_both(keys, pending, dgs, n)
            assert left == pending - set(ids[:n])
            # (barrier key, packets) per shard: every DATA/RESULT packet counted
            dr = [i[: packet_keys._BKEY] for i in ids[:n] if i[0] in (DATA, RESULT)]
            assert sorted(got) == sorted((b, dr.count(b)) for b in set(dr))


def test_unqueue_gives_shards_in_the_order_of_their_last_packet(keys: ModuleType) -> None:
    def dg(kind: int, shard: int) -> bytes:
        return bytes(3) + bytes((kind,)) + bytes(4) + bytes((shard,)) * 14 + bytes(14)

    def key(kind: int, shard: int) -> bytes:
        return bytes((kind,)) + bytes((shard,)) * 14

    batch = [dg(DATA, 1), dg(DATA, 2), dg(DONE, 3), dg(DATA, 1), dg(RESULT, 1), dg(NACK, 2)]
    want = [(key(DATA, 2), 1), (key(DATA, 1), 2), (key(RESULT, 1), 1)]
    assert keys.unqueue(set(), batch, 6) == packet_keys._py_unqueue(set(), batch, 6) == want
    assert keys.unqueue(set(), batch, 3) == [(key(DATA, 1), 1), (key(DATA, 2), 1)]
    assert keys.unqueue(set(), [dg(DONE, 1), dg(NACK, 1)], 2) == []
    # shard after shard past the few compared one by one: the C table's path
    many = [dg(DATA, s % 40) for s in range(200)]
    want = [(key(DATA, s), 5) for s in range(40)]
    assert keys.unqueue(set(), many, 200) == packet_keys._py_unqueue(set(), many, 200) == want


def test_unqueue_takes_other_buffers(keys: ModuleType) -> None:
    dgs = _batch(50, 3, 3)
    others = [memoryview(dg) if k % 2 else bytearray(dg) for k, dg in enumerate(dgs)]
    pending = set(packet_keys._py_identities(dgs))
    a, b = set(pending), set(pending)
    assert keys.unqueue(a, others, 40) == packet_keys._py_unqueue(b, dgs, 40)
    assert a == b


def _gathered(dgs: list[bytes]) -> list[bytes]:
    """The datagrams as Gathered ones (dlcp.wire._ghash: header bytes, payload
    in place), tags recomputed; those shorter than a header stay bytes."""
    import numpy as np

    from dlcp.wire import mac
    from dlcp.wire.slices import Slices

    if mac._ghash is None:
        pytest.skip("dlcp.wire._ghash is not built: no Gathered datagrams")
    key = mac.GhashAesKey(bytes(32))
    out = list(dgs)
    pick = [i for i, dg in enumerate(dgs) if len(dg) >= 64]
    lengths = np.array([len(dgs[i]) - 64 for i in pick], np.int64)
    store = b"".join(dgs[i][64:] for i in pick)
    made = key.encode_gather(
        b"".join(dgs[i][:64] for i in pick), Slices(store, np.cumsum(lengths) - lengths, lengths)
    )
    for i, g in zip(pick, made, strict=True):
        out[i] = g
    return out


def test_gathered_datagrams_give_the_same_identities_and_unqueue(keys: ModuleType) -> None:
    dgs = _batch(60, 3, 4) + _datagrams(40, 5)
    mixed = _gathered(dgs)
    assert any(not isinstance(dg, bytes) for dg in mixed)
    joined = [bytes(dg) for dg in mixed]  # bytes 48..64 (the tag) differ from dgs
    assert keys.identities(mixed) == [packet_keys._identity(dg) for dg in joined]
    assert keys.shard_keys(mixed) == packet_keys._py_shard_keys(joined)
    pending = set(packet_keys._py_identities(joined))
    a, b = set(pending), set(pending)
    assert keys.unqueue(a, mixed, 50) == packet_keys._py_unqueue(b, joined, 50)
    assert a == b


def test_unqueue_keys_are_new_to_whatever_keeps_them(keys: ModuleType) -> None:
    """The set compares its keys with the one looked up: a key of another type
    could keep it (in its __eq__). It must keep the identity it was shown,
    whatever the C function looks up next."""
    seen: list[object] = []

    class Keeper:
        def __init__(self, like: bytes) -> None:
            self.h = hash(like)

        def __hash__(self) -> int:
            return self.h

        def __eq__(self, other: object) -> bool:
            seen.append(other)
            return False

    dgs = _batch(30, 5, 2)
    ids = packet_keys._py_identities(dgs)
    pending: set[object] = {Keeper(i) for i in set(ids)}  # one apiece: compared once a lookup
    keys.unqueue(pending, dgs, 30)
    # every key kept still says the identity it was compared as (CPython may
    # compare a key twice in one lookup, so the counts are not checked)
    assert set(seen) == set(ids)
    by_value: dict[object, set[int]] = {}
    for k in seen:
        by_value.setdefault(k, set()).add(id(k))
    assert all(len(objs) <= ids.count(v) for v, objs in by_value.items())  # type: ignore[arg-type]


def test_unqueue_rejects_bad_input_and_leaves_the_set(keys: ModuleType) -> None:
    dgs = _batch(10, 9, 2)
    pending = set(packet_keys._py_identities(dgs))
    before = set(pending)
    short = [*dgs[:3], bytes(35), *dgs[3:]]
    both: tuple[Callable[..., object], ...] = (keys.unqueue, packet_keys._py_unqueue)
    for f in both:
        with pytest.raises(TypeError, match="pending must be a set"):
            f(list(pending), dgs, 2)
        with pytest.raises(TypeError, match="pending must be a set"):
            f(frozenset(pending), dgs, 2)
        for n in (-1, 11, 1 << 70):
            with pytest.raises(ValueError, match="datagrams left the queue"):
                f(pending, dgs, n)
        q = deque(dgs[1:])
        with pytest.raises(RuntimeError, match="datagram 0 popped off the queue"):
            f(pending, dgs, 2, q.popleft)
        pending |= before
    fifo = keys.Fifo(dgs[1:])  # a queue the batch does not head: left as it was
    with pytest.raises(RuntimeError, match="datagram 0 popped off the queue"):
        keys.unqueue(pending, dgs, 2, fifo)
    assert list(fifo) == dgs[1:]
    with pytest.raises(RuntimeError, match="3 datagrams left a queue of 2"):
        keys.unqueue(pending, dgs, 3, keys.Fifo(dgs[:2]))
    pending |= before
    with pytest.raises(ValueError, match="datagram 3 is 35 bytes"):
        keys.unqueue(pending, short, 11)
    assert pending == before  # checked before any was discarded
    assert keys.unqueue(pending, short, 3) == packet_keys._py_unqueue(set(before), short, 3)
    with pytest.raises(TypeError):
        keys.unqueue(pending, [*dgs[:2], 7], 3)
    with pytest.raises(TypeError):
        keys.unqueue(pending, 5, 0)
    with pytest.raises(TypeError):
        keys.unqueue(pending, dgs)
    with pytest.raises(BufferError):
        keys.unqueue(pending, [memoryview(bytes(80))[::2]], 1)


def test_unqueue_survives_a_batch_emptied_under_it(keys: ModuleType) -> None:
    dgs = _batch(10, 11, 1)
    q = deque(dgs)

    def popleft() -> bytes:
        dgs.clear()  # the list goes away under the C loop
        return q.popleft()

    with pytest.raises(RuntimeError, match="changed during the call"):
        keys.unqueue(set(), dgs, 10, popleft)


def test_the_outbox_uses_the_extension_where_it_is_built(keys: ModuleType) -> None:
    if os.environ.get("DLCP_NATIVE_KEYS") == "0":
        pytest.skip("DLCP_NATIVE_KEYS=0 turns the extension off")
    assert packet_keys._identities is keys.identities
    assert packet_keys._identities_heads is keys.identities_heads
    assert packet_keys._shard_keys is keys.shard_keys
    assert packet_keys._unqueue is keys.unqueue
    assert packet_keys._take is keys.take


@pytest.mark.parametrize("seed", range(6))
def test_take_equals_the_python_definition(keys: ModuleType, seed: int) -> None:
    """`take`: the same head of the queue (the same objects, the queue left
    as it was) and the same running byte sums as `_py_take`, for queues of
    mixed sizes and Gathered datagrams, budgets below one datagram, between
    and beyond them all, counts below and beyond the queue's length."""
    rng = random.Random(seed)
    dgs: list = _datagrams(rng.randrange(1, 300), seed)
    if seed % 2:
        dgs = _gathered(_batch(80, 2, seed) + dgs)
    q = deque(dgs)
    fifo = keys.Fifo([b"popped"] * 5 + dgs)  # its array starts past the head
    for _ in range(5):
        fifo.popleft()
    total = sum(map(len, dgs))
    for nbytes in (0, 1, 35, 36, 64, 9000, 9001, 65_536, 1 << 20, total, total + 1):
        for count in (1, 2, 7, 64, len(q), len(q) + 5, 1024):
            want_head, want_sizes = packet_keys._py_take(q, nbytes, count)
            for queue in (q, fifo):
                head, sizes = keys.take(queue, nbytes, count)
                assert len(head) == len(want_head) and all(
                    a is b for a, b in zip(head, want_head, strict=True)
                )
                assert list(sizes) == list(want_sizes)
                assert sizes[len(head) - 1] == want_sizes[-1]
    assert list(q) == list(fifo) == dgs


@pytest.mark.parametrize("seed", range(8))
def test_a_fifo_is_the_deque_the_outbox_uses(keys: ModuleType, seed: int) -> None:
    """The operations the outbox makes on a send queue (append, extend,
    popleft, len, q[i], del q[i], iteration, clear) leave a Fifo and a
    deque the same, whatever the order; each holds a reference to what it
    holds and drops it when the item leaves; the errors are the same kinds."""
    rng = random.Random(seed)
    fifo, dq = keys.Fifo(), deque()
    made = 0
    pops = 0.75 if seed % 2 else 0.45  # some seeds keep it short: its array is reused
    for _ in range(3000):
        op = rng.random()
        if op < 0.3:
            x = made.to_bytes(8, "big")
            made += 1
            fifo.append(x)
            dq.append(x)
        elif op < 0.45:
            xs = [(made + i).to_bytes(8, "big") for i in range(rng.choice((0, 1, 5, 40, 300)))]
            made += len(xs)
            fifo.extend(xs if rng.random() < 0.5 else iter(xs))
            dq.extend(xs)
        elif op < pops and dq:
            assert fifo.popleft() is dq.popleft()
        elif op < pops + 0.1 and dq:
            i = rng.randrange(-len(dq), len(dq))
            assert fifo[i] is dq[i]
            if rng.random() < 0.5:
                del fifo[i]
                del dq[i]
        elif op < pops + 0.11:
            fifo.clear()
            dq.clear()
        assert len(fifo) == len(dq) and bool(fifo) == bool(dq)
        if rng.random() < 0.05:
            assert list(fifo) == list(dq)
    assert list(fifo) == list(dq)
    # most of a long queue sent, then more queued: the rest moves to the front
    xs = [i.to_bytes(8, "big") for i in range(1000)]
    fifo, dq = keys.Fifo(xs[:100]), deque(xs[:100])
    for _ in range(90):
        assert fifo.popleft() is dq.popleft()
    fifo.extend(xs[100:130])
    dq.extend(xs[100:130])
    for x in xs[130:]:
        fifo.append(x)
        dq.append(x)
    assert list(fifo) == list(dq) and fifo[0] is xs[90]
    one = b"held by the queue" + bytes(rng.randrange(9))
    held = sys.getrefcount(one)
    q = keys.Fifo([one, one])
    assert sys.getrefcount(one) == held + 2
    del q[0]
    assert sys.getrefcount(one) == held + 1
    q.extend([one])
    got = q.popleft()
    assert got is one and sys.getrefcount(one) == held + 2  # q's one and got
    del got, q
    assert sys.getrefcount(one) == held
    with pytest.raises(IndexError):
        keys.Fifo().popleft()
    with pytest.raises(IndexError):
        keys.Fifo([1])[1]
    with pytest.raises(IndexError):
        del keys.Fifo([1])[-2]
    with pytest.raises(TypeError):
        keys.Fifo([1])[0] = 2
    with pytest.raises(TypeError):
        keys.Fifo(5)
    q = keys.Fifo([1])
    with pytest.raises(ValueError):
        q.extend(q)


def test_the_outbox_queues_are_fifos_where_built(keys: ModuleType) -> None:
    if os.environ.get("DLCP_NATIVE_KEYS") == "0":
        pytest.skip("DLCP_NATIVE_KEYS=0 turns the extension off")
    assert type(peer._new_queue()) is keys.Fifo


def test_take_rejects_bad_input(keys: ModuleType) -> None:
    with pytest.raises(IndexError):
        keys.take(deque(), 100, 10)
    with pytest.raises(IndexError):
        keys.take(keys.Fifo(), 100, 10)
    with pytest.raises(ValueError):
        keys.take(deque([b"x" * 40]), 100, 0)
    with pytest.raises(TypeError):
        keys.take(deque([b"x" * 40, 5]), 100, 10)
    with pytest.raises(TypeError):
        keys.take(deque([b"x" * 40]), 100)  # type: ignore[call-arg]
    assert keys.take([b"x" * 40, b"y" * 40], 10, 10)[0] == [b"x" * 40]  # at least one


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_by_class_equals_the_python_definition(keys: ModuleType, seed: int) -> None:
    """Each class's datagrams in their order and the trail class (the highest
    non-droppable class below the last), from C as from Python; the same
    errors for a class out of range and for lengths that differ."""
    rng = random.Random(seed)
    n = rng.randrange(1, 300)
    dgs = [os.urandom(rng.randrange(40, 80)) for _ in range(n)]
    top = rng.choice([1, 3, 8])  # classes 0 .. top - 1 used
    classes = [rng.randrange(top) for _ in range(n)]
    drop = bytes(rng.choice([0, 0, 1]) for _ in range(n))
    got = keys.by_class(dgs, classes, drop, 8)
    want = packet_keys._py_by_class(dgs, classes, drop, 8)
    assert got == want
    lists, trail = got
    assert [dg for part in lists if part for dg in part] == [
        dg for c in range(8) for dg, k in zip(dgs, classes, strict=True) if k == c
    ]
    first = [d for d, k in zip(dgs, classes, strict=True) if k == classes[0]]
    assert all(a is b for a, b in zip(lists[classes[0]] or [], first, strict=True))  # no copies
    kept = [k for k, d in zip(classes, drop, strict=True) if not d and k < 7]
    assert trail == (max(kept) if kept else -1)
    for f in (keys.by_class, packet_keys._py_by_class):
        with pytest.raises(ValueError, match=r"not in 0\.\.7"):
            f(dgs[:2], [0, 8], bytes(2), 8)
        with pytest.raises(ValueError, match=r"not in 0\.\.7"):
            f(dgs[:2], [-1, 0], bytes(2), 8)
        with pytest.raises(ValueError, match="drop bytes"):
            f(dgs[:2], [0, 1], bytes(3), 8)


def test_clamped_classes_equals_the_python_definition(keys: ModuleType) -> None:
    """Priorities in range come back as the same list; others are clamped into
    0..7 in a new one; one class or not, from C as from Python."""
    big = int("300")  # an int object of its own, equal to another 300
    cases = [[], [3], [2] * 50, [1, 2, 3], [-1, 9, 3], [300, big], [7, 7, 8], [0, -5]]
    rng = random.Random(4)
    cases += [[rng.randrange(-2, 10) for _ in range(rng.randrange(1, 60))] for _ in range(50)]
    for prios in cases:
        got = keys.clamped_classes(prios, 8)
        want = packet_keys._py_clamped_classes(prios, 8)
        assert got == want, prios
        assert got[1] == (len(set(prios)) <= 1)
        assert got[0] == [min(max(p, 0), 7) for p in prios]
        if all(0 <= p < 8 for p in prios):
            assert got[0] is prios and want[0] is prios  # no copy
    for f in (keys.clamped_classes, packet_keys._py_clamped_classes):
        with pytest.raises(TypeError):
            f([1, "2"], 8)
