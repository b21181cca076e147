"""Per-shard state machines of one all-reduce round (sans-IO).

`ShardAggregator` runs at a shard's owner: it sums the senders' lanes for the
shard and decides when the shard is complete under the loss bound.
`ResultCollector` (dlcp.core.collector) runs at every contributor: it gathers
the owners' result packets for the whole bucket. Both take `now` and return
what to send; the `Engine` wires them to packets. `ShardAggregator` keeps the
shard's arrival record (which packets came from whom, droppable, classes,
manifests) and composes two objects that own the rest: its `ShardClock`
(dlcp.core.shard_clock: NACK timing, completion, time-out) and its
`ShardAccumulator` (dlcp.core.accumulator: the senders' lanes and their
sum). The types they hand out are `dlcp.core.aggtypes`'s.

Completion rule (DESIGN.md "Priority, dropping, bounded loss"): a shard is
complete when every sender's non-droppable packets are in and at least
(1 - p) of all lanes are in, or when everything is in. A sender's DONE
manifest says which of its packets were droppable; before it arrives, a
missing packet of that sender is treated as required.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from dlcp.codecs import lanes as lane_ops
from dlcp.core.accumulator import ShardAccumulator
from dlcp.core.aggtypes import Nack, PartField, RunRejected, ShardResult
from dlcp.core.layout import Layout
from dlcp.core.runs import first_fresh, run_slots, taken
from dlcp.core.shard_clock import ShardClock
from dlcp.core.timing import NackClock, Timing
from dlcp.errors import LocalError, Reason, RemoteError
from dlcp.wire.batch import _bulk
from dlcp.wire.header import MAX_PRIORITY, Codec, Flags, narrow_top

__all__ = ["Nack", "RunRejected", "ShardAggregator", "ShardResult"]


_DROPPABLE = int(Flags.DROPPABLE)
_RETRANSMIT = int(Flags.RETRANSMIT)


class ShardAggregator:
    """Sums one shard of one round from every sender, within a loss bound."""

    def __init__(
        self,
        *,
        layout: Layout,
        shard: int,
        senders: Sequence[int],
        now: float,
        timing: Timing,
        clocks: Mapping[int, NackClock] | None = None,
    ) -> None:
        self.layout = layout
        self.shard = shard
        self.timing = timing
        self.senders = tuple(senders)
        self._row = {node: r for r, node in enumerate(self.senders)}
        pk = layout.shard_packets(shard)
        self.first_packet = pk.start
        self.n_packets = len(pk)
        self.offset, self.lanes = layout.shard_range(shard)
        self.counts = (
            layout.packet_counts()[pk.start : pk.stop] if self.n_packets else np.zeros(0, np.int64)
        )
        s = len(self.senders)
        self.received = np.zeros((s, self.n_packets), dtype=bool)
        self.droppable = np.zeros((s, self.n_packets), dtype=bool)
        # per packet, the highest priority (lowest class) and the layer it came
        # with from any sender: what its result packet is sent with
        self.classes = np.full(self.n_packets, MAX_PRIORITY, dtype=np.uint8)
        self.layers = np.zeros(self.n_packets, dtype=np.uint16)
        self.manifest = np.zeros(s, dtype=bool)
        # a manifest in parts (DONEs of large shards): per sender row, the
        # first packets of the parts seen, and the packets they cover
        self.manifest_parts: dict[int, set[int]] = {}
        self.manifest_covered = np.zeros(s, dtype=np.int64)
        self.weight = np.ones(s, dtype=np.int64)  # contributions summed in each sender's lanes
        self.block_max = np.zeros((s, self.n_packets), dtype=np.float32)
        self.bound = 1.0  # min over the senders' manifests
        self.scale: float | None = None
        self.result: ShardResult | None = None
        self.clock = ShardClock(
            shard=shard,
            senders=self.senders,
            rows=self._row,
            counts=self.counts,
            received=self.received,
            droppable=self.droppable,
            manifest=self.manifest,
            timing=timing,
            clocks={} if clocks is None else clocks,
            now=now,
        )
        self.acc = ShardAccumulator(
            shard=shard,
            codec=layout.codec,
            lanes=self.lanes,
            received=self.received,
            counts=self.counts,
        )
        self.duplicates = 0
        # the position, in the last run given (`on_data_many`, `on_data_run`),
        # of its last packet stored; -1: none was
        self.last_stored = -1
        self.n_received = 0
        self.n_manifests = 0
        self._need: int | None = None

    # -- inputs -----------------------------------------------------------
    def on_data(
        self,
        *,
        sender: int,
        offset: int,
        count: int,
        payload: memoryview | bytes,
        summed: bool,
        weight: int,
        droppable: bool,
        scale: float,
        block_max: float,
        now: float,
        priority: int = MAX_PRIORITY,
        layer: int | None = None,
        retransmit: bool = False,
    ) -> bool:
        """Store one data packet; False if it was a duplicate. Raises RemoteError.

        `priority` and `layer` (None: unknown) are the packet's class and layer,
        noted in `classes` and `layers`; `retransmit`: it was sent again in
        answer to a NACK (what it says of the packets before it differs)."""
        row, local = self._locate(sender, offset, count)
        self._adopt_scale(scale)
        if self.received[row, local]:
            self.duplicates += 1
            return False
        lanes = lane_ops.unpack(self.layout.codec, payload, count, summed)
        start = offset - self.offset
        acc = self.acc
        if acc.summing_row(row, summed):
            assert acc.out is not None and acc.summed_own is not None
            end = start + count
            own = acc.summed_own[start:end]
            np.add(own, lanes, out=acc.out[start:end], casting="unsafe")
        else:
            acc.slots[row, start : start + count] = lanes
        self.received[row, local] = True
        self.n_received += 1
        self.weight[row] = weight
        self.block_max[row, local] = block_max
        if droppable and not self.manifest[row]:
            self.droppable[row, local] = True
        if priority < self.classes[local]:
            self.classes[local] = priority
        if layer is not None:
            self.layers[local] = layer
        self.clock.last_arrival = now
        rtx = np.ones(1, dtype=bool) if retransmit else None
        self.clock.arrived(row, np.array([local]), np.array([priority]), rtx, now)
        return True

    def on_data_many(
        self,
        *,
        sender: int,
        offsets: np.ndarray,
        counts: np.ndarray,
        payloads: Sequence[memoryview | bytes],
        summed: bool,
        weight: int,
        droppable: np.ndarray,
        scale: float,
        block_max: np.ndarray,
        now: float,
        priority: np.ndarray | None = None,
        layer: np.ndarray | None = None,
        retransmit: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Store a run of one sender's data packets, in order; the batch form of
        `on_data`, with the same outcome as calling it per packet (`priority`
        None: classes unknown; `retransmit` None: no retransmissions).

        Returns (fresh, bad) masks: stored, and rejected as not a packet of this
        shard (BAD_RANGE); the rest were duplicates. Raises RemoteError for what
        rejects the whole run (unknown sender), or RunRejected for a scale
        differing from the shard's (MISMATCH for the packets of the shard; its
        `bad` mask names those that are BAD_RANGE, as `on_data` would say).
        """
        self.last_stored = -1
        row = self._sender_row(sender)
        n = len(payloads)
        offsets = np.asarray(offsets, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        lay = self.layout
        per = lay.per_packet
        i = offsets // per
        local = i - self.first_packet
        bad = (
            (local < 0)
            | (local >= self.n_packets)
            | (offsets != i * per)
            | (offsets >= lay.total)
            | (counts != np.minimum(per, lay.total - offsets))
        )
        if bad.all():
            return np.zeros(n, dtype=bool), bad
        try:
            self._adopt_scale(scale)
        except RemoteError as exc:
            raise RunRejected(exc.reason, exc.detail, bad) from None
        take, n_good = first_fresh(local, bad, self.received[row])
        fresh = np.zeros(n, dtype=bool)
        fresh[take] = True
        if take.size:
            self.last_stored = int(take[-1])
        self.duplicates += n_good - take.size
        if take.size == 0:
            return fresh, bad
        self.acc.store(
            row, summed, offsets[take] - self.offset, counts[take], taken(payloads, take)
        )
        lt = local[take]
        self.received[row, lt] = True
        self.n_received += take.size
        self.weight[row] = weight
        self.block_max[row, lt] = block_max[take]
        if not self.manifest[row]:
            self.droppable[row, lt] |= droppable[take]
        if priority is not None:
            self.classes[lt] = np.minimum(self.classes[lt], priority[take])
        if layer is not None:
            self.layers[lt] = layer[take]
        self.clock.last_arrival = now
        classes = np.zeros(lt.size, np.uint8) if priority is None else priority[take]
        rtx = None if retransmit is None else retransmit[take]
        self.clock.arrived(row, lt, classes, rtx, now)
        return fresh, bad

    def on_data_run(
        self,
        *,
        sender: int,
        heads: np.ndarray,
        payloads: Sequence[memoryview | bytes],
        summed: bool,
        weight: int,
        scale: float,
        now: float,
    ) -> tuple[int, np.ndarray | None]:
        """`on_data_many` for a run given as its header records (HEADER_DTYPE:
        offset, count, flags, aux (the block max's float32 bits), priority and
        layer each packet's own; the rest the run's, given here). In C where
        `_bulk` is built: one pass that finds the packets to store, the lane
        sums, one pass that notes them; the outcome is `on_data_many`'s.

        Returns how many were stored and which were BAD_RANGE (None: none);
        raises as `on_data_many` does.
        """
        if _bulk is None:
            fresh, rejected = self.on_data_many(
                sender=sender,
                offsets=heads["offset"].astype(np.int64),
                counts=heads["count"].astype(np.int64),
                payloads=payloads,
                summed=summed,
                weight=weight,
                droppable=(heads["flags"] & _DROPPABLE) != 0,
                scale=scale,
                block_max=heads["aux"].astype("<u4").view(np.float32),
                now=now,
                priority=heads["priority"],
                layer=heads["layer"],
                retransmit=(heads["flags"] & _RETRANSMIT) != 0,
            )
            return int(fresh.sum()), (rejected if rejected.any() else None)
        self.last_stored = -1
        row = self._sender_row(sender)
        lay = self.layout
        n = len(heads)
        (take, local, starts, counts), n_bad, bad = run_slots(
            heads,
            lay.per_packet,
            1,
            lay.total,
            self.first_packet,
            self.n_packets,
            self.offset,
            self.received[row],
        )
        if n_bad == n:
            return 0, bad
        try:
            self._adopt_scale(scale)
        except RemoteError as exc:
            raise RunRejected(
                exc.reason, exc.detail, np.zeros(n, dtype=bool) if bad is None else bad
            ) from None
        self.duplicates += n - n_bad - take.size
        if take.size == 0:
            return 0, bad
        self.last_stored = int(take[-1])
        self.acc.store(row, summed, starts, counts, taken(payloads, take))
        _bulk.mark_data(
            heads,
            take,
            local,
            self.received[row],
            self.block_max[row],
            None if self.manifest[row] else self.droppable[row],
            self.classes,
            self.layers,
            _DROPPABLE,
        )
        self.n_received += take.size
        self.weight[row] = weight
        self.clock.last_arrival = now
        rtx = (heads["flags"][take] & _RETRANSMIT) != 0
        self.clock.arrived(row, local, heads["priority"][take], rtx if rtx.any() else None, now)
        return take.size, bad

    def note_meta(self, classes: np.ndarray, layers: np.ndarray) -> None:
        """Every packet's class and layer as this node's own contribution has
        them (`on_local`)."""
        np.minimum(self.classes, classes, out=self.classes)
        self.layers[:] = layers

    def on_local(
        self,
        *,
        sender: int,
        lanes: memoryview | bytes,
        summed: bool,
        weight: int,
        droppable: np.ndarray,
        scale: float,
        block_max: np.ndarray,
        now: float,
    ) -> None:
        """This node's own contribution: every packet of the shard at once.

        Lanes already in the accumulator dtype (fp32, summed THC) are kept by
        reference, not copied; the caller must not change them until the shard
        completes. Same outcome as `on_data` for each of the shard's packets.
        """
        row = self._sender_row(sender)
        self._adopt_scale(scale)
        if self.received[row].any():
            raise RemoteError(Reason.BAD_RANGE, f"node {sender} already sent to this shard")
        self.acc.hold(row, summed, lanes)
        self.received[row] = True
        self.n_received += self.n_packets
        self.weight[row] = weight
        self.block_max[row] = block_max
        if not self.manifest[row]:
            self.droppable[row] |= droppable
        self.clock.last_arrival = now

    def on_manifest(
        self, *, sender: int, droppable: np.ndarray, bound: float, now: float, first: int = 0
    ) -> None:
        """A sender's DONE, or a part of it: which of its packets `first`,
        `first + 1`, ... were droppable, and its bound. The sender's manifest
        is whole once its parts cover the shard's packets; a part seen before
        (the same `first`) changes nothing. The parts must not overlap (the
        engine checks them against the partition the senders use)."""
        row = self._sender_row(sender)
        n = droppable.size
        if droppable.ndim != 1 or first < 0 or first + n > self.n_packets:
            raise RemoteError(
                Reason.BAD_RANGE, f"manifest of packets {first}+{n} of {self.n_packets}"
            )
        if not 0.0 <= bound <= 1.0:
            raise RemoteError(Reason.BAD_RANGE, f"loss bound {bound}")
        if self.layout.codec == Codec.UNION and (bound > 0 or droppable.any()):
            # a lost bit of the union loses that index for every worker
            raise RemoteError(Reason.BAD_FLAGS, "the sketch's index union is never droppable")
        if self.manifest[row]:
            return
        parts = self.manifest_parts.setdefault(row, set())
        if first in parts:
            return
        parts.add(first)
        self.clock.unanswered[row] = 0  # the DONE a NACK may have asked for (no sample)
        self.droppable[row, first : first + n] = droppable
        self.manifest_covered[row] += n
        self.bound = min(self.bound, bound)
        self.clock.last_arrival = now
        if self.manifest_covered[row] >= self.n_packets:
            self.manifest[row] = True
            self.n_manifests += 1
            del self.manifest_parts[row]
            self.clock.manifest_in(row, now)

    def _locate(self, sender: int, offset: int, count: int) -> tuple[int, int]:
        row = self._sender_row(sender)
        i = self.layout.packet_of(offset)
        local = i - self.first_packet
        if not 0 <= local < self.n_packets or self.layout.packet_range(i) != (offset, count):
            raise RemoteError(
                Reason.BAD_RANGE, f"lanes {offset}+{count} are not a packet of shard {self.shard}"
            )
        return row, local

    def _sender_row(self, sender: int) -> int:
        row = self._row.get(sender)
        if row is None:
            raise RemoteError(Reason.BAD_SENDER, f"node {sender} does not contribute")
        return row

    def _adopt_scale(self, scale: float) -> None:
        """The shard's scale is its first packet's; every later one must match."""
        if self.scale is None:
            self.scale = scale
        elif scale != self.scale:
            raise RemoteError(Reason.MISMATCH, f"scale {scale} != {self.scale}")

    # -- the clock and the sums ---------------------------------------------
    def may_complete(self) -> bool:
        """Cheap check: could `poll` complete the shard now? (else leave it to timers)

        Completion needs every manifest and every non-droppable packet, so at
        least `received.size - droppable` packets; poll does the exact test.
        """
        if self.n_received == self.received.size:
            return True
        if self.n_manifests < len(self.senders):
            return False
        if self._need is None:
            self._need = self.received.size - int(self.droppable.sum())
        return self.n_received >= self._need

    @property
    def complete(self) -> bool:
        return self.result is not None

    def poll(self, now: float) -> tuple[list[Nack], bool]:
        """Advance timers: NACKs to send, and whether the shard just completed."""
        if self.result is not None:
            return [], False
        nacks, done = self.clock.poll(now, self.bound)
        if done:
            self._finish()
        return nacks, done

    def next_timer(self) -> float | None:
        """When `poll` next has something to do (never a time it would idle at)."""
        return None if self.result is not None else self.clock.next_timer()

    def timed_out(self, now: float) -> bool:
        return self.result is None and self.clock.timed_out(now)

    def answered(self, sender: int, now: float) -> None:
        """A retransmission from `sender` was stored: its answer to the NACKs
        sent it (`ShardClock.answered`)."""
        self.clock.answered(sender, now)

    def missing_senders(self) -> list[int]:
        return [n for r, n in enumerate(self.senders) if not self.received[r].any()]

    # the parts' fields, read by the engine and tests
    unanswered: PartField[list[int]] = PartField("clock")
    created: PartField[float] = PartField("clock")
    done_at: PartField[float | None] = PartField("clock")
    last_nack: PartField[np.ndarray] = PartField("clock")
    last_arrival: PartField[float] = PartField("clock")
    clocks: PartField[Mapping[int, NackClock]] = PartField("clock")
    slots: PartField[np.ndarray] = PartField("acc")  # per sender row, its lanes
    out: PartField[np.ndarray | None] = PartField("acc")  # where the sums go, if set (`sum_into`)

    def sum_into(self, out: np.ndarray) -> None:
        """Put the sums, when the shard completes, in `out` (this shard's lanes in
        the accumulator dtype, e.g. the result collector's range of the shard)
        instead of a new array; `result.sums` is then `out`."""
        if self.result is not None:
            raise LocalError(f"shard {self.shard} has completed already")
        self.acc.sum_into(out)

    def _finish(self) -> None:
        sums = self.acc.finish()
        if self.layout.narrow:  # only narrow sums go: cut, here too, what a sender's weight
            np.minimum(sums, narrow_top(self.layout.codec), out=sums)  # put past them
        contributors = (self.received * self.weight[:, None]).sum(axis=0)
        self.result = ShardResult(
            shard=self.shard,
            sums=sums,
            contributors=contributors.astype(np.int64),
            block_max=self.block_max.max(axis=0) if len(self.senders) else self.block_max[0],
            lost_lanes=int(((~self.received) * self.counts).sum()),
            total_lanes=int(self.counts.sum()) * len(self.senders),
        )
