"""One all-reduce operation (job, round, bucket) at one node: what it holds and
the phase it is in.

A `Round` holds everything of its operation that is still live here: this
node's contribution and the collector of the results (while it takes part),
the aggregators of the shards it owns that are still being summed, the
finished shards kept for receivers' NACKs and ACKs, the gathered datagrams
that read the caller's buffers, and a completion held for ACKs. Its phase
changes only through `Round.move`, by the one table below (in the spirit of
h11's `_state.py`): every transition a round can make is a line of it.

What a node remembers after a round ended (late packets) is
`dlcp.core.closed.ClosedRounds`'s; the table of open rounds and the work that
drives them is `dlcp.core.rounds.OpenRounds`'s.
"""

from __future__ import annotations

import enum

from dlcp.core.aggregate import ShardAggregator
from dlcp.core.collector import ResultCollector
from dlcp.core.early import EarlyResults
from dlcp.core.records import ALLREDUCE, JobSpec, OpKey, RoundComplete, _Contribution, _Finished
from dlcp.errors import LocalError

__all__ = ["TRANSITIONS", "Phase", "Round", "Step"]


class Phase(enum.Enum):
    """Where a round stands at this node."""

    AGGREGATING = "aggregating"  # shards owned here summed; no contribution of this node
    OPEN = "open"  # this node's contribution is out; its collector waits for results
    HELD = "held"  # complete here; its completion waits for receivers' ACKs
    CLOSED = "closed"  # completed or failed here; finished shards still served


class Step(enum.Enum):
    """What moves a round from one phase to another."""

    SUBMIT = "submit"  # this node's contribution (`Engine.submit`)
    COMPLETE = "complete"  # every shard's results are in: the caller is told
    HOLD = "hold"  # every shard's results are in, gathered ones not yet ACKed
    RELEASE = "release"  # a held round's ACKs are in or its wait is over
    FAIL = "fail"  # timed out, an internal error, or its job removed


# (phase, step) -> the next phase. A round begins AGGREGATING (a peer's data
# or this node's own shard opens it); a CLOSED one is submitted again only
# once `ClosedRounds` has forgotten it (after `timing.retain`) while some of
# its finished shards are still kept.
TRANSITIONS: dict[tuple[Phase, Step], Phase] = {
    (Phase.AGGREGATING, Step.SUBMIT): Phase.OPEN,
    (Phase.CLOSED, Step.SUBMIT): Phase.OPEN,
    (Phase.OPEN, Step.COMPLETE): Phase.CLOSED,
    (Phase.OPEN, Step.HOLD): Phase.HELD,
    (Phase.HELD, Step.RELEASE): Phase.CLOSED,
    (Phase.OPEN, Step.FAIL): Phase.CLOSED,
    (Phase.AGGREGATING, Step.FAIL): Phase.CLOSED,
    # an internal error in a shard outliving a round `ClosedRounds` forgot
    (Phase.CLOSED, Step.FAIL): Phase.CLOSED,
}


class Round:
    """The live state of one operation at this node."""

    __slots__ = (
        "agg_seq",
        "aggs",
        "collector",
        "collector_seq",
        "contribution",
        "early",
        "finished",
        "gathered",
        "held",
        "held_seq",
        "kind",
        "op",
        "phase",
        "ready",
        "spec",
    )

    def __init__(self, spec: JobSpec, op: OpKey) -> None:
        self.spec = spec
        self.op = op
        self.phase = Phase.AGGREGATING
        self.contribution: _Contribution | None = None  # while OPEN: kept for data NACKs
        self.collector: ResultCollector | None = None  # while OPEN
        # shards owned here being summed, and when each opened (in the
        # table's order: timers visit every round's shards in that order)
        self.aggs: dict[int, ShardAggregator] = {}
        self.agg_seq: dict[int, int] = {}
        # of those, the shards whose whole packets' results go early (dlcp.core.early)
        self.early: dict[int, EarlyResults] = {}
        self.collector_seq = 0
        # summed shards kept until every receiver ACKs or `until`
        self.finished: dict[int, _Finished] = {}
        # this node's lists of Gathered datagrams (`Engine(gather=True)`),
        # whose payloads lie in the caller's buffers (`lanes`, `out`)
        self.gathered: list[list[bytes]] = []
        self.held: tuple[float, RoundComplete] | None = None  # while HELD: (due, event)
        self.held_seq = 0
        # what the round moves (`records.ROUND_KINDS`): known once submitted here
        self.kind = ALLREDUCE
        # an all-gather's receivers whose DONE manifest ("ready") came
        self.ready: set[int] = set()

    def move(self, step: Step) -> None:
        """Take `step`: the next phase by `TRANSITIONS`, or a LocalError."""
        nxt = TRANSITIONS.get((self.phase, step))
        if nxt is None:
            raise LocalError(f"round {self.op}: no {step.value} when {self.phase.value}")
        self.phase = nxt

    def unacked_gathered(self) -> list[list[bytes]]:
        """The datagrams of this round's result shards that this node sent from
        the caller's buffer in place and some receiver has yet to ACK."""
        return [
            f.datagrams
            for f in self.finished.values()
            if f.gathered and f.waiting and f.datagrams is not None
        ]

    def idle(self) -> bool:
        """Whether nothing of the round is live here any more (the table drops it)."""
        return (
            self.phase in (Phase.AGGREGATING, Phase.CLOSED)
            and not self.aggs
            and not self.finished
            and not self.gathered
        )
