"""`Outbox.push_many` leaves the outbox exactly as `push` one datagram at a time
does, and the outbox (push, push_many and flush) behaves exactly as the one
before its bulk paths (tests/outbox_reference.py): the same send calls (same
datagrams, in the same order, on the same paths, in the same classes) at the
same times, the same queues, repeats, DONE barriers, trail classes, per-path
tracking for NACKs, counters and pacers after every step. The script is a
random mix of DATA and RESULT packets (droppable, retransmitted, several
classes and out-of-range priorities), DONEs held behind their shard or not,
and repeats, over 1 and 2 paths, paced and unpaced, with sockets that sometimes
take only part of a batch (no sockets)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from dlcp.core.rate import RateConfig
from dlcp.daemon import outbox as outbox_mod
from dlcp.daemon import packet_keys, pathloss
from dlcp.daemon.outbox import Outbox, Peer
from dlcp.policies import from_config
from dlcp.wire import Flags, Header, PacketType, encode
from tests import outbox_reference

KEY = bytes(range(32))
JOB = 7


class ScriptedPath:
    """A UdpPath stand-in that records every send call and, on some calls
    (decided by the call's number, so two outboxes that behave the same see the
    same), takes only part of the batch (a full socket)."""

    def __init__(self, address: str, seed: int) -> None:
        self.address = address
        self.calls: list[tuple[tuple[bytes, ...], tuple[str, int], int]] = []
        self._rng = random.Random(seed)

    def send(self, batch: list[bytes], dest: tuple[str, int], tos: int) -> int:
        n = len(batch)
        if self._rng.random() < 0.1:
            n = self._rng.randrange(0, n + 1)
        self.calls.append((tuple(batch[:n]), dest, tos))
        return n


def make(
    n_paths: int, paced: bool, seed: int, cls: type = Outbox
) -> tuple[Outbox, Peer, list[ScriptedPath]]:
    paths = [ScriptedPath(f"10.0.{p}.1", seed + p) for p in range(n_paths)]
    rate = RateConfig(initial_rate_bps=1e9, min_rate_bps=1e6) if paced else RateConfig()
    ob = cls(
        paths,
        dscp=(48, 40, 34, 26, 18, 10, 0, 8),
        rate=rate,
        pacing=paced,
        balancer_factory=lambda: from_config("balance", "spray"),
    )
    peer = ob.peer(tuple(f"10.0.{p}.2" for p in range(n_paths)), 7400, 0.0)
    return ob, peer, paths


def packet(kind: PacketType, shard: int, index: int, *, flags: Flags = Flags.NONE) -> bytes:
    """Packet `index` of a shard (sizes vary: jumbo, small, and the odd short
    one); an ACK or a NACK (of `index % 5 + 1` packets) of the shard."""
    count = (2200, 300, 17)[index % 3] if kind != PacketType.DONE else 0
    payload = np.zeros(count, np.float32).tobytes()
    if kind == PacketType.ACK:
        count, payload = 0, b""
    elif kind == PacketType.NACK:
        count = index % 5 + 1
        payload = np.arange(count, dtype=">u4").tobytes()
    h = Header(kind, JOB, 3, 1 + shard // 4, flags=flags, priority=0, shard=shard % 4,
               sender=0, contributors=2 if kind == PacketType.RESULT else 1,
               offset=index * 2200, count=count, total=1 << 24)  # fmt: skip
    return encode(h, payload, KEY)


Op = tuple[str, Any]


def script(seed: int, steps: int = 60) -> list[Op]:
    """A random mix of pushes (as chunks) and flushes."""
    rng = random.Random(seed)
    acks = random.Random(-seed)  # the ACKs and NACKs: the rest as it was without them
    ops: list[Op] = []
    sent: list[bytes] = []  # everything pushed so far: repeats come from here
    next_index: dict[tuple[int, int], int] = {}
    for _ in range(steps):
        chunk: list[tuple[bytes, int]] = []
        for _ in range(rng.choice((1, 2, 5, 12, 40, 90))):
            r = rng.random()
            shard = rng.randrange(6)
            if r < 0.12:  # a DONE (data or result leg), maybe behind packets still queued
                leg = rng.random() < 0.4
                flags = Flags.LAST | (Flags.RESULT_LEG if leg else Flags.NONE)
                chunk.append((packet(PacketType.DONE, shard, 0, flags=flags), rng.randrange(3)))
            elif r < 0.2 and sent:  # a repeat (still queued or not), any class
                chunk.append((rng.choice(sent), rng.randrange(-1, 9)))
            else:
                kind = PacketType.RESULT if rng.random() < 0.3 else PacketType.DATA
                flags = Flags.NONE
                if rng.random() < 0.15:
                    flags |= Flags.DROPPABLE
                if rng.random() < 0.1:
                    flags |= Flags.RETRANSMIT
                key = (shard, int(kind))
                # runs: mostly the next packet of the shard, sometimes an old one
                i = next_index.get(key, 0)
                next_index[key] = i + 1
                if rng.random() < 0.1:
                    i = rng.randrange(i + 1)
                prio = 7 if flags & Flags.DROPPABLE else rng.choice((1, 2, 2, 2, 3, 5, 9, -1))
                chunk.append((packet(kind, shard, i, flags=flags), prio))
        if rng.random() < 0.5:  # a run of one shard and class: the bulk path
            shard, kind = rng.randrange(6), rng.choice((PacketType.DATA, PacketType.RESULT))
            key = (shard, int(kind))
            prio = rng.choice((2, 2, 3, 7, 9))
            run = []
            for _ in range(rng.randrange(4, 70)):
                i = next_index.get(key, 0)
                next_index[key] = i + 1
                run.append((packet(kind, shard, i), prio))
            if acks.random() < 0.4:  # an ACK or NACK among them (maybe one queued already)
                kind = acks.choice((PacketType.ACK, PacketType.NACK))
                run.insert(acks.randrange(len(run)), (packet(kind, shard, acks.randrange(2)), 1))
            if rng.random() < 0.5:  # and its DONE, held behind it
                run_leg = Flags.RESULT_LEG if kind == PacketType.RESULT else Flags.NONE
                run.append((packet(PacketType.DONE, shard, 0, flags=Flags.LAST | run_leg), 0))
            if rng.random() < 0.5:  # on its own
                sent.extend(dg for dg, _ in chunk)
                ops.append(("push", chunk))
                chunk = []
            chunk += run
        sent.extend(dg for dg, _ in chunk)
        ops.append(("push", chunk))
        if rng.random() < 0.6:
            ops.append(("flush", rng.uniform(0.0001, 0.003)))
    return ops


def state(ob: Outbox, peer: Peer, paths: list[ScriptedPath]) -> dict[str, Any]:
    extra = {}
    if isinstance(ob, outbox_reference.Outbox):  # its keys, as the outbox spells them
        bkey, tkey = _old_barrier_key, _old_tracked_key
        tracked, tracked_old = peer.tracked, peer.tracked_old
    else:
        tracked, tracked_old = peer.sent_paths.as_dicts()
        bkey = tkey = _same
        extra["unwatched"] = sum(1 for k, v in peer.inflight.items() if v and k not in peer.watched)
    return extra | {
        "queues": [list(q) for q in peer.queues],
        "queued": peer.queued,
        "pending": set(peer.pending) if bkey is not _same else _pending(peer),
        "inflight": {bkey(k): v for k, v in peer.inflight.items() if v},
        # in order: the oldest go first
        "trail_class": [(bkey(k), v) for k, v in peer.trail_class.items()],
        "held": {bkey(k): v for k, v in peer.held.items()},
        "sent_packets": dict(peer.sent_packets),
        "sent_bytes": dict(peer.sent_bytes),
        "tracked": {tkey(k): v for k, v in tracked.items()},
        "tracked_old": {tkey(k): v for k, v in tracked_old.items()},
        "shard_paths": [(bkey(k), v) for k, v in peer.shard_paths.items()],
        "repeats": ob.repeats,
        "backlog": peer in ob.backlog,
        "next_wake": ob.next_wake,
        "blocked": ob.blocked,
        "calls": [list(p.calls) for p in paths],
        # the pacers' whole state, read without refilling them
        "pacers": None if peer.pacers is None else [dict(vars(p)) for p in peer.pacers],
    }


def _same(key: bytes) -> bytes:
    return key


def _pending(peer: Peer) -> set[bytes]:
    """The identities a push must not queue again (what the reference keeps in
    its `pending`: every queued packet's but DONEs'), checked against what the
    outbox keeps: those of the packets of shards it watches, and of the others
    that are not DATA/RESULT packets; no more."""
    queued = [dg for q in peer.queues for dg in q if dg[3] != PacketType.DONE]
    ids = {packet_keys._identity(dg) for dg in queued}
    kept = {
        packet_keys._identity(dg)
        for dg in queued
        if dg[3] not in outbox_mod._DR or packet_keys._barrier_key(dg) in peer.watched
    }
    assert kept <= peer.pending <= ids
    assert peer.watched <= {k for k, v in peer.inflight.items() if v}
    return ids


def _old_barrier_key(key: bytes) -> bytes:
    """The reference's (job, round, bucket, shard) + b"d" or b"r": the leg's type
    byte first."""
    return bytes((1 if key[-1:] == b"d" else 2,)) + key[:-1]


def _old_tracked_key(key: bytes) -> bytes:
    """The reference's (job, round, bucket, shard, offset, type): the type first."""
    return key[-1:] + key[:-1]


