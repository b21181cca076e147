"""Where a bucket's time goes between DDP handing it over and its future completing.

The hook stamps each bucket (`BucketTimes`, `time.perf_counter()` seconds) as
it passes: handed over, encoded, written to the segment, submitted, the
daemon's reply received (on the client's reader thread), the reply taken up
by the step's end, decoded, future completed; the daemon's reply adds its
own round time (`elapsed_s`). `Timeline` keeps the last steps' stamps and
summarises them as medians per phase (`summary`), which `dlcp bench ddp`
reports. A few float stores per bucket: cheap enough to stay on.

Phases of one bucket (seconds):

- encode: norms and the codec's encode;
- write: the lanes and metadata into the segment;
- submit: the SUBMIT request on the Unix socket;
- queue: submit sent to the daemon's round start (the reply's turnaround
  less the daemon's own round time: the socket, and the daemon busy with
  earlier work; negative where a peer's packets started the round on this
  daemon before the submit came);
- daemon: the daemon's round, from its start to its reply (the wire);
- result: the reply received until the step's end takes it up (the rest of
  the backward pass, or earlier buckets' decoding);
- agree: taken up until its decode begins: the later buckets' replies, the
  step's agreement (every
  rank's outcome, one small all-reduce that waits for the slowest rank) and
  the decoding of the buckets before it;
- decode: the out region averaged into the bucket; a bucket decoded while
  the agreement is in flight (`StepFinisher`), from that decode's start to
  the agreement's answer (its wait for the slowest rank is then here);
- complete: the future completed (DDP's callbacks run inline);
- total: handed over to completed.

Per step: `step` (first bucket handed over to the last completed), `hooks`
(the time backward spent inside the hook, summed over buckets: the shim's
cost on the compute thread), `finish` (the step's end in the last bucket's
hook: waiting for replies, the agreement, decoding), `in_flight` (the most
buckets submitted and not yet replied at once).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PHASES", "BucketTimes", "StepTimes", "Timeline"]

PHASES: tuple[str, ...] = (
    "encode",
    "write",
    "submit",
    "queue",
    "daemon",
    "result",
    "agree",
    "decode",
    "complete",
    "total",
)
STEP_PHASES: tuple[str, ...] = ("step", "hooks", "finish", "in_flight")

_NAN = float("nan")


@dataclass(slots=True)
class BucketTimes:
    """One bucket's stamps (perf_counter seconds; NaN: not reached)."""

    bucket: int
    nbytes: int
    handed: float
    encoded: float = _NAN
    written: float = _NAN
    submitted: float = _NAN
    left: float = _NAN  # the hook returned to DDP
    replied: float = _NAN  # on the client's reader thread
    seen: float = _NAN  # the step's end took the reply up
    decoding: float = _NAN  # its decode began (after the step's agreement)
    decoded: float = _NAN
    completed: float = _NAN
    daemon_s: float = _NAN  # the daemon's round time, from its reply

    def phases(self) -> dict[str, float]:
        turnaround = self.replied - self.submitted
        return {
            "encode": self.encoded - self.handed,
            "write": self.written - self.encoded,
            "submit": self.submitted - self.written,
            "queue": turnaround - self.daemon_s,
            "daemon": self.daemon_s,
            "result": self.seen - self.replied,
            "agree": self.decoding - self.seen,
            "decode": self.decoded - self.decoding,
            "complete": self.completed - self.decoded,
            "total": self.completed - self.handed,
        }


@dataclass(slots=True)
class StepTimes:
    """One step's buckets and the time its end took (in the last bucket's hook)."""

    buckets: list[BucketTimes] = field(default_factory=list)
    finish_s: float = _NAN

    def phases(self) -> dict[str, float]:
        done = [b for b in self.buckets if b.completed == b.completed]  # not NaN
        if not done:
            return {name: _NAN for name in STEP_PHASES}
        hooks = sum(b.left - b.handed for b in self.buckets if b.left == b.left)
        return {
            "step": max(b.completed for b in done) - min(b.handed for b in self.buckets),
            "hooks": hooks,
            "finish": self.finish_s,
            "in_flight": float(_most_in_flight(self.buckets)),
        }


def _most_in_flight(buckets: list[BucketTimes]) -> int:
    events = []
    for b in buckets:
        if b.submitted == b.submitted and b.replied == b.replied:
            events += [(b.submitted, 1), (b.replied, -1)]
    most = now = 0
    for _, d in sorted(events):
        now += d
        most = max(most, now)
    return most


def _median(values: list[float]) -> float | None:
    clean = [v for v in values if v == v]
    return statistics.median(clean) if clean else None


class Timeline:
    """The stamps of the last `keep` steps (not thread-safe but for `replied`,
    a single float store from the reader thread)."""

    def __init__(self, keep: int = 64) -> None:
        self.steps: deque[StepTimes] = deque(maxlen=keep)
        self._current: StepTimes | None = None

    def bucket(self, index: int, nbytes: int, now: float) -> BucketTimes:
        """A new bucket of the current step, handed over at `now`."""
        if self._current is None:
            self._current = StepTimes()
        b = BucketTimes(index, nbytes, now)
        self._current.buckets.append(b)
        return b

    def end_step(self, finish_s: float) -> None:
        """The step's buckets are all completed (or failed)."""
        if self._current is not None:
            self._current.finish_s = finish_s
            self.steps.append(self._current)
        self._current = None

    def clear(self) -> None:
        self.steps.clear()

    def summary(self, last: int | None = None) -> dict[str, Any]:
        """Medians (seconds) over the last `last` steps (default: all kept):
        per bucket phase (`phases`), per bucket index (`by_bucket`) and per
        step (`step`); `steps` and `buckets` count what they rest on."""
        steps = list(self.steps)[-last:] if last else list(self.steps)
        buckets = [b for s in steps for b in s.buckets]
        rows = [b.phases() for b in buckets]
        by_bucket: dict[str, dict[str, float | None]] = {}
        for index in sorted({b.bucket for b in buckets}):
            mine = [b.phases() for b in buckets if b.bucket == index]
            sizes = [b.nbytes for b in buckets if b.bucket == index]
            entry: dict[str, float | None] = {"bytes": float(max(sizes))}
            entry.update({name: _median([r[name] for r in mine]) for name in PHASES})
            by_bucket[str(index)] = entry
        per_step = [s.phases() for s in steps]
        return {
            "steps": len(steps),
            "buckets": len(buckets),
            "phases": {name: _median([r[name] for r in rows]) for name in PHASES},
            "by_bucket": by_bucket,
            "step": {name: _median([r[name] for r in per_step]) for name in STEP_PHASES},
        }
