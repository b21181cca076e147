"""An in-memory network of protocol engines with loss, reordering and duplication.

Virtual time: nothing sleeps. Each datagram gets a random delay (so packets
overtake each other), may be lost or duplicated. A `drop` predicate lets a test
decide per datagram (e.g. drop every packet of one class).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from dlcp.core.engine import Engine, Event, Send


@dataclass
class Network:
    engines: dict[int, Engine]
    seed: int = 0
    loss: float = 0.0
    duplicate: float = 0.0
    delay: tuple[float, float] = (0.0001, 0.002)  # uniform one-way delay: reorders packets
    drop: Callable[[int, Send], bool] | None = None  # (src, send) -> drop it
    now: float = 0.0
    sent: int = 0
    lost: int = 0
    events: dict[int, list[Event]] = field(default_factory=dict)
    _queue: list[tuple[float, int, int, int, bytes]] = field(default_factory=list)
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        for n in self.engines:
            self.events.setdefault(n, [])

    def flush(self, src: int) -> None:
        for s in self.engines[src].datagrams_to_send():
            self.sent += 1
            if (self.drop is not None and self.drop(src, s)) or self.rng.random() < self.loss:
                self.lost += 1
                continue
            copies = 2 if self.rng.random() < self.duplicate else 1
            # what goes on the wire is read now, as the kernel copies a datagram
            # when it is sent (a Gathered one reads its payload in place)
            dg = s.datagram if isinstance(s.datagram, bytes) else bytes(s.datagram)
            for _ in range(copies):
                self.deliver_at(self.now + self.rng.uniform(*self.delay), src, s.node, dg)
        while (ev := self.engines[src].next_event()) is not None:
            self.events[src].append(ev)

    def deliver_at(self, at: float, src: int, dst: int, datagram: bytes) -> None:
        """Have `datagram` from `src` arrive at `dst` at time `at`."""
        heapq.heappush(self._queue, (at, next(self._seq), src, dst, datagram))

    def flush_all(self) -> None:
        for n in self.engines:
            self.flush(n)

    def run(self, until: float = 60.0, done: Callable[[], bool] | None = None) -> None:
        """Deliver datagrams and fire timers until idle, `done()`, or `until`."""
        self.flush_all()
        while self.now < until:
            if done is not None and done():
                return
            timers = [t for e in self.engines.values() if (t := e.get_timer()) is not None]
            next_timer = min(timers) if timers else None
            next_packet = self._queue[0][0] if self._queue else None
            if next_timer is None and next_packet is None:
                return
            if next_packet is not None and (next_timer is None or next_packet <= next_timer):
                at, _, src, dst, dg = heapq.heappop(self._queue)
                self.now = max(self.now, at)
                self.engines[dst].receive(dg, self.now, src=src)
                self.flush(dst)
            else:
                assert next_timer is not None
                self.now = max(self.now, next_timer)
                for n, e in self.engines.items():
                    t = e.get_timer()
                    if t is not None and t <= self.now:
                        e.handle_timer(self.now)
                        self.flush(n)
