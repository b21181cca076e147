"""One authenticated packet, checked and handed to its round by type: data
and DONE manifests to the shard's aggregator, results and result DONEs to
the round's collector, NACKs answered from the round's contribution or
finished shard, ACKs to the finished shard they release.

`Dispatcher` holds nothing of its own but its collaborators: the jobs (the
engine's), the table of open rounds, the closed-round memory that says what
is late, the emitter that answers NACKs, and the shared counters.
`dlcp.core.receiver.Receiver` uses its checks for whole runs of packets.
"""

from __future__ import annotations

import numpy as np

from dlcp.codecs import lanes as lane_ops
from dlcp.core.closed import ClosedRounds
from dlcp.core.collector import ResultCollector
from dlcp.core.emitter import Emitter
from dlcp.core.layout import Layout
from dlcp.core.records import _F32, _U32, ALL_GATHER, JobSpec, OpKey, Tally, manifest_capacity
from dlcp.core.round import Round
from dlcp.core.rounds import OpenRounds
from dlcp.core.timing import NackClock, Timing
from dlcp.errors import DlcpError, LocalError, Reason, RemoteError
from dlcp.wire.header import RESULT_ONLY_CODECS, Flags, Header, PacketType

__all__ = ["Dispatcher"]


class Dispatcher:
    """Checks a packet and hands it to its round, by type."""

    def __init__(
        self,
        *,
        jobs: dict[int, JobSpec],
        clocks: dict[int, dict[int, NackClock]],
        timing: Timing,
        rounds: OpenRounds,
        closed: ClosedRounds,
        emitter: Emitter,
        tally: Tally,
    ) -> None:
        self.jobs = jobs  # the engine's (read only here), as are `clocks`
        self.clocks = clocks
        self.timing = timing
        self.rounds = rounds
        self.closed = closed
        self.emitter = emitter
        self.tally = tally
        self.stats = tally.stats
        self.rejects = tally.rejects

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
            self.tally.last_error = str(exc)
            return False
        return True

    def _dispatch(self, h: Header, payload: memoryview, now: float, src: int | None) -> None:
        spec = self.check_dispatch(h, src)
        self._route(spec, (h.job, h.round, h.bucket), h, payload, now)

    def check_dispatch(self, h: Header, src: int | None) -> JobSpec:
        """The checks every packet passes before its type's handler; its job's spec."""
        spec = self.jobs.get(h.job)
        if spec is None:
            raise RemoteError(Reason.UNKNOWN_JOB, str(h.job))
        if h.sender not in spec.members or (src is not None and src != h.sender):
            raise RemoteError(Reason.BAD_SENDER, f"node {h.sender} from {src}")
        if h.sender == spec.me:
            raise RemoteError(Reason.BAD_SENDER, "a packet claiming to be from this node")
        if h.round + spec.window < self.closed.newest.get(h.job, 0):
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
            found = self.collector_of(spec, op, h, 1, result=False)
            if found is None:
                return
            rnd, col = found
            # (its `aux`, the owner's lost lanes, is not needed: `ResultCollector.tally`)
            col.on_done(shard=h.shard, sender=h.sender, now=now)
            self.rounds.poll_collector(rnd, col, now)
        elif t == PacketType.NACK:
            self._on_nack(spec, op, h, payload, result_leg, now)
        elif t == PacketType.ACK:
            r = self.rounds.table.get(op)
            if r is not None:
                self.rounds.acked(r, h.shard, h.sender, now)
        else:
            self.stats["control_packets"] += 1

    def collector_of(
        self, spec: JobSpec, op: OpKey, h: Header, n: int, *, result: bool = True
    ) -> tuple[Round, ResultCollector] | None:
        """The open round `op` and its collector for `n` packets of the result
        leg from shard `h.shard`'s owner (checked; with `result`, also that
        they are of the collector's bucket size and codec); None, the `n`
        counted late, when the round is not open here or collects nothing."""
        r = self.rounds.table.get(op)
        col = None if r is None else r.collector
        if r is None or col is None:
            self.stats["late_packets"] += n
            return None
        self.check_owner(spec, h)
        if result and (
            col.layout.total != h.total or col.layout.codec != lane_ops.WIDE.get(h.codec, h.codec)
        ):
            raise RemoteError(Reason.MISMATCH, "result for a different bucket size or codec")
        return r, col

    def check_owner(self, spec: JobSpec, h: Header) -> None:
        if spec.owners[h.shard] != h.sender:
            raise RemoteError(Reason.BAD_SENDER, f"node {h.sender} does not own shard {h.shard}")

    def owned_layout(self, spec: JobSpec, op: OpKey, h: Header) -> Layout | None:
        """Layout of a shard this node owns; None when the round is closed here."""
        if spec.owners[h.shard] != spec.me:
            raise RemoteError(Reason.BAD_RANGE, f"shard {h.shard} is not owned by this node")
        if h.sender not in spec.contributors:
            raise RemoteError(Reason.BAD_SENDER, f"node {h.sender} does not contribute")
        r = self.rounds.table.get(op)
        if (r is not None and h.shard in r.finished) or self.closed.is_late(spec, op, h.shard):
            self.stats["late_packets"] += 1
            return None
        agg = None if r is None else r.aggs.get(h.shard)
        if agg is not None:
            if agg.layout.total != h.total or agg.layout.codec != h.codec:
                raise RemoteError(Reason.MISMATCH, "bucket size or codec differs between senders")
            return agg.layout
        try:
            return spec.layout(h.total, h.codec)
        except LocalError as exc:
            raise RemoteError(Reason.BAD_RANGE, str(exc)) from exc

    def _on_data(
        self, spec: JobSpec, op: OpKey, h: Header, payload: memoryview, now: float
    ) -> None:
        lay = self.owned_layout(spec, op, h)
        if lay is None:
            return
        r, agg = self.rounds.aggregator(spec, op, h.shard, lay, now)
        if r.collector is not None:  # it hears that the sender is still busy with the round
            r.collector.heard_from(h.sender, now)
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
            retransmit=bool(h.flags & Flags.RETRANSMIT),
        )
        if not fresh:
            self.stats["duplicate_packets"] += 1
            return
        self.stats["data_packets_received"] += 1
        if agg.may_complete():
            self.rounds.progress(r, h.shard, now)
        else:
            self.rounds.early(r, h.shard, agg)

    def _on_manifest(
        self, spec: JobSpec, op: OpKey, h: Header, payload: memoryview, now: float
    ) -> None:
        r = self.rounds.table.get(op)
        if r is not None and r.kind == ALL_GATHER and spec.owners[h.shard] == spec.me:
            # an all-gather's receiver has submitted: its results may go (the
            # owner's shard is summed alone; nothing of the sender's to wait for)
            if h.sender not in spec.contributors:
                raise RemoteError(Reason.BAD_SENDER, f"node {h.sender} does not contribute")
            self.rounds.ready(r, h.sender)
            return
        lay = self.owned_layout(spec, op, h)
        if lay is None:
            return
        r, agg = self.rounds.aggregator(spec, op, h.shard, lay, now)
        if r.collector is not None:  # it hears that the sender is still busy with the round
            r.collector.heard_from(h.sender, now)
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
        self.rounds.progress(r, h.shard, now)

    def _on_result(
        self, spec: JobSpec, op: OpKey, h: Header, payload: memoryview, now: float
    ) -> None:
        found = self.collector_of(spec, op, h, 1)
        if found is None:
            return
        r, col = found
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
            priority=h.priority,
            retransmit=bool(h.flags & Flags.RETRANSMIT),
            early=bool(h.flags & Flags.EARLY),
            aux=h.aux,
        )
        self.stats["result_packets_received" if fresh else "duplicate_packets"] += 1
        self.rounds.check_complete(r, now)

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
        window = self._resend_window(spec, key[1])
        fresh = idx[now >= last[idx] + window]
        dup = idx.size - fresh.size
        if dup:
            self.stats["retransmits_suppressed"] += dup
        last[fresh] = now
        return fresh.tolist()

    def _resend_window(self, spec: JobSpec, node: int) -> float:
        """How long after resending a packet to `node` it is not resent again:
        half the wait after which that node repeats a NACK, as this node would
        repeat its own to it, or `nack_interval` until that is known."""
        clock = self.clocks.get(spec.job, {}).get(node)
        if clock is not None and clock.samples:
            return clock.repeat_after(self.timing) / 2
        return self.timing.nack_interval

    def _early_nack(self, spec: JobSpec, op: OpKey, h: Header, idx: np.ndarray, now: float) -> None:
        """A result NACK for a shard not complete here: its packets sent early
        (`dlcp.core.early`) go again; the rest is ignored."""
        r = self.rounds.table.get(op)
        early = None if r is None else r.early.get(h.shard)
        if early is None or early.results is None:
            self.stats["nacks_ignored"] += 1
            return
        n = _result_count(early.agg.layout, h.shard, idx)
        sent = idx[early.results[idx]]
        if not sent.size:
            self.stats["nacks_ignored"] += 1
            return
        todo = self._unsent_lately(spec, early.resent, (h.shard, h.sender), n, sent, now)
        if todo:
            self.emitter.early_resend(spec, op, early, todo, h.sender)

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
        r = self.rounds.table.get(op)
        if result_leg:
            f = None if r is None else r.finished.get(h.shard)
            if f is None:
                self._early_nack(spec, op, h, idx, now)
                return
            if h.sender in f.deferred:  # its "ready" manifests were lost: it is there
                assert r is not None
                self.rounds.ready(r, h.sender)
                return
            n = _result_count(f.layout, h.shard, idx)
            if idx.size:
                todo = self._unsent_lately(spec, f.resent, (h.shard, h.sender), n, idx, now)
                if todo:
                    self.emitter.results(f, h.sender, todo)
            if h.flags & Flags.NEED_MANIFEST:
                self.emitter.result_done(f, h.sender, copies=1)
            return
        self.check_owner(spec, h)
        c = None if r is None else r.contribution
        if r is None or c is None:
            self.stats["nacks_ignored"] += 1
            return
        n = len(c.layout.shard_packets(h.shard))
        if idx.size and idx.max() >= n:
            raise RemoteError(Reason.BAD_RANGE, f"NACK for packet {idx.max()} of {n}")
        if c.kind == ALL_GATHER:  # an owner that had not submitted yet: no data to give
            idx = idx[:0]
        if idx.size and h.flags & Flags.NEED_MANIFEST:
            # asked without this node's DONE, the owner cannot tell which of them
            # are droppable (it found them lost by what came after them): those
            # stay out, as the bound allows (the DONE that says so is on its way
            # behind the packets: `ShardClock.poll`)
            first = c.layout.shard_packets(h.shard).start
            idx = idx[~c.droppable[first + idx]]
        if idx.size:
            todo = self._unsent_lately(spec, c.resent, (h.shard, h.sender), n, idx, now)
            if todo:
                self.emitter.data(c, h.shard, h.sender, todo, r.gathered)
        if h.flags & Flags.NEED_MANIFEST and not h.count:  # the DONE alone is asked for
            self.emitter.manifest(c, h.shard, h.sender, copies=1)


def _result_count(lay: Layout, shard: int, idx: np.ndarray) -> int:
    """The shard's result packets, which NACK indices `idx` must be below
    (a RemoteError, BAD_RANGE, if one is not)."""
    n = lay.shard_result_count(shard)
    if idx.size and idx.max() >= n:
        raise RemoteError(Reason.BAD_RANGE, f"NACK for result packet {idx.max()} of {n}")
    return n
