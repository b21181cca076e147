"""Which path probes a daemon sends when, over all its peers (sans-IO).

Each peer's `PathHealth` says when each of its paths wants a probe (every
`interval` while there is traffic, every `down_interval` while down); a
daemon of N peers on P paths would send N x P probes an `interval` and echo
as many: at 64 hosts on 4 paths 25,200 probes a second each way a daemon, a
CPU cost a round pays whatever its data. `ProbePlan` keeps the due times in
heaps, so that a pump costs O(probes due) and not O(peers x paths), and sends
at most `budget` routine probes an `interval` (a token bucket of `budget`
tokens, 0: no bound):

- the due probes go in the order they fell due (the longest waiting first,
  whichever peer: none starves);
- the probes of suspect and probing paths, whose answers take a path out of
  use or back in, go first and at once, outside the budget: one an
  `interval` while suspect (from its first miss to its `down_after`-th: about
  `down_after` - 1 + `timeout` / `interval` probes, 4.5 at the defaults) or
  probing (`up_after` echoes), so they add a burst when a path fails (a
  spine: a path to every peer), and otherwise about the probe loss rate;
- when the budget holds back routine probes, each path is probed about every
  E = `interval` x max(1, N x P / `budget`) (and, down, every max(E,
  `down_interval`));
- the probes' deadlines cost nothing from the budget: a probe unanswered past
  its deadline is judged when it falls due.

How long a dead path takes to be found down (`detection_bound`): its next
routine probe within E (and a token's wait, `interval` / `budget`), whose
deadline (`timeout`, or `rtt_factor` probe round trips if longer) makes it
suspect; then it is probed every `interval`, and `down_after` - 1 more
deadlines take it down: at most E + 2 deadlines + (`down_after` - 2) x
`interval`. At the defaults (10 ms, 25 ms, 3 misses, budget 32): 3 hosts on
2 paths, E = 10 ms, 70 ms (45-50 ms in tests/test_probeplan.py's harness,
1 ms round trips); 16 hosts on 4 paths, E = 19 ms, 80 ms; 64 hosts on 4
paths, E = 79 ms, 140 ms (63-128 ms there), a dead spine (one path to every
peer) as well as one path; 144 hosts on 4 paths, E = 179 ms, 240 ms.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from dlcp.core.pathhealth import HealthConfig, PathHealth
from dlcp.errors import LocalError

__all__ = ["ProbePlan", "detection_bound"]

K = TypeVar("K", bound=Hashable)
_ONE = 1.0 - 1e-9  # a whole token (a refill to the token's due time may round under 1)


def detection_bound(config: HealthConfig, paths: int, budget: int) -> float:
    """The longest a dead path of one of `paths` probed paths (all peers')
    stays in use at `budget` probes an interval (0: no bound), with probe
    round trips under `config.timeout` / `config.rtt_factor`: see the module."""
    cfg = config
    every = cfg.interval * (max(1.0, paths / budget) if budget else 1.0)
    token = cfg.interval / budget if budget else 0.0
    return every + token + 2 * cfg.timeout + (cfg.down_after - 2) * cfg.interval


@dataclass(slots=True)
class _Slot(Generic[K]):
    key: K
    health: PathHealth
    pushed: list[tuple[float, bool] | None]  # per path: its entry in the heaps
    deadline: float | None = None  # its entry in the deadline heap
    woken: bool = False


@dataclass(slots=True)
class _Heaps:
    urgent: list[tuple[float, int, int]] = field(default_factory=list)  # (due, slot, path)
    routine: list[tuple[float, int, int]] = field(default_factory=list)
    deadlines: list[tuple[float, int]] = field(default_factory=list)  # (at, slot)


class ProbePlan(Generic[K]):
    """The probes of every peer's paths (`add`), at most `budget` an interval
    (the first peer's `HealthConfig.interval`: a daemon's peers share one)."""

    def __init__(self, budget: int = 0) -> None:
        if not (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0):
            raise LocalError(f"probe budget must be an integer >= 0, got {budget!r}")
        self.budget = budget
        self._rate = 0.0  # tokens a second (set by the first `add`)
        self._tokens = float(budget)
        self._filled = -math.inf  # when the tokens were counted
        self._slots: list[_Slot[K]] = []
        self._h = _Heaps()
        self._woken: list[int] = []
        # the peers woken (traffic after idle, a path's state changed) and
        # rescheduled since their caller last read (and cleared) this
        self.touched: list[K] = []
        self.held = 0  # times due probes waited for a token

    def __len__(self) -> int:
        return len(self._slots)

    def add(self, key: K, health: PathHealth) -> None:
        """Plan `health`'s probes under `key` (a peer): from its next `touch`."""
        i = len(self._slots)
        if not i:
            self._rate = self.budget / health.config.interval
        self._slots.append(_Slot(key, health, [None] * health.n_paths))
        health.on_wake = lambda: self._wake(i)
        self._wake(i)

    def _wake(self, i: int) -> None:
        slot = self._slots[i]
        if not slot.woken:
            slot.woken = True
            self._woken.append(i)

    def _reschedule(self) -> None:
        """The woken peers' entries, and their keys to `touched`."""
        for i in self._woken:
            slot = self._slots[i]
            slot.woken = False
            self._refresh(i, slot)
            self.touched.append(slot.key)
        self._woken.clear()

    def _refresh(self, i: int, slot: _Slot[K]) -> None:
        """Entries for `slot`'s paths whose due time or urgency changed, and
        its earliest deadline if sooner than its entry."""
        h, heaps = slot.health, self._h
        for path in range(h.n_paths):
            at = h.probe_at(path)
            if at is None:
                continue
            key = (at, h.urgent(path))
            if slot.pushed[path] != key:
                slot.pushed[path] = key
                heapq.heappush(heaps.urgent if key[1] else heaps.routine, (at, i, path))
        d = h.next_deadline()
        if d is not None and (slot.deadline is None or d < slot.deadline):
            slot.deadline = d
            heapq.heappush(heaps.deadlines, (d, i))

    def _valid(self, entry: tuple[float, int, int], urgent: bool) -> bool:
        """Whether a probe heap's entry is its path's current one (else it is
        dropped: a newer one was pushed, or the peer went idle)."""
        slot = self._slots[entry[1]]
        if slot.pushed[entry[2]] != (entry[0], urgent):
            return False
        return slot.health.probe_at(entry[2]) == entry[0] and slot.health.urgent(entry[2]) == urgent

    def due(self, now: float) -> list[tuple[K, int, int]]:
        """(peer, path, sequence number) of each probe to send now (they count
        as sent), after judging the deadlines that passed; the peers whose
        state this changed are in `touched`."""
        self._reschedule()
        heaps, slots = self._h, self._slots
        dls = heaps.deadlines
        while dls and dls[0][0] <= now:
            at, i = heapq.heappop(dls)
            slot = slots[i]
            if slot.deadline != at:
                continue  # a sooner one was pushed (and taken) since
            slot.deadline = None
            if slot.health.active(now):  # idle: its late probes say nothing
                slot.health.poll(now)
                self._refresh(i, slot)
        out: list[tuple[K, int, int]] = []
        if self.budget:
            self._tokens = min(float(self.budget), self._tokens + (now - self._filled) * self._rate)
            self._filled = now
        for heap, urgent in ((heaps.urgent, True), (heaps.routine, False)):
            while heap and heap[0][0] <= now:
                if not urgent and self.budget and self._tokens < _ONE:
                    self.held += 1
                    return out
                entry = heapq.heappop(heap)
                slot = slots[entry[1]]
                path = entry[2]
                if not self._valid(entry, urgent):
                    if slot.pushed[path] == (entry[0], urgent):
                        slot.pushed[path] = None
                    continue
                slot.pushed[path] = None
                seq = slot.health.probe(path, now)
                if seq is None:  # idle: nothing more until its next touch
                    continue
                if not urgent:
                    self._tokens -= 1.0
                out.append((slot.key, path, seq))
                self._refresh(entry[1], slot)
        return out

    def next_timer(self) -> float | None:
        """When `due` has something to do next (None: nothing planned); the
        stale entries on top of the heaps are dropped on the way."""
        if self._woken:
            self._reschedule()
        heaps, slots = self._h, self._slots
        t: float | None = None
        for heap, urgent in ((heaps.urgent, True), (heaps.routine, False)):
            while heap and not self._valid(heap[0], urgent):
                entry = heapq.heappop(heap)
                slot = slots[entry[1]]
                if slot.pushed[entry[2]] == (entry[0], urgent):
                    slot.pushed[entry[2]] = None
            if heap:
                at = heap[0][0]
                if not urgent and self.budget and self._tokens < _ONE:  # a token's wait
                    at = max(at, self._filled + (1.0 - self._tokens) / self._rate)
                if t is None or at < t:
                    t = at
        dls = heaps.deadlines
        while dls and slots[dls[0][1]].deadline != dls[0][0]:
            heapq.heappop(dls)
        if dls and (t is None or dls[0][0] < t):
            return dls[0][0]
        return t
