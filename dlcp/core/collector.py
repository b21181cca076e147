"""Result collection at a contributor: `ResultCollector` gathers a round's
result packets from every shard's owner into the bucket's sums, tallies what
each owner's result DONE says was sent, and keeps the clock of result NACKs
(when to ask an owner again, when to give up on one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dlcp.codecs import lanes as lane_ops
from dlcp.core import accumulator
from dlcp.core.aggtypes import Nack, ShardResult, _Tick
from dlcp.core.awaited import Awaited
from dlcp.core.layout import Layout
from dlcp.core.runs import first_fresh, run_slots, taken
from dlcp.core.stream import LOWEST_REQUIRED_CLASS
from dlcp.core.timing import NackClock, Timing, done_wait, note_late, reorder_wait, repeat_wait
from dlcp.errors import LocalError, Reason, RemoteError
from dlcp.wire.batch import _bulk
from dlcp.wire.header import Flags

__all__ = ["ResultCollector"]

_RETRANSMIT = int(Flags.RETRANSMIT)
_EARLY = int(Flags.EARLY)


@dataclass
class ResultCollector:
    """Gathers a round's result packets for the whole bucket at one contributor."""

    layout: Layout
    owners: Sequence[int]
    me: int
    senders: int  # contributing nodes (for the lost-lane share)
    now: float
    timing: Timing
    # Where the sums go: the round's caller may give the bucket's lanes (`total`
    # of the codec's sum dtype), e.g. a view of the rank's mapped output, so that
    # result packets land where the rank reads them; else a private buffer.
    out: np.ndarray | None = None
    sums: np.ndarray = field(init=False)
    contributors: np.ndarray = field(init=False)
    block_max: np.ndarray = field(init=False)
    waiting: dict[int, Awaited] = field(init=False)
    lost_lanes: int = 0  # set when the round completes (`tally`)
    total_lanes: int = 0
    duplicates: int = 0
    # the position, in the last run given (`on_results_many`, `on_result_run`),
    # of its last packet stored; -1: none was
    last_stored: int = -1
    # per node, when its last data-leg packet of this round came (`heard_from`)
    heard: dict[int, float] = field(init=False)
    # per owner node, how soon it answers NACKs (the engine's, shared by the
    # job's rounds); an owner without one: `nack_interval`
    clocks: Mapping[int, NackClock] = field(default_factory=dict)
    # the shards whose owners were sent an ACK (each as it became whole here)
    acked: set[int] = field(default_factory=set)
    # the shards whose result packets come here (None: all); of the others
    # only the owner's DONE comes (a reduce-scatter's: "summed, yours is in")
    expect: frozenset[int] | None = None
    # this node's own class of each data packet of the bucket, where the owners'
    # sums include its packets (an all-reduce): a result travels in the highest
    # class any contributor gave its packet (at most LOWEST_REQUIRED_CLASS), so
    # in this one's or a higher one (None: not known)
    classes: np.ndarray | None = None

    def __post_init__(self) -> None:
        lay = self.layout
        # Not zeroed: a round completes only with every result packet stored
        # (the result leg is reliable) and the local shard, which tile the bucket.
        dtype = lane_ops.sum_dtype(lay.codec)
        if self.out is None:
            self.sums = accumulator._uninitialised(
                (lay.total,), dtype
            )  # the module's: tests poison it
        elif self.out.shape != (lay.total,) or self.out.dtype != dtype:
            raise LocalError(
                f"results of {lay.total} {lay.codec.name} lanes need {lay.total} lanes of "
                f"{dtype}, not {self.out.shape} of {self.out.dtype}"
            )
        else:
            self.sums = self.out
        self.contributors = np.zeros(lay.packets, dtype=np.int64)
        self.block_max = np.zeros(lay.packets, dtype=np.float32)
        self.waiting = {}
        for shard, owner in enumerate(self.owners):
            pk = lay.shard_packets(shard)
            if not pk:
                continue
            first = lay.result_index(lay.packet_range(pk.start)[0])
            n = lay.shard_result_count(shard)
            if self.expect is not None and shard not in self.expect:
                n = 0
            bound: np.ndarray | int = LOWEST_REQUIRED_CLASS
            if self.classes is not None and n:
                packets = lay.shard_result_arrays(shard)[0] // lay.per_packet
                bound = np.minimum(self.classes[packets], LOWEST_REQUIRED_CLASS)
            self.waiting[shard] = Awaited(
                owner=owner,
                indices=np.arange(first, first + n),
                received=np.zeros(n, dtype=bool),
                bound=bound,
            )
        self.heard = {}
        self.created = self.now

    @property
    def complete(self) -> bool:
        return not self.waiting

    def shard_sums(self, shard: int) -> np.ndarray:
        """This shard's lanes of `sums` (a view): where its aggregator may put
        the sums (`ShardAggregator.sum_into`) before `on_local`. Where `sums` is
        the caller's `out`, the caller may reuse it once the round completes
        here: the owner answers later result NACKs from the datagrams it sent
        (`engine._Finished.datagrams`), not from these lanes."""
        off, count = self.layout.shard_range(shard)
        return self.sums[off : off + count]

    def on_local(self, result: ShardResult) -> None:
        """The shard this node owns, straight from its aggregator."""
        off, count = self.layout.shard_range(result.shard)
        if not np.may_share_memory(result.sums, self.sums):  # else summed in place already
            self.sums[off : off + count] = result.sums
        pk = self.layout.shard_packets(result.shard)
        self.contributors[pk.start : pk.stop] = result.contributors
        self.block_max[pk.start : pk.stop] = result.block_max
        self.waiting.pop(result.shard, None)

    def on_result(
        self,
        *,
        shard: int,
        sender: int,
        offset: int,
        count: int,
        payload: memoryview | bytes,
        contributors: int,
        block_max: float,
        now: float,
        codec: int | None = None,
        priority: int = 0,
        retransmit: bool = False,
        early: bool = False,
        aux: int = 0,
    ) -> bool:
        """Store one result packet (its lanes of `codec`: the layout's, or its
        narrow sums, `lanes.NARROW`; sent in class `priority`, again in answer
        to a NACK if `retransmit`, before its shard completed if `early`,
        with `aux` its pointers then, `dlcp.core.early`); False if it was a
        duplicate or late."""
        w = self.waiting.get(shard)
        if w is None:
            self.duplicates += 1
            return False
        if sender != w.owner:
            raise RemoteError(Reason.BAD_SENDER, f"node {sender} does not own shard {shard}")
        lay = self.layout
        g = lay.result_index(offset)
        local = g - int(w.indices[0]) if w.indices.size else -1
        i = lay.packet_of(offset)
        if not 0 <= local < w.indices.size or (offset, count) not in lay.result_ranges(i):
            raise RemoteError(Reason.BAD_RANGE, f"lanes {offset}+{count} not a result of {shard}")
        if w.received[local]:
            self.duplicates += 1
            return False
        wire = lay.codec if codec is None else codec
        self.sums[offset : offset + count] = lane_ops.unpack(wire, payload, count, True)
        self.contributors[i] = contributors
        self.block_max[i] = block_max
        w.received[local] = True
        w.last_arrival = now
        if w.received.all():
            del self.waiting[shard]
        else:
            late = w.stream.arrived(
                np.array([local]),
                np.array([priority]),
                np.array([retransmit]),
                now,
                silent=np.array([early]),
                aux=np.array([aux]),
            )
            note_late(self.clocks.get(w.owner), late, self.timing)
        return True

    def on_results_many(
        self,
        *,
        shard: int,
        sender: int,
        offsets: np.ndarray,
        counts: np.ndarray,
        payloads: Sequence[memoryview | bytes],
        contributors: np.ndarray,
        block_max: np.ndarray,
        now: float,
        codec: int | None = None,
        priority: np.ndarray | None = None,
        retransmit: np.ndarray | None = None,
        early: np.ndarray | None = None,
        aux: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Store a run of one owner's result packets of one shard, in order; the
        batch form of `on_result` (`priority` None: classes unknown;
        `retransmit` None: no retransmissions). Returns (fresh, bad) masks as
        `ShardAggregator.on_data_many` does; the rest were duplicates or late."""
        self.last_stored = -1
        n = len(payloads)
        fresh = np.zeros(n, dtype=bool)
        w = self.waiting.get(shard)
        if w is None:
            self.duplicates += n
            return fresh, np.zeros(n, dtype=bool)
        if sender != w.owner:
            raise RemoteError(Reason.BAD_SENDER, f"node {sender} does not own shard {shard}")
        lay = self.layout
        per = lay.per_packet
        step = -(-per // lay.result_split)
        offsets = np.asarray(offsets, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        i = offsets // per
        within = offsets - i * per
        g = i * lay.result_split + within // step
        local = g - (int(w.indices[0]) if w.indices.size else 0)
        packet_end = np.minimum((i + 1) * per, lay.total)
        bad = (
            (w.indices.size == 0)
            | (local < 0)
            | (local >= w.indices.size)
            | (within % step != 0)
            | (offsets >= packet_end)
            | (counts != np.minimum(step, packet_end - offsets))
        )
        take, n_good = first_fresh(local, bad, w.received)
        fresh[take] = True
        if take.size:
            self.last_stored = int(take[-1])
        self.duplicates += n_good - take.size
        if take.size == 0:
            return fresh, bad
        wire = lay.codec if codec is None else codec
        lane_ops.store_runs(
            self.sums, wire, True, offsets[take], counts[take], taken(payloads, take)
        )
        it = i[take]
        self.contributors[it] = contributors[take]
        self.block_max[it] = block_max[take]
        w.received[local[take]] = True
        w.last_arrival = now
        if w.received.all():
            del self.waiting[shard]
        else:
            classes = np.zeros(take.size, np.uint8) if priority is None else priority[take]
            rtx = None if retransmit is None else retransmit[take]
            silent = None if early is None else early[take]
            late = w.stream.arrived(
                local[take],
                classes,
                rtx,
                now,
                silent=silent,
                aux=None if aux is None else aux[take],
            )
            note_late(self.clocks.get(w.owner), late, self.timing)
        return fresh, bad

    def on_result_run(
        self,
        *,
        shard: int,
        sender: int,
        heads: np.ndarray,
        payloads: Sequence[memoryview | bytes],
        now: float,
        codec: int | None = None,
    ) -> tuple[int, np.ndarray | None]:
        """`on_results_many` for a run given as its header records (HEADER_DTYPE:
        offset, count, contributors and param (the block max) each packet's
        own). In C where `_bulk` is built, as `ShardAggregator.on_data_run`.
        Returns how many were stored and which were BAD_RANGE (None: none)."""
        if _bulk is None:
            fresh, rejected = self.on_results_many(
                shard=shard,
                sender=sender,
                offsets=heads["offset"].astype(np.int64),
                counts=heads["count"].astype(np.int64),
                payloads=payloads,
                contributors=heads["contributors"].astype(np.int64),
                block_max=heads["param"].astype(np.float32),
                now=now,
                codec=codec,
                priority=heads["priority"],
                retransmit=(heads["flags"] & _RETRANSMIT) != 0,
                early=(heads["flags"] & _EARLY) != 0,
                aux=heads["aux"],
            )
            return int(fresh.sum()), (rejected if rejected.any() else None)
        self.last_stored = -1
        n = len(heads)
        w = self.waiting.get(shard)
        if w is None:
            self.duplicates += n
            return 0, None
        if sender != w.owner:
            raise RemoteError(Reason.BAD_SENDER, f"node {sender} does not own shard {shard}")
        lay = self.layout
        (take, local, starts, counts), n_bad, bad = run_slots(
            heads,
            lay.per_packet,
            lay.result_split,
            lay.total,
            int(w.indices[0]) if w.indices.size else 0,
            w.indices.size,
            0,
            w.received,
        )
        self.duplicates += n - n_bad - take.size
        if take.size == 0:
            return 0, bad
        self.last_stored = int(take[-1])
        wire = lay.codec if codec is None else codec
        lane_ops.store_runs(self.sums, wire, True, starts, counts, taken(payloads, take))
        _bulk.mark_results(
            heads, take, local, w.received, self.contributors, self.block_max, lay.per_packet
        )
        w.last_arrival = now
        if w.received.all():
            del self.waiting[shard]
        else:
            flags = heads["flags"][take]
            rtx = (flags & _RETRANSMIT) != 0
            early = (flags & _EARLY) != 0
            late = w.stream.arrived(
                local,
                heads["priority"][take],
                rtx if rtx.any() else None,
                now,
                silent=early if early.any() else None,
                aux=heads["aux"][take],
            )
            note_late(self.clocks.get(w.owner), late, self.timing)
        return take.size, bad

    def on_done(self, *, shard: int, sender: int, now: float) -> None:
        """The owner's DONE for a shard: it has sent every result packet."""
        w = self.waiting.get(shard)
        if w is None or sender != w.owner or w.done:
            return
        w.done = True
        w.last_arrival = now
        w.unanswered = 0  # the DONE a NACK may have asked for (no sample)
        # it left behind the owner's results (`dlcp.daemon.outbox` holds it until
        # they have): those still missing are lost
        w.stream.found(~w.received, now)
        if not w.indices.size:  # a shard whose DONE is all that comes
            del self.waiting[shard]

    def tally(self) -> None:
        """`lost_lanes` and `total_lanes` from the bucket's result counts, once
        every shard is in: a packet holding c of the round's W contributions
        (the most any packet holds) lacks (W - c) / W of its lanes from each of
        the `senders`. Not from the owners' DONEs: they come after the results,
        usually after the round completed (the losses went uncounted). With
        `expect`, the packets of those shards only (no sums came of the rest)."""
        counts = self.layout.packet_counts()
        contributors = self.contributors
        if self.expect is not None:
            lay = self.layout
            mine = np.zeros(lay.packets, dtype=bool)
            for shard in self.expect:
                pk = lay.shard_packets(shard)
                mine[pk.start : pk.stop] = True
            counts, contributors = counts[mine], contributors[mine]
        self.total_lanes = int(counts.sum()) * self.senders
        full = int(contributors.max(initial=0))
        if full <= 0:
            self.lost_lanes = 0
            return
        short = ((full - contributors) * counts).sum()
        self.lost_lanes = round(float(short) * self.senders / full)

    def heard_from(self, node: int, now: float) -> None:
        """A data-leg packet of this round came from `node` (data or a manifest
        for a shard this node owns): it is still busy with the round, so the
        results of its own shards may still be in the making. Asking it for
        them while nothing has come (`poll`) waits a grace after its last."""
        self.heard[node] = now

    def _quiet_since(self, w: Awaited) -> float:
        """Since when a shard's owner, from which no result has come, has been
        neither asked nor heard from in this round."""
        return max(self.created, w.last_nack, self.heard.get(w.owner, -math.inf))

    def poll(self, now: float) -> list[Nack]:
        """NACKs for result packets that are overdue (result leg is reliable):
        those known lost by what came after them (`PacketStream`) at once."""
        nacks: list[Nack] = []
        t = self.timing
        for shard, w in self.waiting.items():
            ask = w.stream.due(now, self._reorder(w))
            wait = self._repeat_after(w)
            again = now >= w.last_nack + wait
            need_manifest = counted = False
            if w.done:
                last = w.last_arrival if w.last_arrival is not None else self.created
                if now >= last + t.nack_delay:
                    ask = np.union1d(ask, w.stream.repeat_due(~w.received, now, wait))
            elif (
                again and w.last_arrival is not None and now >= w.last_arrival + self._done_wait(w)
            ):
                # Results stopped without their DONE: ask for the DONE. It
                # trails the owner's queued results, so the precise NACK for what
                # is really missing follows once it arrives.
                need_manifest = counted = True
            elif again and w.last_arrival is None and now >= self._quiet_since(w) + t.grace:
                # No result from this owner yet, and it has been quiet for a
                # grace: either it is still aggregating (it ignores the
                # question) or every result packet and both DONE copies were
                # lost (a receive buffer overflowed while this host was busy).
                # Ask for the DONE, once per grace. While its data for this
                # node's shards still comes, it is busy with the round: the
                # question would only be ignored.
                need_manifest = True
            if ask.size and need_manifest:  # the DONE alone (`Dispatcher._on_nack`)
                nacks.append(Nack(w.owner, shard, tuple(ask.tolist())))
                w.asked(ask, False, now)
                ask = ask[:0]
            if ask.size or need_manifest:
                nacks.append(Nack(w.owner, shard, tuple(ask.tolist()), need_manifest=need_manifest))
                w.asked(ask, counted, now)
        return nacks

    def _reorder(self, w: Awaited) -> float:
        """How long after a result packet of `w` is found lost it is asked for."""
        return reorder_wait(self.clocks.get(w.owner), self.timing)

    def _repeat_after(self, w: Awaited) -> float:
        """How long after its last NACK for `w` the owner is asked again."""
        return repeat_wait(self.clocks.get(w.owner), self.timing, w.unanswered)

    def _done_wait(self, w: Awaited) -> float:
        """How long `w`'s results may pause before its owner is asked for the
        DONE that should have followed them (`done_wait`)."""
        return done_wait(self.clocks.get(w.owner), self.timing)

    def awaits_answer(self, shard: int) -> bool:
        """Whether a NACK for `shard` waits for its answer."""
        w = self.waiting.get(shard)
        return w is not None and w.stream.waiting_since is not None

    def answered(self, shard: int, now: float) -> None:
        """A retransmitted result packet of `shard` came: the owner's answer
        to the NACKs sent it, timed as `ShardClock.answered` times one."""
        w = self.waiting.get(shard)
        if w is None:
            return
        w.answered(self.clocks.get(w.owner), now)

    def next_timer(self) -> float | None:
        t = _Tick()
        for w in self.waiting.values():
            found = w.stream.next_due(self._reorder(w))
            if found is not None:
                t.arm(found)
            if w.last_arrival is None and not w.done:
                t.arm(self._quiet_since(w) + self.timing.grace)
                continue
            last = w.last_arrival if w.last_arrival is not None else self.created
            if w.done:
                repeat = w.stream.first_repeat(~w.received, self._repeat_after(w))
                t.arm(max(last + self.timing.nack_delay, repeat))
            else:
                t.arm(max(last + self._done_wait(w), w.last_nack + self._repeat_after(w)))
        if self.waiting:
            t.arm(self.created + self.timing.timeout)
        return t.at

    def timed_out(self, now: float) -> bool:
        return bool(self.waiting) and now >= self.created + self.timing.timeout

    def describe_waiting(self, now: float) -> str:
        """What is still missing, for the reason of a timed-out round."""

        def ago(t: float | None) -> str:
            return "never" if t is None or t == -math.inf else f"{now - t:.2f}s ago"

        return "; ".join(
            f"shard {shard} of node {w.owner}: {int(w.received.sum())}/{w.received.size} "
            f"results, {'DONE seen' if w.done else 'no DONE'}, last result {ago(w.last_arrival)}"
            f", last NACK {ago(w.last_nack)}"
            for shard, w in sorted(self.waiting.items())
        )
