"""Per-shard state machines of one all-reduce round (sans-IO).

`ShardAggregator` runs at a shard's owner: it sums the senders' lanes for the
shard and decides when the shard is complete under the loss bound.
`ResultCollector` runs at every contributor: it gathers the owners' result
packets for the whole bucket. Both take `now` and return what to send; the
`Engine` wires them to packets.

Completion rule (DESIGN.md "Priority, dropping, bounded loss"): a shard is
complete when every sender's non-droppable packets are in and at least
(1 - p) of all lanes are in, or when everything is in. A sender's DONE
manifest says which of its packets were droppable; before it arrives, a
missing packet of that sender is treated as required.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dlcp.codecs import lanes as lane_ops
from dlcp.core.buffers import SpareBuffers
from dlcp.core.layout import Layout
from dlcp.core.runs import first_fresh, run_slots, taken
from dlcp.core.timing import NackClock, Timing, done_wait, repeat_wait, time_answer
from dlcp.errors import LocalError, Reason, RemoteError
from dlcp.wire.batch import _bulk
from dlcp.wire.header import MAX_PRIORITY, Codec, Flags

__all__ = ["Nack", "ResultCollector", "RunRejected", "ShardAggregator", "ShardResult"]


@dataclass(frozen=True)
class Nack:
    """Ask `node` again for packets (local indices within the shard)."""

    node: int
    shard: int
    packets: tuple[int, ...]
    need_manifest: bool = False


@dataclass
class ShardResult:
    """The aggregated sums of one shard."""

    shard: int
    sums: np.ndarray  # summed lanes of the shard, lane_ops.sum_dtype(codec)
    contributors: np.ndarray  # per data packet of the shard: contributions summed
    block_max: np.ndarray  # per data packet: max of the contributors' block maxima
    lost_lanes: int  # droppable lanes left out of the sum
    total_lanes: int  # lanes all senders together should have sent


@dataclass
class _Tick:
    """Earliest time something is due; None when nothing is."""

    at: float | None = None

    def arm(self, t: float) -> None:
        if self.at is None or t < self.at:
            self.at = t


class RunRejected(RemoteError):
    """A run of packets rejected for `reason`, except those of `bad`, which
    are BAD_RANGE (not packets of the shard)."""

    def __init__(self, reason: Reason, detail: str, bad: np.ndarray) -> None:
        super().__init__(reason, detail)
        self.bad = bad


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


_DROPPABLE = int(Flags.DROPPABLE)


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

    # -- decisions --------------------------------------------------------
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

    def _required_missing(self, row: int | None = None) -> np.ndarray:
        """Per sender and packet (of sender row `row` only, if given): missing
        and not known to be droppable."""
        if row is not None:
            return ~self.received[row] & ~self.droppable[row]
        return ~self.received & ~self.droppable

    def poll(self, now: float) -> tuple[list[Nack], bool]:
        """Advance timers: NACKs to send, and whether the shard just completed."""
        if self.result is not None:
            return [], False
        if self.received.all():
            self._finish()
            return [], True
        nacks: list[Nack] = []
        required = self._required_missing()
        total = int(self.counts.sum()) * len(self.senders)
        have = int((self.received * self.counts).sum())
        within = have >= (1.0 - self.bound) * total
        if self.manifest.all() and not required.any() and within:
            if self.done_at is None:
                self.done_at = now
            if now >= self.done_at + self.timing.linger:
                self._finish()
                return [], True
            return [], False
        # Something required is missing. Ask for it once it is overdue.
        for row, node in enumerate(self.senders):
            if now < self.last_nack[row] + self._repeat_after(row):
                continue
            if self.manifest[row]:
                if now < self.last_arrival + self.timing.nack_delay:
                    continue
                missing = np.flatnonzero(required[row])
                if missing.size == 0 and self.manifest.all() and not within:
                    # Required data is in but the bound is not met: ask for the
                    # droppable packets needed to reach it.
                    missing = self._to_reach_bound(row, total - have, total)
                if missing.size:
                    nacks.append(Nack(node, self.shard, tuple(int(m) for m in missing)))
                    self.last_nack[row] = now
                    self.unanswered[row] += 1
            elif now >= self._manifest_due(row):  # no DONE, and the shard has gone quiet
                nacks.append(Nack(node, self.shard, (), need_manifest=True))
                self.last_nack[row] = now
                self.unanswered[row] += 1
        return nacks, False

    def _repeat_after(self, row: int) -> float:
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
        round began and after the last arrival."""
        wait = done_wait(self.clocks.get(self.senders[row]), self.timing)
        if wait < self.timing.grace and self.received[row].any():
            return self.last_arrival + wait
        return max(self.created, self.last_arrival) + self.timing.grace

    def answered(self, sender: int, now: float) -> None:
        """A retransmission from `sender` was stored: its answer to the NACKs
        sent it (`time_answer`)."""
        row = self._row.get(sender)
        if row is None or not self.unanswered[row]:
            return
        clock = self.clocks.get(sender)
        time_answer(clock, self.unanswered[row], float(self.last_nack[row]), now)
        self.unanswered[row] = 0

    def _to_reach_bound(self, row: int, missing_lanes: int, total: int) -> np.ndarray:
        allowed = int(self.bound * total)
        need = missing_lanes - allowed
        gone = np.flatnonzero(~self.received[row])
        take = np.searchsorted(np.cumsum(self.counts[gone]), need) + 1
        return gone[:take]

    def next_timer(self) -> float | None:
        """When `poll` next has something to do (never a time it would idle at)."""
        if self.result is not None:
            return None
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
        for row in range(len(self.senders)):
            again = self.last_nack[row] + self._repeat_after(row)
            if self.manifest[row]:
                if self._row_complete(row):
                    continue
                if not self._required_missing(row).any():
                    if short is None:
                        short = bool(self.manifest.all()) and not self._required_missing().any()
                    if not short:
                        continue
                t.arm(max(again, self.last_arrival + self.timing.nack_delay))
            else:
                t.arm(max(again, self._manifest_due(row)))
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
        return self.result is None and now >= self.created + self.timing.timeout

    def missing_senders(self) -> list[int]:
        return [n for r, n in enumerate(self.senders) if not self.received[r].any()]

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

    def _finish(self) -> None:
        sdt = self.slots.dtype
        out = self.out
        if self._summed_row is not None:  # summed on arrival: own lanes where none came
            assert out is not None and self._summed_own is not None
            own = self._summed_own
            for a, b in self._missing_spans(self._summed_row):
                out[a:b] = own[a:b]
            sums = out
            self._held = {}
            self._summed_own = None
        else:
            sums = self._sum_rows(out, sdt)
        self._result(sums, sdt)

    def _missing_spans(self, row: int) -> list[tuple[int, int]]:
        """The lane ranges (shard-relative) of runs of packets `row` lacks."""
        return self._spans(~self.received[row])

    def _received_spans(self, row: int) -> list[tuple[int, int]]:
        """The lane ranges (shard-relative) of runs of packets `row` holds."""
        return self._spans(self.received[row])

    def _spans(self, packets: np.ndarray) -> list[tuple[int, int]]:
        """The lane ranges (shard-relative) of the runs of packets set in `packets`."""
        idx = np.flatnonzero(packets)
        if idx.size == 0:
            return []
        starts = np.concatenate(([0], np.cumsum(self.counts)))
        cut = np.flatnonzero(np.diff(idx) != 1) + 1
        firsts = idx[np.concatenate(([0], cut))]
        lasts = idx[np.concatenate((cut - 1, [idx.size - 1]))]
        return list(zip(starts[firsts].tolist(), starts[lasts + 1].tolist(), strict=True))

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

    def _result(self, sums: np.ndarray, sdt: np.dtype) -> None:
        contributors = (self.received * self.weight[:, None]).sum(axis=0)
        lost = int(((~self.received) * self.counts).sum())
        self.result = ShardResult(
            shard=self.shard,
            sums=sums,
            contributors=contributors.astype(np.int64),
            block_max=self.block_max.max(axis=0) if len(self.senders) else self.block_max[0],
            lost_lanes=lost,
            total_lanes=int(self.counts.sum()) * len(self.senders),
        )
        self.slots = np.zeros((0, 0), dtype=sdt)  # free the per-sender copies


