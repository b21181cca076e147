"""The engine's way in: `receive_many` takes a drain of datagrams at once, cuts
it into runs of one job, round, bucket, type and sender, checks their
headers and MACs in one pass each, and hands each run to the shard's
aggregator (data), the round's result collector (results), or the NACK,
manifest and ACK handlers; `receive_packet` is the same for one datagram.

A part of `dlcp.core.engine.Engine` (a mixin) that holds no state of its own;
what it reads of the engine is declared below for the type checker.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from dlcp.codecs import lanes as lane_ops
from dlcp.core.aggregate import RunRejected, ShardAggregator
from dlcp.core.collector import ResultCollector
from dlcp.core.layout import Layout
from dlcp.core.records import (
    _F32,
    _U32,
    JobSpec,
    OpKey,
    RoundComplete,
    _Contribution,
    _Finished,
    _retransmitted,
    manifest_capacity,
)
from dlcp.core.runs import LANE_TYPES, picked, run_starts, sources
from dlcp.core.timing import NackClock, Timing
from dlcp.errors import DlcpError, LocalError, Reason, RemoteError, WireError
from dlcp.wire.batch import Payloads, decode_batch
from dlcp.wire.header import (
    RESULT_ONLY_CODECS,
    Flags,
    Header,
    PacketType,
    decode,
    header_of_valid,
)
from dlcp.wire.mac import MacKey

__all__ = ["EngineIn"]


class EngineIn:
    """Taking datagrams in: batches cut into runs, checked and dispatched by type."""

    if TYPE_CHECKING:
        _aggs: dict[tuple[OpKey, int], ShardAggregator]
        _clocks: dict[int, dict[int, NackClock]]
        _closed: dict[OpKey, float]
        _closed_shards: dict[tuple[OpKey, int], float]
        _collectors: dict[OpKey, ResultCollector]
        _contribs: dict[OpKey, _Contribution]
        _finished: dict[tuple[OpKey, int], _Finished]
        _held: dict[OpKey, tuple[float, RoundComplete]]
        _keys: dict[int, MacKey]
        _newest: dict[int, int]
        jobs: dict[int, JobSpec]
        last_error: str
        rejects: Counter[Reason]
        stats: Counter[str]
        timing: Timing

        def _aggregator(
            self, op: OpKey, shard: int, lay: Layout, now: float
        ) -> ShardAggregator: ...

        def _check_complete(self, op: OpKey, now: float) -> None: ...

        def _poll_collector(self, op: OpKey, col: ResultCollector, now: float) -> None: ...

        def _progress(self, op: OpKey, shard: int, now: float) -> None: ...

        def _release_held(self, now: float, *, op: OpKey | None = None) -> None: ...

        def _send_data(
            self, c: _Contribution, shard: int, owner: int, only: Sequence[int] | None
        ) -> None: ...

        def _send_manifest(self, c: _Contribution, shard: int, owner: int, copies: int) -> None: ...

        def _send_result_done(self, f: _Finished, node: int, copies: int) -> None: ...

        def _send_results(self, f: _Finished, node: int, only: Sequence[int] | None) -> None: ...

        def _shard_closed(self, spec: JobSpec, op: OpKey, shard: int) -> bool: ...

    # -- receiving ----------------------------------------------------------
    def receive(
        self, datagram: bytes | memoryview, now: float, src: int | None = None
    ) -> Header | None:
        """Take one datagram from the network; rejects are counted, never raised.

        `src` is the node the datagram's source address belongs to, when the
        caller knows it; a header claiming another sender is rejected.
        Returns the header of an accepted packet, None for a rejected one.
        """
        try:
            header, payload = decode(datagram, self._keys)
        except WireError as exc:
            self.rejects[exc.reason] += 1
            return None
        return header if self.receive_packet(header, payload, now, src) else None

    def receive_batch(
        self,
        datagrams: Sequence[bytes | memoryview],
        now: float,
        srcs: Sequence[int | None] | np.ndarray | None = None,
    ) -> list[tuple[int, Header]]:
        """Take many datagrams at once (see `receive_many`); returns (position,
        header) of the accepted packets, rejects are counted."""
        acc = self.receive_many(datagrams, now, srcs)
        return [(i, header_of_valid(datagrams[i])) for i in acc.tolist()]

    def receive_many(
        self,
        datagrams: Sequence[bytes | memoryview],
        now: float,
        srcs: Sequence[int | None] | np.ndarray | None = None,
    ) -> np.ndarray:
        """Take many datagrams at once; returns the positions of the accepted ones.

        Batch decode (vectorised checks, per-packet MAC), then consecutive data
        or result packets of one sender for one shard are taken as a run: the
        per-packet checks once, the aggregator's or collector's bookkeeping with
        array operations. The outcome (state, sums, stats, rejects per reason)
        is that of `receive` called per datagram, each source's in their order
        and the sources one after another (a stable sort by source: an
        aggregator that takes several hosts' packets interleaved still gets
        long runs). Sources are independent but for fp32 sums' rounding,
        which depends on arrival order anyway.
        """
        batch = decode_batch(datagrams, self._keys)
        if batch.rejects:
            self.rejects.update(batch.rejects)
        n = len(batch)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        f = batch.fields
        index = batch.index
        src = sources(srcs, index)
        payloads = batch.payloads
        if n > 1 and (src != src[0]).any():
            # several sources' packets interleaved (an aggregator in the switch
            # takes every host's at once): each source's together, in its own
            # order, so that they make long runs, not runs of one or two
            order = np.argsort(src, kind="stable")
            f, index, src = f[order], index[order], src[order]
            payloads = _reordered(payloads, order)
        starts = run_starts(f, src)
        ends = [*starts[1:], n]
        ok = np.zeros(n, dtype=bool)
        ptype = f["type"]
        for a, b in zip(starts, ends, strict=True):
            if LANE_TYPES[ptype[a]]:
                h = header_of_valid(datagrams[int(index[a])])
                s_ = int(src[a])
                bad = self._receive_run(h, f[a:b], payloads[a:b], now, None if s_ < 0 else s_)
                ok[a:b] = True if bad is None else ~bad
                continue
            for k in range(a, b):
                s_ = int(src[k])
                h = header_of_valid(datagrams[int(index[k])])
                ok[k] = self.receive_packet(h, payloads[k], now, None if s_ < 0 else s_)
        return np.sort(index[ok])

    def _receive_run(
        self,
        h: Header,
        heads: np.ndarray,
        payloads: Sequence[memoryview],
        now: float,
        src: int | None,
    ) -> np.ndarray | None:
        """A run of data or result packets that share everything `_dispatch`
        checks (`h` is the first one's header, `heads` their records); returns
        which were rejected (None: none)."""
        n = len(payloads)
        try:
            spec = self._check_dispatch(h, src)
            op = (h.job, h.round, h.bucket)
            if h.type == PacketType.DATA:
                return self._data_run(spec, op, h, heads, payloads, now)
            return self._result_run(spec, op, h, heads, payloads, now)
        except RunRejected as exc:
            n_bad = int(exc.bad.sum())
            self.rejects[Reason.BAD_RANGE] += n_bad
            self.rejects[exc.reason] += n - n_bad
        except RemoteError as exc:
            self.rejects[exc.reason] += n
        except (DlcpError, ValueError) as exc:  # a bug or inconsistency, never fatal here
            self.rejects[Reason.BAD_RANGE] += n
            self.stats["internal_errors"] += n
            self.last_error = str(exc)
        return np.ones(n, dtype=bool)

    def _data_run(
        self,
        spec: JobSpec,
        op: OpKey,
        h: Header,
        heads: np.ndarray,
        payloads: Sequence[memoryview],
        now: float,
    ) -> np.ndarray | None:
        lay = self._owned_layout(spec, op, h)
        if lay is None:
            self.stats["late_packets"] += len(payloads) - 1
            return None
        self._heard(op, h.sender, now)
        agg = self._aggregator(op, h.shard, lay, now)
        if any(agg.unanswered) and _retransmitted(heads):
            agg.answered(h.sender, now)
        stored, bad = agg.on_data_run(
            sender=h.sender,
            heads=heads,
            payloads=payloads,
            summed=bool(h.flags & Flags.SUMMED),
            weight=h.contributors,
            scale=h.param,
            now=now,
        )
        self._count_run(len(payloads), stored, bad, "data_packets_received")
        if stored and agg.may_complete():
            self._progress(op, h.shard, now)
            if self._aggs.get((op, h.shard)) is not agg:  # the run closed the shard
                # what follows its last stored packet met a closed shard: late
                bad = self._after_close(bad, agg.last_stored + 1, len(payloads), late=True)
        return bad

    def _result_run(
        self,
        spec: JobSpec,
        op: OpKey,
        h: Header,
        heads: np.ndarray,
        payloads: Sequence[memoryview],
        now: float,
    ) -> np.ndarray | None:
        col = self._collectors.get(op)
        if col is None:
            self.stats["late_packets"] += len(payloads)
            return None
        self._check_owner(spec, h)
        if col.layout.total != h.total or col.layout.codec != lane_ops.WIDE.get(h.codec, h.codec):
            raise RemoteError(Reason.MISMATCH, "result for a different bucket size or codec")
        if col.awaits_answer(h.shard) and _retransmitted(heads):
            col.answered(h.shard, now)
        stored, bad = col.on_result_run(
            shard=h.shard, sender=h.sender, heads=heads, payloads=payloads, now=now, codec=h.codec
        )
        self._count_run(len(payloads), stored, bad, "result_packets_received")
        self._check_complete(op, now)
        if stored and h.shard not in col.waiting:  # the run completed the shard
            # what follows its last stored packet met a shard no longer waited
            # for (duplicates), or a completed round (late)
            late = self._collectors.get(op) is not col
            bad = self._after_close(bad, col.last_stored + 1, len(payloads), late=late)
        return bad

    def _after_close(
        self, bad: np.ndarray | None, first: int, n: int, *, late: bool
    ) -> np.ndarray | None:
        """A run closed its shard (or the shard's results) at packet `first - 1`;
        packet by packet, those from `first` on would have found it closed: late
        (`late`) or duplicates, none of them rejected. `_count_run` counted them
        as BAD_RANGE (`bad`) and duplicates: recount them so; returns `bad` with
        them accepted."""
        tail = n - first
        if tail <= 0:
            return bad
        n_bad = 0 if bad is None else int(bad[first:].sum())
        if n_bad:
            assert bad is not None
            self.rejects[Reason.BAD_RANGE] -= n_bad
            bad = bad.copy()
            bad[first:] = False
        if late:
            self.stats["duplicate_packets"] -= tail - n_bad
            self.stats["late_packets"] += tail
        else:
            self.stats["duplicate_packets"] += n_bad
        return bad if bad is None or bad.any() else None

    def _count_run(self, n: int, stored: int, bad: np.ndarray | None, received: str) -> None:
        """Count a run's outcome (`stored`, BAD_RANGE, the rest duplicates)."""
        n_bad = 0 if bad is None else int(bad.sum())
        if n_bad:
            self.rejects[Reason.BAD_RANGE] += n_bad
        if stored:
            self.stats[received] += stored
        if n - n_bad - stored:
            self.stats["duplicate_packets"] += n - n_bad - stored

    def receive_packet(
        self, h: Header, payload: memoryview, now: float, src: int | None = None
    ) -> bool:
        """Take one authenticated packet (from `decode` or `decode_batch`); False: rejected."""
        try:
            self._dispatch(h, payload, now, src)
        except RemoteError as exc:
            self.rejects[exc.reason] += 1
            return False
        except (DlcpError, ValueError) as exc:  # a bug or inconsistency, never fatal here
            self.rejects[Reason.BAD_RANGE] += 1
            self.stats["internal_errors"] += 1
            self.last_error = str(exc)
            return False
        return True

    def _dispatch(self, h: Header, payload: memoryview, now: float, src: int | None) -> None:
        spec = self._check_dispatch(h, src)
        self._route(spec, (h.job, h.round, h.bucket), h, payload, now)

    def _check_dispatch(self, h: Header, src: int | None) -> JobSpec:
        """The checks every packet passes before its type's handler; its job's spec."""
        spec = self.jobs.get(h.job)
        if spec is None:
            raise RemoteError(Reason.UNKNOWN_JOB, str(h.job))
        if h.sender not in spec.members or (src is not None and src != h.sender):
            raise RemoteError(Reason.BAD_SENDER, f"node {h.sender} from {src}")
        if h.sender == spec.me:
            raise RemoteError(Reason.BAD_SENDER, "a packet claiming to be from this node")
        if h.round + spec.window < self._newest.get(h.job, 0):
            raise RemoteError(Reason.STALE_ROUND, f"round {h.round}")
        if h.shard >= len(spec.owners):
            raise RemoteError(Reason.BAD_RANGE, f"shard {h.shard} of {len(spec.owners)}")
        if h.codec in RESULT_ONLY_CODECS and h.type != PacketType.RESULT:
            raise RemoteError(Reason.BAD_CODEC, f"{h.codec.name}: sums of result packets only")
        return spec

    def _route(self, spec: JobSpec, op: OpKey, h: Header, payload: memoryview, now: float) -> None:
        result_leg = bool(h.flags & Flags.RESULT_LEG)
        t = h.type
        if t == PacketType.DATA:
            self._on_data(spec, op, h, payload, now)
        elif t == PacketType.DONE and not result_leg:
            self._on_manifest(spec, op, h, payload, now)
        elif t == PacketType.RESULT:
            self._on_result(spec, op, h, payload, now)
        elif t == PacketType.DONE:
            col = self._collectors.get(op)
            if col is None:
                self.stats["late_packets"] += 1
                return
            self._check_owner(spec, h)
            # (its `aux`, the owner's lost lanes, is not needed: `ResultCollector.tally`)
            col.on_done(shard=h.shard, sender=h.sender, now=now)
            self._poll_collector(op, col, now)
        elif t == PacketType.NACK:
            self._on_nack(spec, op, h, payload, result_leg, now)
        elif t == PacketType.ACK:
            f = self._finished.get((op, h.shard))
            if f is not None:
                f.waiting.discard(h.sender)
                if not f.waiting:
                    del self._finished[(op, h.shard)]
                    if op in self._held:
                        self._release_held(now, op=op)
        else:
            self.stats["control_packets"] += 1

    def _check_owner(self, spec: JobSpec, h: Header) -> None:
        if spec.owners[h.shard] != h.sender:
            raise RemoteError(Reason.BAD_SENDER, f"node {h.sender} does not own shard {h.shard}")

    def _owned_layout(self, spec: JobSpec, op: OpKey, h: Header) -> Layout | None:
        """Layout of a shard this node owns; None when the round is closed here."""
        if spec.owners[h.shard] != spec.me:
            raise RemoteError(Reason.BAD_RANGE, f"shard {h.shard} is not owned by this node")
        if h.sender not in spec.contributors:
            raise RemoteError(Reason.BAD_SENDER, f"node {h.sender} does not contribute")
        if (
            (op, h.shard) in self._finished
            or (op, h.shard) in self._closed_shards
            or op in self._closed
            or self._shard_closed(spec, op, h.shard)
        ):
            self.stats["late_packets"] += 1
            return None
        agg = self._aggs.get((op, h.shard))
        if agg is not None:
            if agg.layout.total != h.total or agg.layout.codec != h.codec:
                raise RemoteError(Reason.MISMATCH, "bucket size or codec differs between senders")
            return agg.layout
        try:
            return Layout(
                total=h.total, codec=h.codec, shards=len(spec.owners), payload=spec.payload
            )
        except LocalError as exc:
            raise RemoteError(Reason.BAD_RANGE, str(exc)) from exc

    def _on_data(
        self, spec: JobSpec, op: OpKey, h: Header, payload: memoryview, now: float
    ) -> None:
        lay = self._owned_layout(spec, op, h)
        if lay is None:
            return
        self._heard(op, h.sender, now)
        agg = self._aggregator(op, h.shard, lay, now)
        if h.flags & Flags.RETRANSMIT:
            agg.answered(h.sender, now)
        fresh = agg.on_data(
            sender=h.sender,
            offset=h.offset,
            count=h.count,
            payload=payload,
            summed=bool(h.flags & Flags.SUMMED),
            weight=h.contributors,
            droppable=bool(h.flags & Flags.DROPPABLE),
            scale=h.param,
            block_max=_F32.unpack(_U32.pack(h.aux))[0],
            now=now,
            priority=h.priority,
            layer=h.layer,
        )
        if not fresh:
            self.stats["duplicate_packets"] += 1
            return
        self.stats["data_packets_received"] += 1
        if agg.may_complete():
            self._progress(op, h.shard, now)

    def _heard(self, op: OpKey, sender: int, now: float) -> None:
        """A data-leg packet of round `op` from `sender`: this node's collector
        of the round, if any, hears that the sender is still busy with it."""
        col = self._collectors.get(op)
        if col is not None:
            col.heard_from(sender, now)

    def _on_manifest(
        self, spec: JobSpec, op: OpKey, h: Header, payload: memoryview, now: float
    ) -> None:
        lay = self._owned_layout(spec, op, h)
        if lay is None:
            return
        self._heard(op, h.sender, now)
        agg = self._aggregator(op, h.shard, lay, now)
        per = manifest_capacity(lay.payload)
        first, n = h.offset, h.count
        if first % per or n != min(per, agg.n_packets - first) or len(payload) * 8 < n:
            raise RemoteError(
                Reason.BAD_RANGE,
                f"manifest part of packets {first}+{n} ({len(payload)} bytes): a shard of "
                f"{agg.n_packets} packets goes in parts of {per}",
            )
        bits = np.unpackbits(np.frombuffer(payload, np.uint8), bitorder="little")[:n]
        agg.on_manifest(
            sender=h.sender, droppable=bits.astype(bool), bound=h.param, now=now, first=first
        )
        self._progress(op, h.shard, now)

    def _on_result(
        self, spec: JobSpec, op: OpKey, h: Header, payload: memoryview, now: float
    ) -> None:
        col = self._collectors.get(op)
        if col is None:
            self.stats["late_packets"] += 1
            return
        self._check_owner(spec, h)
        if col.layout.total != h.total or col.layout.codec != lane_ops.WIDE.get(h.codec, h.codec):
            raise RemoteError(Reason.MISMATCH, "result for a different bucket size or codec")
        if h.flags & Flags.RETRANSMIT:
            col.answered(h.shard, now)
        fresh = col.on_result(
            shard=h.shard,
            sender=h.sender,
            offset=h.offset,
            count=h.count,
            payload=payload,
            contributors=h.contributors,
            block_max=h.param,
            now=now,
            codec=h.codec,
        )
        self.stats["result_packets_received" if fresh else "duplicate_packets"] += 1
        self._check_complete(op, now)

    def _unsent_lately(
        self,
        spec: JobSpec,
        store: dict[tuple[int, int], np.ndarray],
        key: tuple[int, int],
        n: int,
        idx: np.ndarray,
        now: float,
    ) -> list[int]:
        """The NACKed packets not already resent lately: within half the wait
        after which the NACKing node (`key[1]`) repeats a NACK, as this node
        would repeat its own to that node (the paths both ways alike), or
        within `nack_interval` until that is known.

        A receiver repeats its NACK while packets are missing; resending what
        is still queued or in flight would only feed a retransmission storm.
        """
        last = store.get(key)
        if last is None:
            last = store[key] = np.full(n, -np.inf)
        window = self.timing.nack_interval
        clock = self._clocks.get(spec.job, {}).get(key[1])
        if clock is not None and clock.samples:
            window = clock.repeat_after(self.timing) / 2
        fresh = idx[now >= last[idx] + window]
        dup = idx.size - fresh.size
        if dup:
            self.stats["retransmits_suppressed"] += dup
        last[fresh] = now
        return fresh.tolist()

    def _on_nack(
        self,
        spec: JobSpec,
        op: OpKey,
        h: Header,
        payload: memoryview,
        result_leg: bool,
        now: float,
    ) -> None:
        idx = np.frombuffer(payload, dtype=">u4").astype(np.int64)
        if result_leg:
            f = self._finished.get((op, h.shard))
            if f is None:
                self.stats["nacks_ignored"] += 1
                return
            n = f.layout.shard_result_count(h.shard)
            if idx.size and idx.max() >= n:
                raise RemoteError(Reason.BAD_RANGE, f"NACK for result packet {idx.max()} of {n}")
            if idx.size:
                todo = self._unsent_lately(spec, f.resent, (h.shard, h.sender), n, idx, now)
                if todo:
                    self._send_results(f, h.sender, todo)
            if h.flags & Flags.NEED_MANIFEST:
                self._send_result_done(f, h.sender, copies=1)
            return
        self._check_owner(spec, h)
        c = self._contribs.get(op)
        if c is None:
            self.stats["nacks_ignored"] += 1
            return
        n = len(c.layout.shard_packets(h.shard))
        if idx.size and idx.max() >= n:
            raise RemoteError(Reason.BAD_RANGE, f"NACK for packet {idx.max()} of {n}")
        if idx.size:
            todo = self._unsent_lately(spec, c.resent, (h.shard, h.sender), n, idx, now)
            if todo:
                self._send_data(c, h.shard, h.sender, todo)
        if h.flags & Flags.NEED_MANIFEST:
            self._send_manifest(c, h.shard, h.sender, copies=1)


def _reordered(payloads: Sequence[memoryview], order: np.ndarray) -> Sequence[memoryview]:
    """`payloads` in `order` (a `Payloads` stays one: views made when asked for)."""
    if isinstance(payloads, Payloads):
        return Payloads(picked(payloads.datagrams, order), payloads.skip)
    return picked(payloads, order)
