"""The baseline: ring all-reduce (Gloo's default algorithm for a buffer) over
one TCP flow from each host to the next, flows pinned to a spine by ECMP's
hash of their 5-tuple, unmarked (the switch's default class, as Gloo's TCP).

The bucket is cut into `hosts` chunks; in 2 (hosts - 1) steps each host
sends a chunk to its successor, step k once it holds step k - 1's chunk from
its predecessor (reduce-scatter, then all-gather). Left out: Gloo's
pipelining of a chunk in smaller pieces, the sums' CPU time, connection
setup (the flows persist across rounds, as Gloo's pairs do, so a round
starts with the last one's window).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from dlcp.sim.events import EventLoop
from dlcp.sim.fabric import TC, Fabric
from dlcp.sim.settings import Settings
from dlcp.sim.tcp import TcpFlow, deliver

__all__ = ["RingRun"]


class RingRun:
    def __init__(self, s: Settings, progress: Callable[[int, int], None] | None = None) -> None:
        self.s, self.progress = s, progress
        self.loop = EventLoop()
        self.fabric = Fabric(self.loop, s.topo(), seed=s.seed)
        H = s.hosts
        hpl = self.fabric.topo.hosts_per_leaf
        for h in range(H):
            self.fabric.add_endpoint(h // hpl, deliver)
        self.chunk = -(-s.size_bytes // H)
        self.steps = 2 * (H - 1)
        self.flows = [
            TcpFlow(
                self.fabric, h, (h + 1) % H, cls=TC.default_class,
                spine=self.fabric.ecmp_spine(h, (h + 1) % H, 0), on_data=self._data_for(h),
            )
            for h in range(H)
        ]  # fmt: skip
        self.received = [0] * H  # bytes each host got from its predecessor, all rounds
        self.sent_steps = [0] * H  # steps each host has written, all rounds
        self.rng = random.Random(f"{s.seed}/skew")
        self.round = -1
        self.starts: list[float] = [0.0] * H
        self.ends: dict[int, float] = {}
        self.times: list[float] = []
        self.finished_at = 0.0  # when the last round completed everywhere
        s.scenario.install(self.fabric, H, s.seed)

    def _data_for(self, sender: int) -> Callable[[int], None]:
        me = (sender + 1) % self.s.hosts

        def got(n: int) -> None:
            self.received[me] += n
            self._advance(me)

        return got

    def _advance(self, h: int) -> None:
        """Write every step host `h` may now send; note its round's end."""
        base = self.round * self.steps
        have = self.received[h] // self.chunk  # whole chunks from the predecessor
        started = h in self._started
        while started and self.sent_steps[h] < base + self.steps and self.sent_steps[h] <= have:
            self.sent_steps[h] += 1
            self.flows[h].write(self.chunk)
        if started and have >= base + self.steps and h not in self.ends:
            self.ends[h] = self.loop.now
            if len(self.ends) == self.s.hosts:
                self._round_done()

    def _start_round(self) -> None:
        self.round += 1
        self.ends = {}
        self._started: set[int] = set()
        now = self.loop.now
        for h in range(self.s.hosts):
            self.loop.at(now + self.rng.uniform(0.0, self.s.skew_s), self._start_host, h)

    def _start_host(self, h: int) -> None:
        self.starts[h] = self.loop.now
        self._started.add(h)
        self._advance(h)

    def _round_done(self) -> None:
        s = self.s
        t = max(self.ends[h] - self.starts[h] for h in range(s.hosts))
        self.finished_at = self.loop.now
        if self.round >= s.warmup:
            self.times.append(t)
        if self.progress is not None:
            self.progress(self.round + 1, s.warmup + s.iters)
        if self.round + 1 < s.warmup + s.iters:
            self.loop.at(self.loop.now + s.gap_s, self._start_round)

    def run(self) -> list[float]:
        s = self.s
        self._started = set()
        self.loop.at(0.0, self._start_round)
        total = s.warmup + s.iters
        self.loop.run(total * (s.timeout_s + 1), lambda: len(self.times) == s.iters, check=256)
        return self.times

    def tcp_counts(self) -> dict[str, int]:
        return {
            "retransmits": sum(f.retransmits for f in self.flows),
            "fast_retransmits": sum(f.fast_retransmits for f in self.flows),
            "timeouts": sum(f.timeouts for f in self.flows),
            "tail_probes": sum(f.probes for f in self.flows),
            "rack_marked": sum(f.sb.marked for f in self.flows),
        }
