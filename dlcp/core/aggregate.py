"""Per-shard state machines of one all-reduce round (sans-IO).

`ShardAggregator` runs at a shard's owner: it sums the senders' lanes for the
shard and decides when the shard is complete under the loss bound.
`ResultCollector` (dlcp.core.collector) runs at every contributor: it gathers
the owners' result packets for the whole bucket. Both take `now` and return
what to send; the `Engine` wires them to packets. This module sums; the
aggregator's clock (NACKs, completion) and its result are
`dlcp.core.shard_clock`'s, the types they hand out `dlcp.core.aggtypes`'s.

Completion rule (DESIGN.md "Priority, dropping, bounded loss"): a shard is
complete when every sender's non-droppable packets are in and at least
(1 - p) of all lanes are in, or when everything is in. A sender's DONE
manifest says which of its packets were droppable; before it arrives, a
missing packet of that sender is treated as required.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from dlcp.codecs import lanes as lane_ops
from dlcp.core.aggtypes import Nack, RunRejected, ShardResult
from dlcp.core.buffers import SpareBuffers
from dlcp.core.layout import Layout
from dlcp.core.runs import first_fresh, run_slots, taken
from dlcp.core.shard_clock import ShardClock
from dlcp.core.timing import NackClock, Timing
from dlcp.errors import LocalError, Reason, RemoteError
from dlcp.wire.batch import _bulk
from dlcp.wire.header import MAX_PRIORITY, Codec, Flags

__all__ = ["Nack", "RunRejected", "ShardAggregator", "ShardResult"]


_DROPPABLE = int(Flags.DROPPABLE)


def _uninitialised(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An array whose every element the caller writes before reading (tests
    poison it to check that they do); a large one is a reused buffer when one
    is free (`dlcp.core.buffers.SpareBuffers`)."""
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes < MIN_SPARE_BYTES:
        return np.empty(shape, dtype=dt)
    return _SPARE.take(nbytes).view(dt).reshape(shape)


_SPARE = SpareBuffers()
MIN_SPARE_BYTES = 1 << 20  # smaller arrays come from the allocator as they are


