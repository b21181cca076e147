"""A shard aggregator's clock: when the shard may complete (every required
packet in, the loss bound met), the NACKs it sends and when (`poll`,
`next_timer`: per sender, what came after a missing packet says of it, that
sender's NACK clock and manifest), and when it gives up.

`ShardClock` owns its times (when the shard opened, last heard from, was
last NACKed, met its bound), per sender the NACKs yet unanswered and a
`PacketStream` (dlcp.core.stream: its asks, the packets found lost); it
reads the aggregator's arrival record (which packets came, which are
droppable, whose manifest is in), arrays the aggregator fills in place and
hands it once, at construction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from dlcp.core.aggtypes import Nack, _Tick
from dlcp.core.stream import PacketStream
from dlcp.core.timing import NackClock, Timing, done_wait, note_late, reorder_wait, repeat_wait

__all__ = ["ShardClock"]


class ShardClock:
    """Completion, NACK timing and time-out of one shard aggregator."""

    def __init__(
        self,
        *,
        shard: int,
        senders: tuple[int, ...],
        rows: Mapping[int, int],
        counts: np.ndarray,
        received: np.ndarray,
        droppable: np.ndarray,
        manifest: np.ndarray,
        timing: Timing,
        clocks: Mapping[int, NackClock],
        now: float,
    ) -> None:
        self.shard = shard
        self.senders = senders
        self._row = rows  # sender node -> row (the aggregator's)
        self.timing = timing
        # per sender node, how soon it answers NACKs (the engine's, shared by
        # every shard of the job); a sender without one: `nack_interval`
        self.clocks = clocks
        # the aggregator's arrival record (read only here; filled in place there)
        self.counts = counts
        self.received = received
        self.droppable = droppable
        self.manifest = manifest
        s = len(self.senders)
        self.created = now
        self.last_arrival = now
        self.done_at: float | None = None  # when every required packet and the bound were met
        self.last_nack = np.full(s, -math.inf)
        # per sender row, the NACKs sent to it since it last answered one (the
        # first, then those that asked again: `_asked`)
        self.unanswered = [0] * s
        # the rows found to hold every packet (`received` only ever gains them)
        self._complete_rows: set[int] = set()
        # per sender row, its asks and the packets found lost by later arrivals
        self.streams = [PacketStream(received[row]) for row in range(s)]
        self._unknown = np.zeros(received.shape[1], dtype=bool)  # a row's, before its DONE

    # -- decisions --------------------------------------------------------
    def _required_missing(self, row: int | None = None) -> np.ndarray:
        """Per sender and packet (of sender row `row` only, if given): missing
        and not known to be droppable."""
        if row is not None:
            return ~self.received[row] & ~self.droppable[row]
        return ~self.received & ~self.droppable

    def poll(self, now: float, bound: float) -> tuple[list[Nack], bool]:
        """Advance timers: NACKs to send, and whether the shard is to complete
        now (every packet in, or the required ones and `bound` met for the
        linger time)."""
        if self.received.all():
            return [], True
        nacks: list[Nack] = []
        required = self._required_missing()
        total = int(self.counts.sum()) * len(self.senders)
        have = int((self.received * self.counts).sum())
        within = have >= (1.0 - bound) * total
        if self.manifest.all() and not required.any() and within:
            if self.done_at is None:
                self.done_at = now
            if now >= self.done_at + self.timing.linger:
                return [], True
            return [], False
        # Something required is missing. Ask for what is known lost at once
        # (`PacketStream`), for the rest once it is overdue.
        quiet = now >= self.last_arrival + self.timing.nack_delay
        for row, node in enumerate(self.senders):
            stream = self.streams[row]
            found = stream.due(now, self._reorder(row))
            if found.size:
                found = found[~self.droppable[row, found]]
            wait = self.repeat_after(row)
            again = now >= self.last_nack[row] + wait
            need_manifest = False
            ask = found
            if self.manifest[row]:
                if quiet and required[row].any():
                    ask = np.union1d(found, stream.repeat_due(required[row], now, wait))
                elif quiet and again and self.manifest.all() and not within:
                    # Required data is in but the bound is not met: ask for the
                    # droppable packets needed to reach it.
                    reach = self._to_reach_bound(row, total - have, total, bound)
                    ask = np.union1d(found, reach)
            else:
                # No DONE. What is found lost is asked for flagged so (the sender
                # leaves out those of them it sent as droppable, which this node
                # cannot tell yet); the DONE itself alone, once the shard has
                # gone quiet.
                need_manifest = again and now >= self._manifest_due(row)
                if ask.size:
                    nacks.append(Nack(node, self.shard, tuple(ask.tolist()), need_manifest=True))
                    self._asked(row, ask, now)
                    ask = ask[:0]
            if ask.size or need_manifest:
                nacks.append(
                    Nack(node, self.shard, tuple(ask.tolist()), need_manifest=need_manifest)
                )
                self._asked(row, ask, now)
        return nacks, False

    def _asked(self, row: int, ask: np.ndarray, now: float) -> None:
        """Sender row `row` was sent a NACK for packets `ask` (or for its DONE
        alone) at `now` (`PacketStream.ask`)."""
        if self.streams[row].ask(ask, now) or not self.unanswered[row]:
            # the back-off counts NACKs that ask again: those for packets newly
            # found lost, one after another, are no sign that the sender is slow
            self.unanswered[row] += 1
        self.last_nack[row] = now

    def arrived(
        self, row: int, local: np.ndarray, classes: np.ndarray, rtx: np.ndarray | None, now: float
    ) -> None:
        """Packets `local` of sender row `row` were stored, in `classes`;
        `rtx`: which were retransmissions (None: none). What they say of the
        packets before them (`PacketStream`). Lost retransmissions are told
        only of packets known to be required (the sender's DONE is in)."""
        resent = ~self.droppable[row] if self.manifest[row] else self._unknown
        late = self.streams[row].arrived(local, classes, rtx, now, resent, self.droppable[row])
        note_late(self.clocks.get(self.senders[row]), late, self.timing)

    def _reorder(self, row: int) -> float:
        """How long after a packet of sender row `row` is found lost it is asked for."""
        return reorder_wait(self.clocks.get(self.senders[row]), self.timing)

    def set_bounds(self, bounds: np.ndarray, now: float) -> None:
        """Per packet, the lowest class a sender gives it unless droppable (the
        priority policy's, `PriorityPolicy.lowest`): told with this node's own
        contribution, for every sender's stream."""
        for stream in self.streams:
            stream.set_bound(bounds, now)

    def manifest_in(self, row: int, now: float) -> None:
        """Sender row `row`'s DONE is whole: it left behind the sender's required
        packets (`dlcp.daemon.outbox` holds it until they have), so those still
        missing are lost."""
        self.streams[row].found(~self.received[row] & ~self.droppable[row], now)

    def repeat_after(self, row: int) -> float:
        """How long after its last NACK sender row `row` is asked again."""
        clock = self.clocks.get(self.senders[row])
        return repeat_wait(clock, self.timing, self.unanswered[row])

    def _manifest_due(self, row: int) -> float:
        """When sender row `row`, whose DONE has not come, is asked for it.

        Its packets came but no DONE: the DONE leaves right behind them, so
        both copies were lost (a burst) once the shard has been quiet for the
        time this sender takes to answer a NACK (`done_wait`), a few
        round-trips, not a grace. Nothing from it yet, or a sender never
        timed: it may not have started (a late rank), so a grace after the
        round began and after the last arrival.

        Sooner where every packet it lacks was asked for (found lost) and not
        resent within its answer time: asked without the DONE, a sender leaves
        out its droppable packets, so the DONE is what is missing, and it may
        be held up in its switch queue, the class of the sender's last
        packets, behind other hosts' packets of higher classes."""
        wait = done_wait(self.clocks.get(self.senders[row]), self.timing)
        due = max(self.created, self.last_arrival) + self.timing.grace
        if wait < self.timing.grace and self.received[row].any():
            due = self.last_arrival + wait
        stream = self.streams[row]
        if stream.any_asked and self.received[row].any() and not self._row_complete(row):
            missing = ~self.received[row]
            if stream.asks[missing].all():
                due = min(due, float(stream.asked[missing].max()) + self.repeat_after(row))
        return due

    def awaits_answer(self) -> bool:
        """Whether a NACK of this shard waits for its sender's answer."""
        return any(s.waiting_since is not None for s in self.streams)

    def answered(self, sender: int, now: float) -> None:
        """A retransmission from `sender` came: its answer to the NACKs sent it
        (`PacketStream.answered`)."""
        row = self._row.get(sender)
        if row is None:
            return
        self.streams[row].answered(self.clocks.get(sender), now)
        self.unanswered[row] = 0

    def _to_reach_bound(self, row: int, missing_lanes: int, total: int, bound: float) -> np.ndarray:
        allowed = int(bound * total)
        need = missing_lanes - allowed
        gone = np.flatnonzero(~self.received[row])
        take = np.searchsorted(np.cumsum(self.counts[gone]), need) + 1
        return gone[:take]

    def next_timer(self) -> float | None:
        """When `poll` next has something to do (never a time it would idle at)."""
        t = _Tick()
        t.arm(self.created + self.timing.timeout)
        if self.done_at is not None:
            t.arm(self.done_at + self.timing.linger)
            return t.at
        # Called after every drain: a row is looked at only where its answer
        # may arm a time (its manifest in and some packet missing), and the
        # whole shard only where that row lacks just droppable packets. Most
        # calls of a round find no manifest in yet but the node's own.
        short: bool | None = None  # whether only the bound is unmet
        quiet = self.last_arrival + self.timing.nack_delay
        for row in range(len(self.senders)):
            stream = self.streams[row]
            found = stream.next_due(self._reorder(row))
            if found is not None:
                t.arm(found)
            wait = self.repeat_after(row)
            if self.manifest[row]:
                if self._row_complete(row):
                    continue
                required = self._required_missing(row)
                if required.any():
                    t.arm(max(stream.first_repeat(required, wait), quiet))
                    continue
                if short is None:
                    short = bool(self.manifest.all()) and not self._required_missing().any()
                if short:
                    t.arm(max(self.last_nack[row] + wait, quiet))
            else:
                t.arm(max(self.last_nack[row] + wait, self._manifest_due(row)))
        return t.at

    def _row_complete(self, row: int) -> bool:
        """Whether sender row `row` holds every packet (kept once true)."""
        if row in self._complete_rows:
            return True
        if self.received[row].all():
            self._complete_rows.add(row)
            return True
        return False

    def timed_out(self, now: float) -> bool:
        return now >= self.created + self.timing.timeout