@dataclass
class _Awaited:
    """What a result collector still waits for from one owner's shard."""

    owner: int
    indices: np.ndarray  # global result-packet indices of the shard
    received: np.ndarray
    done: bool = False
    last_arrival: float | None = None
    last_nack: float = -math.inf
    unanswered: int = 0  # NACKs sent to the owner since it last answered one


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
    waiting: dict[int, _Awaited] = field(init=False)
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

    def __post_init__(self) -> None:
        lay = self.layout
        # Not zeroed: a round completes only with every result packet stored
        # (the result leg is reliable) and the local shard, which tile the bucket.
        dtype = lane_ops.sum_dtype(lay.codec)
        if self.out is None:
            self.sums = _uninitialised((lay.total,), dtype)
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
            self.waiting[shard] = _Awaited(
                owner=owner,
                indices=np.arange(first, first + n),
                received=np.zeros(n, dtype=bool),
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
    ) -> bool:
        """Store one result packet; False if it was a duplicate or late."""
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
        self.sums[offset : offset + count] = lane_ops.unpack(lay.codec, payload, count, True)
        self.contributors[i] = contributors
        self.block_max[i] = block_max
        w.received[local] = True
        w.last_arrival = now
        if w.received.all():
            del self.waiting[shard]
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
    ) -> tuple[np.ndarray, np.ndarray]:
        """Store a run of one owner's result packets of one shard, in order; the
        batch form of `on_result`. Returns (fresh, bad) masks as
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
        lane_ops.store_runs(
            self.sums, lay.codec, True, offsets[take], counts[take], taken(payloads, take)
        )
        it = i[take]
        self.contributors[it] = contributors[take]
        self.block_max[it] = block_max[take]
        w.received[local[take]] = True
        w.last_arrival = now
        if w.received.all():
            del self.waiting[shard]
        return fresh, bad

    def on_result_run(
        self,
        *,
        shard: int,
        sender: int,
        heads: np.ndarray,
        payloads: Sequence[memoryview | bytes],
        now: float,
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
        lane_ops.store_runs(self.sums, lay.codec, True, starts, counts, taken(payloads, take))
        _bulk.mark_results(
            heads, take, local, w.received, self.contributors, self.block_max, lay.per_packet
        )
        w.last_arrival = now
        if w.received.all():
            del self.waiting[shard]
        return take.size, bad

    def on_done(self, *, shard: int, sender: int, now: float) -> None:
        """The owner's DONE for a shard: it has sent every result packet."""
        w = self.waiting.get(shard)
        if w is None or sender != w.owner or w.done:
            return
        w.done = True
        w.last_arrival = now
        w.unanswered = 0  # the DONE a NACK may have asked for (no sample)

    def tally(self) -> None:
        """`lost_lanes` and `total_lanes` from the bucket's result counts, once
        every shard is in: a packet holding c of the round's W contributions
        (the most any packet holds) lacks (W - c) / W of its lanes from each of
        the `senders`. Not from the owners' DONEs: they come after the results,
        usually after the round completed (the losses went uncounted)."""
        counts = self.layout.packet_counts()
        self.total_lanes = int(counts.sum()) * self.senders
        full = int(self.contributors.max(initial=0))
        if full <= 0:
            self.lost_lanes = 0
            return
        short = ((full - self.contributors) * counts).sum()
        self.lost_lanes = round(float(short) * self.senders / full)

    def heard_from(self, node: int, now: float) -> None:
        """A data-leg packet of this round came from `node` (data or a manifest
        for a shard this node owns): it is still busy with the round, so the
        results of its own shards may still be in the making. Asking it for
        them while nothing has come (`poll`) waits a grace after its last."""
        self.heard[node] = now

    def _quiet_since(self, w: _Awaited) -> float:
        """Since when a shard's owner, from which no result has come, has been
        neither asked nor heard from in this round."""
        return max(self.created, w.last_nack, self.heard.get(w.owner, -math.inf))

    def poll(self, now: float) -> list[Nack]:
        """NACKs for result packets that are overdue (result leg is reliable)."""
        nacks: list[Nack] = []
        t = self.timing
        for shard, w in self.waiting.items():
            if now < w.last_nack + self._repeat_after(w):
                continue
            if w.done:
                last = w.last_arrival if w.last_arrival is not None else self.created
                if now >= last + t.nack_delay:
                    missing = np.flatnonzero(~w.received)
                    nacks.append(Nack(w.owner, shard, tuple(int(m) for m in missing)))
                    w.last_nack = now
                    w.unanswered += 1
            elif w.last_arrival is not None and now >= w.last_arrival + self._done_wait(w):
                # Results stopped without their DONE: ask for the DONE only. It
                # trails the owner's queued results, so the precise NACK for what
                # is really missing follows once it arrives.
                nacks.append(Nack(w.owner, shard, (), need_manifest=True))
                w.last_nack = now
                w.unanswered += 1
            elif w.last_arrival is None and now >= self._quiet_since(w) + t.grace:
                # No result from this owner yet, and it has been quiet for a
                # grace: either it is still aggregating (it ignores the
                # question) or every result packet and both DONE copies were
                # lost (a receive buffer overflowed while this host was busy).
                # Ask for the DONE, once per grace. While its data for this
                # node's shards still comes, it is busy with the round: the
                # question would only be ignored.
                nacks.append(Nack(w.owner, shard, (), need_manifest=True))
                w.last_nack = now
        return nacks

    def _repeat_after(self, w: _Awaited) -> float:
        """How long after its last NACK for `w` the owner is asked again."""
        return repeat_wait(self.clocks.get(w.owner), self.timing, w.unanswered)

    def _done_wait(self, w: _Awaited) -> float:
        """How long `w`'s results may pause before its owner is asked for the
        DONE that should have followed them (`done_wait`)."""
        return done_wait(self.clocks.get(w.owner), self.timing)

    def awaits_answer(self, shard: int) -> bool:
        """Whether a NACK for `shard` waits for its answer."""
        w = self.waiting.get(shard)
        return w is not None and w.unanswered > 0

    def answered(self, shard: int, now: float) -> None:
        """A retransmitted result packet of `shard` was stored: the owner's
        answer to the NACKs sent it (`time_answer`)."""
        w = self.waiting.get(shard)
        if w is None or not w.unanswered:
            return
        time_answer(self.clocks.get(w.owner), w.unanswered, w.last_nack, now)
        w.unanswered = 0

    def next_timer(self) -> float | None:
        t = _Tick()
        for w in self.waiting.values():
            if w.last_arrival is None and not w.done:
                t.arm(self._quiet_since(w) + self.timing.grace)
                continue
            last = w.last_arrival if w.last_arrival is not None else self.created
            wait = self.timing.nack_delay if w.done else self._done_wait(w)
            t.arm(max(last + wait, w.last_nack + self._repeat_after(w)))
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
