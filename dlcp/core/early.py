"""A shard's result packets sent before the shard completes: pipelined legs.

A data packet whose every sender's copy is in has its final sum: nothing
more adds to it. Its owner sends its result packets then, flagged EARLY,
instead of after the whole shard, whose last packet is the slowest
sender's (its lost packets' retransmissions too). Without this the owner's
link idles from the end of its own data leg until then: 10-16 ms of a
clean 3-host 200 Mbit/s round on the testbed, and more under loss.

`EarlyResults` is one shard's record of what went early; the round's
`OpenRounds.progress` asks it after the shard's arrivals (`take`) and hands
its mask to the finished shard, whose results (`Emitter.results`) then
leave those packets out. The sums are the shard's own, made final early by
`ShardAccumulator.sum_packets` with the additions `finish` makes.

Receivers: an EARLY packet's place in its owner's order says nothing of
the packets before it by number (`dlcp.core.stream`'s inference needs
packets queued in index order, and those whose data came last go last), so
each says which packets went just before it in its class's queue instead:
`aux` holds the result indices (+1, 0: none) of the two EARLY packets
queued before it in its class (a peer's send queue and a switch's class
queue are FIFOs), the lower 16 bits the nearer one (`chain`; read by
`dlcp.core.stream.pointers`).
A receiver takes those it lacks for lost, as it takes packets before a
later one of theirs (`PacketStream.pointed`); two pointers cover a loss of
two in a row. Shards of 65,535 result packets or more carry none; losses
there are found by the packets that follow at the shard's end, or by the
DONE.

THC's results go in its narrow sums (`lanes.narrow_sums`: 10 bits for three
hosts' thc8, not 16) where that is the shard's one codec by construction
(`early_codec`): every sum its contributions can make fits, and every result
packet starts and ends on a byte; so the packets sent early and those sent
when the shard completes carry the same codec, and a NACK's answer the one
first sent. Elsewhere THC's narrow form is a choice over the whole shard's
sums and the sketch's UNION lanes are bits: those go at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dlcp.codecs.lanes import NARROW
from dlcp.core.aggregate import ShardAggregator
from dlcp.core.records import JobSpec, OpKey
from dlcp.wire.header import Codec, narrow_fits

if TYPE_CHECKING:
    from dlcp.core.emitter import Emitter

__all__ = ["EARLY_CODECS", "EarlyResults", "early_codec"]

# codecs whose results may go early: each lane's own sum, packed alone (THC's
# where `early_codec` says so)
EARLY_CODECS = frozenset({int(Codec.FP32), int(Codec.FP16), int(Codec.THC8), int(Codec.THC4)})
_CLASSES = 8
_NONE = 0xFFFF  # result indices from here on do not fit a pointer


def early_codec(agg: ShardAggregator) -> int | None:
    """The codec of a shard's results sent early, None where none can go:
    fp32's and fp16's own; THC's narrow sums where every sum of the shard's
    contributions (each lane at most its codec's top, times its sender's
    weight) fits them, so that `lanes.narrow_sums` gives the rest of the
    shard the same codec when it completes (THC's buckets are whole blocks
    of 1024 lanes: every result packet's narrow lanes are whole bytes)."""
    codec = int(agg.layout.codec)
    if codec not in NARROW:
        return codec if codec in EARLY_CODECS else None
    return NARROW[codec] if narrow_fits(codec, int(agg.weight.sum())) else None


class EarlyResults:
    """Which data packets of one shard had their results sent early."""

    def __init__(self, agg: ShardAggregator, batch: int) -> None:
        if batch < 1:
            raise ValueError(f"early results go in batches of 1 or more packets, not {batch}")
        self.agg = agg
        self.batch = batch
        # `early_codec`: at once where it does not depend on the senders'
        # weights, else once every sender's is known (a packet of each in:
        # none is whole before); None: nothing goes early
        self._decided = int(agg.layout.codec) not in NARROW
        self.codec = early_codec(agg) if self._decided else None
        self.sent = np.zeros(agg.n_packets, dtype=bool)  # per data packet of the shard
        self._seen = 0  # the aggregator's packet count at the last look
        self._ready = 0  # packets whole and not sent at the last look
        # per result packet of the shard, whether it went (set by the sender)
        self.results: np.ndarray | None = None
        # the datagrams sent, by result index, for NACKs before the shard
        # completes, and when each packet was last resent (`_Finished.resent`)
        self.datagrams: dict[int, tuple[bytes, int]] = {}  # and their classes
        self.resent: dict[tuple[int, int], np.ndarray] = {}
        # per class, the last two result packets queued early in it (-1: none)
        self._last = np.full((_CLASSES, 2), -1, dtype=np.int64)

    def take(self) -> np.ndarray | None:
        """The shard's data packets newly whole (every sender's copy in), their
        sums made final: at least `batch` of them (a mask), or None. Cheap
        while fewer than `batch` packets came since the last look."""
        agg = self.agg
        if agg.result is not None or agg.acc.out is None:
            return None
        n = agg.n_received
        if n - self._seen + self._ready < self.batch:
            return None
        self._seen = n
        whole = agg.received.all(axis=0)
        whole &= ~self.sent
        self._ready = int(np.count_nonzero(whole))
        if self._ready < self.batch:
            return None
        agg.acc.sum_packets(whole)
        self.sent |= whole
        self._ready = 0
        return whole

    def send(self, emitter: Emitter, spec: JobSpec, op: OpKey) -> None:
        """The results of the packets newly whole (`take`), if enough, to the
        job's other contributors."""
        nodes = [n for n in spec.contributors if n != spec.me]
        if not self._decided:
            if not nodes or not self.agg.received.any(axis=1).all():
                return
            self.codec, self._decided = early_codec(self.agg), True
        whole = self.take() if nodes and self.codec is not None else None
        if whole is None:
            return
        pick, dgs, classes = emitter.early_results(spec, op, self, whole, nodes)
        self.results = pick if self.results is None else self.results | pick
        self.datagrams.update(
            zip(np.flatnonzero(pick).tolist(), zip(dgs, classes, strict=True), strict=True)
        )

    def chain(self, idx: np.ndarray, classes: np.ndarray, n_results: int) -> np.ndarray:
        """The `aux` of result packets `idx` (result indices, queued in this
        order) sent early in `classes`: in each class, the two queued before
        each one, earlier batches' included (all 0 when the shard's result
        indices do not fit 16 bits)."""
        aux = np.zeros(idx.size, dtype=np.int64)
        for c in np.unique(classes).tolist():
            at = np.flatnonzero(classes == c)
            run = np.concatenate((self._last[c][::-1], idx[at]))  # [2nd last, last, *these]
            self._last[c] = run[-1], run[-2]
            aux[at] = (run[1:-1] + 1) | ((run[:-2] + 1) << 16)
        return aux if n_results < _NONE else np.zeros_like(aux)

    def contributors(self, local: np.ndarray) -> np.ndarray:
        """Per data packet `local` (each whole): the contributions summed."""
        return np.full(local.size, int(self.agg.weight.sum()), dtype=np.int64)

    def block_max(self, local: np.ndarray) -> np.ndarray:
        """Per data packet `local`: the max of its senders' block maxima."""
        return self.agg.block_max[:, local].max(axis=0)