class ShardAggregator(ShardClock):
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
        # per sender node, how soon it answers NACKs (the engine's, shared by
        # every shard of the job); a sender without one: `nack_interval`
        self.clocks: Mapping[int, NackClock] = {} if clocks is None else clocks
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
        # Not zeroed: every packet stored overwrites its lanes, and `_finish`
        # zeroes the lanes of the packets that never came. Zeroing up front cost
        # a pass over every row, this node's own too (held by reference, never
        # written here): 4-7 % of the core's time for 100 MB fp32 rounds.
        self.slots = _uninitialised((s, self.lanes), lane_ops.sum_dtype(layout.codec))
        # rows held by reference instead of in `slots` (this node's own lanes)
        self._held: dict[int, np.ndarray] = {}
        self.received = np.zeros((s, self.n_packets), dtype=bool)
        # the rows found to hold every packet (`received` only ever gains them)
        self._complete_rows: set[int] = set()
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
        self.created = now
        self.done_at: float | None = None  # when every required packet and the bound were met
        self.last_nack = np.full(s, -math.inf)
        # per sender row, the NACKs sent to it since it last answered one
        self.unanswered = [0] * s
        self.last_arrival = now
        self.result: ShardResult | None = None
        # where `_finish` puts the sums, when set (`sum_into`): the collector's
        # range of this shard, so that the sums are not copied there again
        self.out: np.ndarray | None = None
        # the sender whose packets are summed with this node's held lanes into
        # `out` as they arrive (`_summing_row`); None: stored in `slots`
        self._summed_row: int | None = None
        self._summed_own: np.ndarray | None = None  # this node's held lanes they are added to
        self._sum_decided = False
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
    ) -> bool:
        """Store one data packet; False if it was a duplicate. Raises RemoteError.

        `priority` and `layer` (None: unknown) are the packet's class and layer,
        noted in `classes` and `layers`."""
        row, local = self._locate(sender, offset, count)
        self._adopt_scale(scale)
        if self.received[row, local]:
            self.duplicates += 1
            return False
        lanes = lane_ops.unpack(self.layout.codec, payload, count, summed)
        start = offset - self.offset
        if self._summing_row(row, summed):
            assert self.out is not None and self._summed_own is not None
            end = start + count
            own = self._summed_own[start:end]
            np.add(own, lanes, out=self.out[start:end], casting="unsafe")
        else:
            self.slots[row, start : start + count] = lanes
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
        self.last_arrival = now
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
    ) -> tuple[np.ndarray, np.ndarray]:
        """Store a run of one sender's data packets, in order; the batch form of
        `on_data`, with the same outcome as calling it per packet.

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
        self._store_lanes(
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
        self.last_arrival = now
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
        self._store_lanes(row, summed, starts, counts, taken(payloads, take))
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
        self.last_arrival = now
        return take.size, bad

    def _store_lanes(
        self,
        row: int,
        summed: bool,
        starts: np.ndarray,
        counts: np.ndarray,
        payloads: Sequence[memoryview | bytes],
    ) -> None:
        """Packets' lanes (`starts` relative to the shard) summed into `out` or
        stored in `row` of `slots` (`_summing_row`)."""
        lay = self.layout
        if self._summing_row(row, summed):
            assert self.out is not None and self._summed_own is not None
            lane_ops.add_runs(
                self.out, self._summed_own, lay.codec, summed, starts, counts, payloads
            )
        else:
            lane_ops.store_runs(self.slots[row], lay.codec, summed, starts, counts, payloads)

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
        values = lane_ops.unpack(self.layout.codec, lanes, self.lanes, summed)
        if values.dtype == self.slots.dtype:
            self._held[row] = values
        else:
            self.slots[row] = values
        self.received[row] = True
        self.n_received += self.n_packets
        self.weight[row] = weight
        self.block_max[row] = block_max
        if not self.manifest[row]:
            self.droppable[row] |= droppable
        self.last_arrival = now

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
        self.unanswered[row] = 0  # the DONE a NACK may have asked for (no sample)
        self.droppable[row, first : first + n] = droppable
        self.manifest_covered[row] += n
        self.bound = min(self.bound, bound)
        self.last_arrival = now
        if self.manifest_covered[row] >= self.n_packets:
            self.manifest[row] = True
            self.n_manifests += 1
            del self.manifest_parts[row]

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

    def _summing_row(self, row: int, summed: bool) -> bool:
        """Whether `row`'s packets are summed into `out` as they arrive.

        Decided once, at the first packet of another sender: yes when the shard
        has two senders, this node's lanes are held (`on_local`), the sums go to
        `out` (`sum_into`) and the wire lanes are float32 like the sums. Then
        `out` = own + packet is written per packet (one pass over the shard, no
        copy of the packet into `slots` and no second pass in `_finish`), and
        `_finish` only copies this node's lanes where packets never came. The
        sums are those `_finish` computes otherwise (a + b == b + a in IEEE
        arithmetic), except which NaN's payload a NaN sum carries.
        """
        if not self._sum_decided:
            if len(self.senders) == 2 and not self._held:
                return False  # this node's lanes are not in yet: decided when they are
            self._sum_decided = True
            if (
                len(self.senders) == 2
                and len(self._held) == 1
                and row not in self._held
                and self.out is not None
                and lane_ops.can_add_runs(self.out, self.layout.codec, summed)
            ):
                self._summed_row = row
                own = self._summed_own = next(iter(self._held.values()))
                # what came before this node's lanes, stored in `slots`: summed now
                for a, b in self._received_spans(row):
                    np.add(own[a:b], self.slots[row, a:b], out=self.out[a:b])
        if self._summed_row is None:
            return False
        if row != self._summed_row:  # cannot happen with two senders, one of them held
            raise LocalError(
                f"shard {self.shard}: packets of row {row} while summing row {self._summed_row}"
            )
        return True

    def _zero_missing(self) -> None:
        """Zero the lanes, in `slots`, of every packet a sender's row lacks."""
        for r in range(len(self.senders)):
            if r in self._held or r == self._summed_row:
                continue
            row = self.slots[r]
            for a, b in self._missing_spans(r):  # runs of missing packets: a slice each
                row[a:b] = 0

    def sum_into(self, out: np.ndarray) -> None:
        """Put the sums, when the shard completes, in `out` (this shard's lanes in
        the accumulator dtype, e.g. the result collector's range of the shard)
        instead of a new array; `result.sums` is then `out`."""
        if self.result is not None:
            raise LocalError(f"shard {self.shard} has completed already")
        if out.shape != (self.lanes,) or out.dtype != self.slots.dtype:
            raise LocalError(
                f"sums of shard {self.shard} need {self.lanes} lanes of {self.slots.dtype}, "
                f"not {out.shape} of {out.dtype}"
            )
        self.out = out

    def _sum_rows(self, out: np.ndarray | None, sdt: np.dtype) -> np.ndarray:
        """The senders' rows summed (missing packets as zeros), into `out` if set."""
        self._zero_missing()
        if self._held:  # row by row, in sender order: what np.add.reduce(axis=0) computes
            rows = [self._held.get(r, self.slots[r]) for r in range(len(self.senders))]
            if len(rows) == 1:
                sums = rows[0].astype(sdt, copy=True) if out is None else out
                if out is not None:
                    np.copyto(out, rows[0], casting="unsafe")
            else:  # the first two in one pass, then the others
                sums = np.add(rows[0], rows[1], out=out, dtype=sdt)
            for r in rows[2:]:
                np.add(sums, r, out=sums)
            self._held = {}
        elif not len(self.senders):
            sums = self.slots[0] if out is None else out
        else:
            sums = np.add.reduce(self.slots, axis=0, dtype=sdt, out=out)
        return sums
