"""The engine's way in: `receive_many` takes a drain of datagrams at once, cuts
it into runs of one job, round, bucket, type and sender, checks their
headers and MACs in one pass each, and hands each run of data or results to
the shard's aggregator or the round's result collector with array
operations; every other packet goes to the `Dispatcher` (dlcp.core.dispatch)
one at a time, as `receive` does for one datagram.

`Receiver` holds nothing of its own but its collaborators: the jobs' MAC keys
(the engine's), the table of open rounds, the dispatcher whose checks the
runs share, and the shared counters.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dlcp.core.aggregate import RunRejected
from dlcp.core.dispatch import Dispatcher
from dlcp.core.records import JobSpec, OpKey, Tally, _retransmitted
from dlcp.core.rounds import OpenRounds
from dlcp.core.runs import LANE_TYPES, picked, run_starts, sources
from dlcp.errors import DlcpError, Reason, RemoteError, WireError
from dlcp.wire.batch import Payloads, decode_batch
from dlcp.wire.header import Flags, Header, PacketType, decode, header_of_valid
from dlcp.wire.mac import MacKey

__all__ = ["Receiver"]


class Receiver:
    """Taking datagrams in: batches cut into runs, checked and dispatched by type."""

    def __init__(
        self,
        *,
        keys: dict[int, MacKey],
        rounds: OpenRounds,
        packets: Dispatcher,
        tally: Tally,
    ) -> None:
        self.keys = keys  # the engine's, per job (read only here)
        self.rounds = rounds
        self.packets = packets
        self.tally = tally
        self.stats = tally.stats
        self.rejects = tally.rejects

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
            header, payload = decode(datagram, self.keys)
        except WireError as exc:
            self.rejects[exc.reason] += 1
            return None
        return header if self.packets.receive_packet(header, payload, now, src) else None

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
        batch = decode_batch(datagrams, self.keys)
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
                ok[k] = self.packets.receive_packet(h, payloads[k], now, None if s_ < 0 else s_)
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
            spec = self.packets.check_dispatch(h, src)
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
            self.tally.last_error = str(exc)
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
        lay = self.packets.owned_layout(spec, op, h)
        if lay is None:
            self.stats["late_packets"] += len(payloads) - 1
            return None
        r, agg = self.rounds.aggregator(spec, op, h.shard, lay, now)
        if r.collector is not None:  # it hears that the sender is still busy with the round
            r.collector.heard_from(h.sender, now)
        if agg.clock.awaits_answer() and _retransmitted(heads):
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
            self.rounds.progress(r, h.shard, now)
            if r.aggs.get(h.shard) is not agg:  # the run closed the shard
                # what follows its last stored packet met a closed shard: late
                bad = self._after_close(bad, agg.last_stored + 1, len(payloads), late=True)
        elif stored:
            self.rounds.early(r, h.shard, agg)
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
        found = self.packets.collector_of(spec, op, h, len(payloads))
        if found is None:
            return None
        r, col = found
        if col.awaits_answer(h.shard) and _retransmitted(heads):
            col.answered(h.shard, now)
        stored, bad = col.on_result_run(
            shard=h.shard, sender=h.sender, heads=heads, payloads=payloads, now=now, codec=h.codec
        )
        self._count_run(len(payloads), stored, bad, "result_packets_received")
        self.rounds.check_complete(r, now)
        if stored and h.shard not in col.waiting:  # the run completed the shard
            # what follows its last stored packet met a shard no longer waited
            # for (duplicates), or a completed round (late)
            late = r.collector is not col
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


def _reordered(payloads: Sequence[memoryview], order: np.ndarray) -> Sequence[memoryview]:
    """`payloads` in `order` (a `Payloads` stays one: views made when asked for)."""
    if isinstance(payloads, Payloads):
        return Payloads(picked(payloads.datagrams, order), payloads.skip)
    return picked(payloads, order)
