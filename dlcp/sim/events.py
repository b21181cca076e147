"""The event heap: callbacks in (time, sequence) order, a virtual clock.

Nothing sleeps and nothing is random here: two runs of the same events handle
them in the same order.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any

__all__ = ["EventLoop", "TooManyEvents"]


class TooManyEvents(RuntimeError):
    """A run went past its event budget (a livelock, or a budget too small)."""


class EventLoop:
    """A heap of `(t, seq, fn, args)`; `run` calls them in order."""

    __slots__ = ("_heap", "_seq", "events", "max_events", "now")

    def __init__(self, max_events: int = 10**9) -> None:
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self.events = 0
        self.max_events = max_events

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Call `fn(*args)` at virtual time `t` (not before now)."""
        heapq.heappush(self._heap, (t if t > self.now else self.now, next(self._seq), fn, args))

    def run(self, until: float, done: Callable[[], bool] | None = None, check: int = 4096) -> None:
        """Handle events until none is left, `until` is passed, or `done()`
        (asked every `check` events)."""
        heap, pop = self._heap, heapq.heappop
        n = 0
        while heap and heap[0][0] <= until:
            t, _, fn, args = pop(heap)
            self.now = t
            fn(*args)
            n += 1
            if n % check == 0:
                self.events += check
                if self.events > self.max_events:
                    raise TooManyEvents(f"more than {self.max_events} events by t={t:.6f} s")
                if done is not None and done():
                    break
        self.events += n % check

    def pending(self) -> int:
        return len(self._heap)
