"""A NIC's batch of frames as one heap entry (`Fabric.send_frames` into
`Port.offer_many`, `EventLoop.left`) against one heap event a frame: on
random traffic through a leaf-spine fabric, with random loss and a port
taken down, both must deliver the same packets at the same virtual times,
leave every port's counters the same, count the same events and, asked
`done()` every few events, stop after the same ones."""

from __future__ import annotations

import random
from typing import Any

import pytest

from dlcp.sim.events import EventLoop
from dlcp.sim.fabric import Fabric, Topology
from dlcp.sim.port import Packet, Port


def _one_event_a_packet(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NICs as they were: each frame offered alone, its arrival at the
    switch an event of its own."""

    def offer_many(self: Port, pkts: list[Packet]) -> None:
        for p in pkts:
            self.offer(p)

    monkeypatch.setattr(Port, "offer_many", offer_many)


def _traffic(seed: int, check: int, stop_after: int | None) -> dict[str, Any]:
    """Random batches between 12 hosts on 3 leaves (all classes, 1 to 40
    frames, some dropped at the 16-packet queues), 2 % loss at the NICs, a
    spine's downlink down for a while; the run stopped once `stop_after`
    packets were delivered (asked every `check` events)."""
    loop = EventLoop()
    topo = Topology(kind="leafspine", rate_bps=1e9, hosts_per_leaf=4, spines=2, oversub=2)
    fabric = Fabric(loop, topo, seed=seed)
    got: list[tuple[float, int, int, int, bytes]] = []
    for h in range(12):
        fabric.add_endpoint(h // 4, lambda p, h=h: got.append((loop.now, h, p.src, p.cls, p.data)))
    fabric.set_ingress_loss(range(12), 0.02)
    rng = random.Random(seed)

    def send(src: int, dst: int, cls: int, sizes: list[int], spine: int) -> None:
        frames = [bytes([src, dst, k % 256]) + bytes(n) for k, n in enumerate(sizes)]
        fabric.send_frames(src, dst, cls, frames, 42, spine)

    t = 0.0
    for _ in range(600):
        t += rng.expovariate(1 / 20e-6)
        src = rng.randrange(12)
        dst = (src + 1 + rng.randrange(11)) % 12
        sizes = [rng.choice((60, 700, 1400)) for _ in range(rng.choice((1, 1, 2, 3, 8, 40)))]
        loop.at(t, send, src, dst, rng.randrange(8), sizes, rng.randrange(2))
    port = fabric.spine_down[1][2]
    loop.at(t / 3, port.set_down, True)
    loop.at(t / 2, port.set_down, False)

    def done() -> bool:
        return stop_after is not None and len(got) >= stop_after

    loop.run(1.0, done, check=check)
    ports = [
        (p.name, p.drops, p.lost, p.depth, p.sent_bytes, p.sent_packets, p.busy_s, p.free_at)
        for p in fabric.ports()
    ]
    return {"got": got, "ports": ports, "events": loop.events, "now": loop.now}


@pytest.mark.parametrize(
    ("seed", "check", "stop_after"),
    [(0, 4096, None), (1, 256, None), (2, 1, 900), (3, 2, 1500), (4, 3, 400), (5, 7, 2500)],
)
def test_batched_ports_deliver_and_count_as_one_event_a_packet(
    monkeypatch: pytest.MonkeyPatch, seed: int, check: int, stop_after: int | None
) -> None:
    fast = _traffic(seed, check, stop_after)
    with monkeypatch.context() as m:
        _one_event_a_packet(m)
        slow = _traffic(seed, check, stop_after)
    assert len(fast["got"]) > 300
    assert fast == slow


def test_a_batch_split_by_the_loops_chunks_keeps_its_place() -> None:
    """A NIC's batch cut by `run`'s checks between its frames: the rest is
    handled before an event due at the same time but pushed after it."""
    loop = EventLoop()
    seen: list[Any] = []
    port = Port(loop, "nic", None, 1e-6, [100] * 8, lambda p: seen.append(p.data))
    port.offer_many([Packet(0, 100, 0, 1, (port,), k) for k in range(5)])
    loop.at(1e-6, seen.append, "later")  # due with the batch, pushed after it
    checks: list[int] = []

    def done() -> bool:
        checks.append(len(seen))
        return False

    loop.run(1.0, done, check=2)
    assert seen == [0, 1, 2, 3, 4, "later"]
    assert loop.events == 6 and checks == [2, 4, 6]