def replay(
    ops: list[Op],
    n_paths: int,
    paced: bool,
    seed: int,
    push: Callable[..., int],
    cls: type = Outbox,
) -> list[dict[str, Any]]:
    """Run the script on a fresh outbox of class `cls`; `push(ob, peer, chunk)`
    queues a chunk. Returns the state after every step."""
    ob, peer, paths = make(n_paths, paced, seed, cls)
    now = 0.0
    out = []
    for op, arg in ops:
        if op == "push":
            queued = push(ob, peer, arg)
            assert 0 <= queued <= len(arg)
        else:
            now += arg
            ob.flush(now)
        out.append(state(ob, peer, paths))
    for _ in range(10_000):  # drain: flush at every wake-up asked for
        if not ob.queued():
            break
        now = max(now + 1e-4, ob.next_wake or 0.0)
        ob.flush(now)
        out.append(state(ob, peer, paths))
    assert not ob.queued()
    return out


def one_by_one(ob: Outbox, peer: Peer, chunk: list[tuple[bytes, int]]) -> int:
    return sum(ob.push(peer, dg, prio) for dg, prio in chunk)


def at_once(ob: Outbox, peer: Peer, chunk: list[tuple[bytes, int]]) -> int:
    return ob.push_many(peer, [dg for dg, _ in chunk], [prio for _, prio in chunk])


