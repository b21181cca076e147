"""Where a shard's lanes go until the shard is summed, and the summing.

`ShardAccumulator` owns a shard aggregator's per-sender rows (`slots`), the
rows it holds by reference instead (this node's own lanes), where the sums
go (`out`, the result collector's range of the shard, when set), and the
choice, made once, to sum one sender's packets with this node's lanes as
they arrive. It reads the aggregator's arrival record (`received`, the
packets' lane counts), which it is handed once, at construction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dlcp.codecs import lanes as lane_ops
from dlcp.core.buffers import SpareBuffers
from dlcp.errors import LocalError

__all__ = ["ShardAccumulator", "lane_spans"]


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


def lane_spans(packets: np.ndarray, counts: np.ndarray) -> list[tuple[int, int]]:
    """The lane ranges (shard-relative) of the runs of packets set in
    `packets`, whose lane counts are `counts`."""
    idx = np.flatnonzero(packets)
    if idx.size == 0:
        return []
    starts = np.concatenate(([0], np.cumsum(counts)))
    cut = np.flatnonzero(np.diff(idx) != 1) + 1
    firsts = idx[np.concatenate(([0], cut))]
    lasts = idx[np.concatenate((cut - 1, [idx.size - 1]))]
    return list(zip(starts[firsts].tolist(), starts[lasts + 1].tolist(), strict=True))


class ShardAccumulator:
    """The lanes of one shard's senders, and their sum."""

    def __init__(
        self,
        *,
        shard: int,
        codec: int,
        lanes: int,
        received: np.ndarray,
        counts: np.ndarray,
    ) -> None:
        self.shard = shard
        self.codec = codec
        # Not zeroed: every packet stored overwrites its lanes, and `finish`
        # zeroes the lanes of the packets that never came. Zeroing up front cost
        # a pass over every row, this node's own too (held by reference, never
        # written here): 4-7 % of the core's time for 100 MB fp32 rounds.
        self.slots = _uninitialised((received.shape[0], lanes), lane_ops.sum_dtype(codec))
        self.received = received  # the aggregator's (read only here)
        self.counts = counts
        self.senders = received.shape[0]
        # rows held by reference instead of in `slots` (this node's own lanes)
        self.held: dict[int, np.ndarray] = {}
        # where `finish` puts the sums, when set (`sum_into`): the collector's
        # range of this shard, so that the sums are not copied there again
        self.out: np.ndarray | None = None
        # the sender whose packets are summed with this node's held lanes into
        # `out` as they arrive (`summing_row`); None: stored in `slots`
        self.summed_row: int | None = None
        self.summed_own: np.ndarray | None = None  # this node's held lanes they are added to
        self._decided = False

    def hold(self, row: int, summed: bool, payload: memoryview | bytes) -> None:
        """Sender row `row`'s whole shard, its wire lanes (`payload`, as
        `lanes.unpack` reads them): kept by reference when already in the
        sums' dtype (the caller leaves it alone until the shard completes),
        else stored in `slots` as one run (`lanes.store_runs`: one C pass
        where the extension has the codec's cast, as fp16's, which numpy's
        assignment made 4-9 ms of a daemon's start of a 5 MB fp16 round, with
        nothing sent meanwhile)."""
        values = lane_ops.unpack(self.codec, payload, self.slots.shape[1], summed)
        if values.dtype == self.slots.dtype:
            self.held[row] = values
        else:
            one = np.zeros(1, np.int64), np.array([values.size], np.int64)
            lane_ops.store_runs(self.slots[row], self.codec, summed, *one, [payload])

    def store(
        self,
        row: int,
        summed: bool,
        starts: np.ndarray,
        counts: np.ndarray,
        payloads: Sequence[memoryview | bytes],
    ) -> None:
        """Packets' lanes (`starts` relative to the shard) summed into `out` or
        stored in `row` of `slots` (`summing_row`)."""
        if self.summing_row(row, summed):
            assert self.out is not None and self.summed_own is not None
            lane_ops.add_runs(
                self.out, self.summed_own, self.codec, summed, starts, counts, payloads
            )
        else:
            lane_ops.store_runs(self.slots[row], self.codec, summed, starts, counts, payloads)

    def summing_row(self, row: int, summed: bool) -> bool:
        """Whether `row`'s packets are summed into `out` as they arrive.

        Decided once, at the first packet of another sender: yes when the shard
        has two senders, this node's lanes are held (`hold`), the sums go to
        `out` (`sum_into`) and the wire lanes are float32 like the sums. Then
        `out` = own + packet is written per packet (one pass over the shard, no
        copy of the packet into `slots` and no second pass in `finish`), and
        `finish` only copies this node's lanes where packets never came. The
        sums are those `finish` computes otherwise (a + b == b + a in IEEE
        arithmetic), except which NaN's payload a NaN sum carries.
        """
        if not self._decided:
            if self.senders == 2 and not self.held:
                return False  # this node's lanes are not in yet: decided when they are
            self._decided = True
            if (
                self.senders == 2
                and len(self.held) == 1
                and row not in self.held
                and self.out is not None
                and lane_ops.can_add_runs(self.out, self.codec, summed)
            ):
                self.summed_row = row
                own = self.summed_own = next(iter(self.held.values()))
                # what came before this node's lanes, stored in `slots`: summed now
                for a, b in lane_spans(self.received[row], self.counts):
                    np.add(own[a:b], self.slots[row, a:b], out=self.out[a:b])
        if self.summed_row is None:
            return False
        if row != self.summed_row:  # cannot happen with two senders, one of them held
            raise LocalError(
                f"shard {self.shard}: packets of row {row} while summing row {self.summed_row}"
            )
        return True

    def sum_into(self, out: np.ndarray) -> None:
        """Put the sums, when the shard completes, in `out` (this shard's lanes in
        the accumulator dtype, e.g. the result collector's range of the shard)
        instead of a new array; the result's sums are then `out`."""
        if out.shape != self.slots.shape[1:] or out.dtype != self.slots.dtype:
            raise LocalError(
                f"sums of shard {self.shard} need {self.slots.shape[1]} lanes of "
                f"{self.slots.dtype}, not {out.shape} of {out.dtype}"
            )
        self.out = out

    def sum_packets(self, packets: np.ndarray) -> None:
        """The sums of packets `packets` (a mask), every sender's copy of which
        is in, into `out` before the shard completes (`dlcp.core.early`): the
        lanes `finish` gives them, in the same order of additions, so that
        `finish` writing them again changes no bit."""
        out = self.out
        if out is None:
            raise LocalError(f"shard {self.shard}: no sums array to sum packets into")
        if not self.received[:, packets].all():
            raise LocalError(f"shard {self.shard}: packets summed before every copy came")
        if self.summed_row is not None:
            return  # summed into `out` as they came
        sdt = self.slots.dtype
        rows = [self.held.get(r, self.slots[r]) for r in range(self.senders)]
        for a, b in lane_spans(packets, self.counts):
            if len(rows) == 1:
                np.copyto(out[a:b], rows[0][a:b], casting="unsafe")
                continue
            np.add(rows[0][a:b], rows[1][a:b], out=out[a:b], dtype=sdt)
            for r in rows[2:]:
                np.add(out[a:b], r[a:b], out=out[a:b])

    def finish(self) -> np.ndarray:
        """The senders' rows summed (missing packets as zeros), into `out` if
        set; the rows are freed."""
        sdt = self.slots.dtype
        out = self.out
        if self.summed_row is not None:  # summed on arrival: own lanes where none came
            assert out is not None and self.summed_own is not None
            own = self.summed_own
            for a, b in lane_spans(~self.received[self.summed_row], self.counts):
                out[a:b] = own[a:b]
            sums = out
            self.held = {}
            self.summed_own = None
        else:
            sums = self._sum_rows(out, sdt)
        self.slots = np.zeros((0, 0), dtype=sdt)  # free the per-sender copies
        return sums

    def _zero_missing(self) -> None:
        """Zero the lanes, in `slots`, of every packet a sender's row lacks."""
        for r in range(self.senders):
            if r in self.held or r == self.summed_row:
                continue
            row = self.slots[r]
            for a, b in lane_spans(~self.received[r], self.counts):  # a slice a run
                row[a:b] = 0

    def _sum_rows(self, out: np.ndarray | None, sdt: np.dtype) -> np.ndarray:
        """Row by row, in sender order (what np.add.reduce(axis=0) computes on
        the rows; a part of them, `sum_packets`, gets the same bits)."""
        self._zero_missing()
        if not self.senders:
            return self.slots[0] if out is None else out
        rows = [self.held.get(r, self.slots[r]) for r in range(self.senders)]
        if len(rows) == 1:
            sums = rows[0].astype(sdt, copy=True) if out is None else out
            if out is not None:
                np.copyto(out, rows[0], casting="unsafe")
        else:  # the first two in one pass, then the others
            sums = np.add(rows[0], rows[1], out=out, dtype=sdt)
        for r in rows[2:]:
            np.add(sums, r, out=sums)
        self.held = {}
        return sums
