"""An egress port as the testbed builds a switch port (dlcp/tc/plan.py).

Eight classes in strict priority (class 0 first), a pfifo per class holding at
most `limits[c]` packets (the tc plan's 1000, and 16 for the droppable class),
line rate counted in wire bytes (what HTB counts: the Ethernet frame without
FCS), then the link's propagation delay. HTB's small guaranteed per-class
rates are left out (at 1/1000 of the link they do not change the order).
Random loss is applied as the far end receives a packet (the testbed's
nftables ingress chain on the next switch port); a port set down drops all
it is offered and what it holds.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from dlcp.sim.events import EventLoop

__all__ = ["NUM_CLASSES", "Packet", "Port"]

NUM_CLASSES = 8


class Packet:
    """One frame in flight: its class, wire bytes, endpoints, the route (ports
    in order) and where it is on it, and what the endpoint reads (`data`)."""

    __slots__ = ("cls", "data", "dst", "hop", "route", "src", "wire")

    def __init__(
        self, cls: int, wire: int, src: int, dst: int, route: Sequence[Port], data: Any
    ) -> None:
        self.cls, self.wire, self.src, self.dst = cls, wire, src, dst
        self.route, self.hop, self.data = route, 0, data


class Port:
    """Serves its queues at `rate_bps` (None: no queue, only the delay), then
    hands each packet to the next port of its route, or to `deliver`. An
    idle port sends at once; a serve event is due only while packets wait."""

    __slots__ = (
        "_arrive_cb",
        "_arrive_many_cb",
        "_serve_cb",
        "busy",
        "busy_s",
        "delay",
        "deliver",
        "depth",
        "down",
        "drops",
        "free_at",
        "limits",
        "loop",
        "loss",
        "lost",
        "name",
        "queued",
        "queues",
        "rate_bps",
        "rng",
        "sent_bytes",
        "sent_packets",
        "tier",
    )  # fmt: skip

    def __init__(
        self,
        loop: EventLoop,
        name: str,
        rate_bps: float | None,
        delay: float,
        limits: Sequence[int],
        deliver: Callable[[Packet], None],
        *,
        tier: str = "host",
        seed: int = 0,
    ) -> None:
        self.loop, self.name, self.rate_bps, self.delay = loop, name, rate_bps, delay
        self.limits = list(limits)
        self.deliver = deliver
        self.tier = tier  # which kind of link: host-up, host-down, leaf-up, spine-down
        self.queues: list[deque[Packet]] = [deque() for _ in range(NUM_CLASSES)]
        self.queued = 0
        self.busy = False  # a serve is due at free_at
        self.free_at = 0.0  # when the packet on the wire is out
        self.down = False
        self.loss = 0.0  # random loss at the far end, 0..1
        self.rng = random.Random(f"{seed}/{name}")
        self.drops = [0] * NUM_CLASSES  # queue overflow, per class
        self.lost = 0  # random loss
        self.depth = [0] * NUM_CLASSES  # each queue's deepest
        self.sent_bytes = 0
        self.sent_packets = 0
        self.busy_s = 0.0
        self._arrive_cb = self._arrive  # (bound once: one a packet costs an allocation)
        self._arrive_many_cb = self._arrive_many
        self._serve_cb = self._serve

    def offer(self, pkt: Packet) -> None:
        """A packet arrives at this port: sent at once when the port is idle
        (one event: its arrival at the far end), else queued by class."""
        if self.down:
            self.drops[pkt.cls] += 1
            return
        loop = self.loop
        now = loop.now
        rate = self.rate_bps
        if rate is None:
            self.sent_bytes += pkt.wire
            self.sent_packets += 1
            loop.push(now + self.delay, self._arrive_cb, (pkt,))
            return
        if not self.queued and now >= self.free_at:  # idle: on the wire now
            tx = pkt.wire * 8 / rate
            self.busy_s += tx
            self.sent_bytes += pkt.wire
            self.sent_packets += 1
            self.free_at = done = now + tx
            loop.push(done + self.delay, self._arrive_cb, (pkt,))
            return
        cls = pkt.cls
        q = self.queues[cls]
        n = len(q)
        if n >= self.limits[cls]:
            self.drops[cls] += 1
            return
        q.append(pkt)
        if n >= self.depth[cls]:
            self.depth[cls] = n + 1
        self.queued += 1
        if not self.busy:  # (busy: a serve is due at free_at)
            self.busy = True
            loop.push(self.free_at if self.free_at > now else now, self._serve_cb, ())

    def _serve(self) -> None:
        """The wire is free: the first packet of the highest class waiting goes
        on it; another serve when its last bit is out, while packets wait."""
        self.busy = False
        if not self.queued:
            return
        for q in self.queues:
            if q:
                pkt = q.popleft()
                break
        self.queued -= 1
        loop = self.loop
        assert self.rate_bps is not None
        tx = pkt.wire * 8 / self.rate_bps
        self.busy_s += tx
        self.sent_bytes += pkt.wire
        self.sent_packets += 1
        self.free_at = done = loop.now + tx
        loop.push(done + self.delay, self._arrive_cb, (pkt,))
        if self.queued:
            self.busy = True
            loop.push(done, self._serve_cb, ())

    def offer_many(self, pkts: list[Packet]) -> None:
        """`offer` of each of `pkts`, all of one class, at an unshaped port
        (`rate_bps` None): their arrivals at the far end, all due at once
        and one after the other, as one heap entry (`_arrive_many`)."""
        assert self.rate_bps is None
        if self.down:
            self.drops[pkts[0].cls] += len(pkts)
            return
        self.sent_packets += len(pkts)
        for pkt in pkts:
            self.sent_bytes += pkt.wire
        loop = self.loop
        seq = loop.next_seq()
        loop.push_seq(loop.now + self.delay, self._arrive_many_cb, (pkts, 0, seq), seq)

    def _arrive_many(self, pkts: list[Packet], i: int, seq: int) -> None:
        """`_arrive` of `pkts[i:]` in order, each an event of `loop.left`; the
        rest back in the heap under `seq` when the loop's chunk is spent."""
        loop, arrive = self.loop, self._arrive
        n = len(pkts)
        while True:
            arrive(pkts[i])
            i += 1
            if i == n:
                return
            if loop.left <= 0:
                loop.push_seq(loop.now, self._arrive_many_cb, (pkts, i, seq), seq)
                return
            loop.left -= 1

    def _arrive(self, pkt: Packet) -> None:
        if self.loss and self.rng.random() < self.loss:
            self.lost += 1
            return
        hop = pkt.hop + 1
        pkt.hop = hop
        route = pkt.route
        if hop < len(route):
            route[hop].offer(pkt)
        else:
            self.deliver(pkt)

    def set_down(self, down: bool) -> None:
        """Down: nothing crosses it, what it holds is dropped."""
        self.down = down
        if down:
            for c, q in enumerate(self.queues):
                self.drops[c] += len(q)
                q.clear()
            self.queued = 0

    def utilisation(self, seconds: float) -> float:
        """Share of `seconds` it was sending (0 for an unshaped port)."""
        if self.rate_bps is None or seconds <= 0:
            return 0.0
        return min(1.0, self.sent_bytes * 8 / self.rate_bps / seconds)