@pytest.mark.parametrize("n_paths", [1, 2])
@pytest.mark.parametrize("paced", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 4])
def test_push_many_is_push_one_by_one(
    n_paths: int, paced: bool, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ops = script(seed)
    want = replay(ops, n_paths, paced, seed, one_by_one, outbox_reference.Outbox)
    watch = outbox_mod._watch
    watched: list[bool] = []  # per call: whether some of the shard was queued (at_once's)

    def counted(peer: Peer, bkey: bytes) -> None:
        watched.append(bool(peer.inflight.get(bkey)))
        watch(peer, bkey)

    monkeypatch.setattr(outbox_mod, "_watch", counted)
    for push in (one_by_one, at_once):
        watched.clear()
        got = replay(ops, n_paths, paced, seed, push)
        assert len(got) == len(want)
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            for field in w:
                assert g[field] == w[field], (push.__name__, step, field)
    # the script did exercise what it is meant to
    final = want[-1]
    assert final["repeats"] > 0
    # push_many took both ways: shards queued unwatched (no identities kept),
    # and watched when pushed again while queued (their queued packets looked up)
    assert any(g["unwatched"] for g in got) and any(watched)
    assert sum(len(c[0]) for p in final["calls"] for c in p) > 500
    assert any(w["held"] for w in want)  # some DONEs were held behind their shard
    assert len({tos for p in final["calls"] for _, _, tos in p}) >= 4  # several classes


def test_an_ack_among_a_fresh_shard_is_looked_up_alone() -> None:
    """A shard's first send with an ACK or NACK among its packets keeps no
    identity for its DATA packets, only for the ACK, and an ACK still queued
    is a repeat there as anywhere: the same queues and counts as the
    reference pushing one by one."""
    ack, nack = packet(PacketType.ACK, 0, 0), packet(PacketType.NACK, 1, 2)
    first = [(packet(PacketType.DATA, 0, i), 2) for i in range(10)]
    first.insert(5, (ack, 1))
    second = [(packet(PacketType.DATA, 1, i), 2) for i in range(8)]
    second[3:3] = [(nack, 1), (ack, 1), (nack, 1)]
    ops: list[Op] = [("push", first), ("push", second), ("flush", 0.001)]
    want = replay(ops, 1, False, 0, one_by_one, outbox_reference.Outbox)
    got = replay(ops, 1, False, 0, at_once)
    assert [{f: g[f] for f in w} for g, w in zip(got, want, strict=True)] == want
    assert want[1]["repeats"] == 2 and want[1]["queued"] == 11 + 9
    ob, peer, _ = make(1, False, 0)
    assert at_once(ob, peer, first) == 11
    assert peer.pending == {packet_keys._identity(ack)} and not peer.watched
    assert at_once(ob, peer, second) == 9 and ob.repeats == 2


def test_push_many_with_a_small_trail_and_tracking(monkeypatch: Any) -> None:
    # the oldest shards' trail classes and tracked paths are forgotten on the way
    monkeypatch.setattr(outbox_mod, "SHARDS_TRACKED", 4)
    monkeypatch.setattr(pathloss, "SHARDS_TRACKED", 4)
    monkeypatch.setattr(pathloss, "TRACKED_PER_GENERATION", 16)
    monkeypatch.setattr(outbox_reference, "SHARDS_TRACKED", 4)
    monkeypatch.setattr(outbox_reference, "TRACKED_PER_GENERATION", 16)
    ops = script(7)
    for n_paths in (1, 2):
        want = replay(ops, n_paths, False, 7, one_by_one, outbox_reference.Outbox)
        for push in (one_by_one, at_once):
            got = replay(ops, n_paths, False, 7, push)
            assert [{f: g[f] for f in w} for g, w in zip(got, want, strict=True)] == want


def test_push_many_counts_and_checks() -> None:
    ob, peer, _ = make(1, False, 0)
    dgs = [packet(PacketType.DATA, 0, i) for i in range(6)]
    assert ob.push_many(peer, dgs, [2] * 6) == 6
    assert ob.push_many(peer, dgs[:3] + [packet(PacketType.DATA, 0, 9)] * 2, [1] * 5) == 1
    assert ob.repeats == 4 and peer.queued == 7
    assert ob.push_many(peer, [], []) == 0
    with pytest.raises(Exception, match="priorities"):
        ob.push_many(peer, dgs, [2])


@pytest.mark.parametrize("drops", [[1], [0, 3], list(range(10))])
def test_a_run_of_one_class_with_droppable_packets_keeps_the_trail(drops: list[int]) -> None:
    """A shard's run in one class below the droppable one, some of it (or all)
    droppable: the trail class is that class while any packet is not
    droppable, as pushing one by one gives it."""
    run = [
        (packet(PacketType.DATA, 0, i, flags=Flags.DROPPABLE if i in drops else Flags.NONE), 2)
        for i in range(10)
    ]
    ops: list[Op] = [("push", run), ("flush", 0.001)]
    want = replay(ops, 1, False, 0, one_by_one, outbox_reference.Outbox)
    got = replay(ops, 1, False, 0, at_once)
    assert [{f: g[f] for f in w} for g, w in zip(got, want, strict=True)] == want
    assert bool(got[0]["trail_class"]) == (len(drops) < 10)
