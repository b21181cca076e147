"""The event heap: callbacks in (time, sequence) order, a virtual clock.

Nothing sleeps and nothing is random here: two runs of the same events handle
them in the same order.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

__all__ = ["EventLoop", "Timer", "TooManyEvents"]


class TooManyEvents(RuntimeError):
    """A run went past its event budget (a livelock, or a budget too small)."""


class EventLoop:
    """A heap of `(t, seq, fn, args)`; `run` calls them in order.

    One heap entry may stand for a run of events due at once, one after the
    other (`Port.offer_many`: a batch of frames off an unshaped NIC): its
    handler counts each after the first against `left`, the events still
    allowed before `run` next asks `done()`, and where none is left pushes
    what remains back under its own `(t, seq)`. So `events` counts, and
    `run` stops after, the same events as with one heap entry each."""

    __slots__ = ("_heap", "_seq", "events", "left", "max_events", "now")

    def __init__(self, max_events: int = 10**9) -> None:
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self.events = 0
        self.left = 0  # events this chunk of `run` may still handle
        self.max_events = max_events

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Call `fn(*args)` at virtual time `t` (not before now)."""
        heapq.heappush(self._heap, (t if t > self.now else self.now, next(self._seq), fn, args))

    def push(self, t: float, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        """`at` for callers that know `t` is not before now (the ports: a
        packet's times are now plus what it takes): no clamp, no varargs."""
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def push_seq(self, t: float, fn: Callable[..., None], args: tuple[Any, ...], seq: int) -> None:
        """`push` under a `seq` already drawn (`next_seq`): what is left of a
        run of events, back in the heap where it was."""
        heapq.heappush(self._heap, (t, seq, fn, args))

    def next_seq(self) -> int:
        """A sequence number, as `push` draws one, for an entry pushed later."""
        return next(self._seq)

    def run(self, until: float, done: Callable[[], bool] | None = None, check: int = 4096) -> None:
        """Handle events until none is left, `until` is passed, or `done()`
        (asked every `check` events)."""
        heap, pop = self._heap, heapq.heappop
        while heap and heap[0][0] <= until:
            left = check
            while left > 0 and heap:  # a chunk, then the checks
                t, seq, fn, args = pop(heap)
                if t > until:  # (back where it was: its key is unique)
                    heapq.heappush(heap, (t, seq, fn, args))
                    break
                self.now = t
                self.left = left - 1
                fn(*args)
                left = self.left
            n = check - left
            self.events += n
            if self.events > self.max_events:
                raise TooManyEvents(f"more than {self.max_events} events by t={self.now:.6f} s")
            if done is not None and n == check and done():
                break

    def pending(self) -> int:
        return len(self._heap)


class Timer:
    """One deadline that is moved often (a retransmission timer re-armed by
    every ACK): `fn()` is called at the last deadline `set`, unless `cancel`ed.
    The heap holds one event for it, not one a `set`: a deadline moved later
    is found when the earlier event comes due and pushed again then; moved
    earlier, it gets an event of its own (the later one is then stale)."""

    __slots__ = ("_fire", "_queued", "deadline", "fn", "loop")

    def __init__(self, loop: EventLoop, fn: Callable[[], None]) -> None:
        self.loop, self.fn = loop, fn
        self.deadline: float | None = None
        self._queued: float | None = None  # the earliest event in the heap for it
        self._fire = self._due

    def set(self, t: float) -> None:
        self.deadline = t
        q = self._queued
        if q is None or t < q:
            self._queued = t
            self.loop.push(t if t > self.loop.now else self.loop.now, self._fire, (t,))

    def cancel(self) -> None:
        self.deadline = None

    def _due(self, t: float) -> None:
        if self._queued == t:
            self._queued = None
        d = self.deadline
        if d is None:
            return
        if d > t:  # moved later since this event was pushed
            if self._queued is None or d < self._queued:
                self._queued = d
                self.loop.push(d, self._fire, (d,))
            return
        if d < t:  # an earlier event of its own fired before this one (a stale one)
            return
        self.deadline = None
        self.fn()
