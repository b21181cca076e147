"""The engine hands out its datagrams in `SendBatch`es (one per run of a
shard's packets, one per control packet) and the daemon queues them per peer
without looking at each datagram:

- every batch's datagrams are one job's, for its node, with the priority class
  and droppable flag their headers carry, in the order the per-datagram form
  (`datagrams_to_send`) gives; none is for the node that made it (a collector
  waiting for its own shard does not NACK itself for the DONE);
- `NetworkOut.enqueue` pushes each run of consecutive batches for one peer in one
  `push_many`, in order, skips batches for unknown jobs or nodes, and never
  changes the lists the engine keeps (a finished shard's result datagrams).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from dlcp.core.engine import Engine, JobSpec, RoundComplete, Send, SendBatch
from dlcp.daemon.netout import NetworkOut
from dlcp.wire import Codec, Flags, PacketType
from dlcp.wire.batch import HEADER_DTYPE
from dlcp.wire.header import HEADER_SIZE, Header

SECRET = b"b" * 32
JOB = 21


def _round_traffic(n: int, seed: int) -> list[tuple[int, SendBatch]]:
    """Every batch of two rounds among `n` engines, 10 % of datagrams lost."""
    rng = np.random.default_rng(seed)
    engines = []
    for me in range(n):
        e = Engine()
        e.add_job(JobSpec.transpose(JOB, SECRET, me, n, payload=800))
        engines.append(e)
    seen: list[tuple[int, SendBatch]] = []
    now = 0.0
    for rnd in range(2):
        for e in engines:
            lanes = rng.standard_normal(4000).astype("<f4").view(np.uint8)
            e.submit(
                job=JOB, round=rnd, bucket=0, codec=Codec.FP32, total=4000, lanes=lanes, now=now
            )
        done = 0
        for _ in range(400):
            moved = False
            for src, e in enumerate(engines):
                for b in e.send_batches():
                    seen.append((src, b))
                    for dg in b.datagrams:
                        moved = True
                        if rng.random() >= 0.1:
                            engines[b.node].receive(dg, now, src)
            for e in engines:
                while (ev := e.next_event()) is not None:
                    assert isinstance(ev, RoundComplete), ev
                    done += 1
            if done == n:
                break
            if not moved:
                now += 0.05
                for e in engines:
                    e.handle_timer(now)
        assert done == n
    return seen


def test_batches_carry_their_datagrams_headers() -> None:
    seen = _round_traffic(3, seed=1)
    kinds = {b.kind for _, b in seen}
    assert kinds == {"data", "result", "control"}, kinds
    assert any(len(b.datagrams) > 1 for _, b in seen)
    for src, b in seen:
        assert b.node != src  # no NACK to itself
        assert len(b.priorities) == len(b.datagrams)
        assert b.droppable is None or len(b.droppable) == len(b.datagrams)
        for i, dg in enumerate(b.datagrams):
            h = np.frombuffer(dg[:HEADER_SIZE], HEADER_DTYPE)[0]
            assert h["job"] == JOB and h["sender"] == src
            assert b.priorities[i] == h["priority"]
            dropped = bool(h["flags"] & Flags.DROPPABLE)
            assert dropped == (False if b.droppable is None else b.droppable[i])
            want = {"data": PacketType.DATA, "result": PacketType.RESULT}.get(b.kind)
            if want is None:
                assert len(b.datagrams) == 1 and h["type"] not in (
                    PacketType.DATA,
                    PacketType.RESULT,
                )
            else:
                assert h["type"] == want
    # one Send per datagram, in the same order, with the same fields
    for _, b in seen:
        sends = b.sends()
        assert [s.datagram for s in sends] == b.datagrams
        assert all(isinstance(s, Send) and s.node == b.node and s.kind == b.kind for s in sends)
        assert [s.priority for s in sends] == b.priorities


def test_datagrams_to_send_is_the_batches_one_by_one() -> None:
    pair = []
    for _ in range(2):
        e = Engine()
        e.add_job(JobSpec.transpose(JOB, SECRET, 0, 3, payload=800))
        e.submit(
            job=JOB, round=0, bucket=0, codec=Codec.FP32, total=3000, lanes=bytes(12000), now=0.0
        )
        pair.append(e)
    flat = [s for b in pair[0].send_batches() for s in b.sends()]
    assert flat and pair[1].datagrams_to_send() == flat
    assert pair[0].send_batches() == [] and pair[1].datagrams_to_send() == []


class _Outbox:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, list[bytes], list[int]]] = []

    def push_many(self, peer: Any, dgs: list[bytes], prios: list[int]) -> int:
        self.calls.append((peer, list(dgs), list(prios)))
        return len(dgs)


class _Peer:
    health = None  # one path: not probed

    def __init__(self, name: str) -> None:
        self.name = name


class _Job:
    def __init__(self, nodes: list[int]) -> None:
        self.peers = {n: _Peer(f"peer{n}") for n in nodes}


def _dg(job: int, tag: int) -> bytes:
    return Header(PacketType.DATA, job, 0, 0, count=1, total=1, contributors=1).pack() + bytes(
        [tag] * 20
    )


def test_enqueue_pushes_each_peers_run_of_batches_at_once() -> None:
    jobs: Any = {1: _Job([1, 2]), 2: _Job([1])}
    outbox = _Outbox()
    out = NetworkOut(jobs=jobs, outbox=outbox, credits=None, counters=Counter())  # type: ignore[arg-type]
    kept = [_dg(1, 0), _dg(1, 1)]  # an engine's retained list (result datagrams)
    kept_prios = [3, 4]
    batches = [
        SendBatch(1, kept, kept_prios, None, "result"),
        SendBatch(1, [_dg(1, 2)], [0], None, "control"),  # same peer: one push
        SendBatch(1, [_dg(2, 3)], [0], None, "control"),  # job 2's node 1: another peer
        SendBatch(2, [], [], None, "data"),  # empty: skipped
        SendBatch(3, [_dg(1, 4)], [0], None, "control"),  # no such node: skipped
        SendBatch(1, [_dg(9, 5)], [0], None, "control"),  # no such job: skipped
        SendBatch(2, [_dg(1, 6), _dg(1, 7)], [5, 6], [True, False], "data"),
        SendBatch(2, [_dg(1, 8)], [2], [False], "data"),
    ]
    out.enqueue(batches, 0.0)
    calls = outbox.calls
    got = [(peer.name, [dg[-1] for dg in dgs], prios) for peer, dgs, prios in calls]
    assert got == [
        ("peer1", [0, 1, 2], [3, 4, 0]),
        ("peer1", [3], [0]),
        ("peer2", [6, 7, 8], [5, 6, 2]),
    ]
    assert calls[1][0] is jobs[2].peers[1]
    assert len(kept) == 2 and kept_prios == [3, 4]  # the engine's lists are untouched
