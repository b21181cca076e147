"""SACK for the TCP model: the receiver's out-of-order blocks and the SACK
blocks its ACKs carry (RFC 2018, up to 3 as Linux's with timestamps), and the
sender's scoreboard with RACK's loss detection (RFC 8985).

The sender counts in cells: `MSS` bytes on the sequence grid (a write that
ends inside a cell sends it in two pieces, both the same cell). A cell is
in flight, SACKed, or marked lost and waiting to go again; the pipe (RFC
6675) is the cells in flight, retransmissions included. RACK: a cell sent
before the most recently sent cell known delivered, longer ago than that
cell's round trip plus a reorder window, is lost; a retransmission is a new
send, so a lost retransmission is found the same way.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import OrderedDict

__all__ = ["ACK_SACKS", "MSS", "Reassembly", "Scoreboard"]

MSS = 1448  # payload of a 1514-byte frame with timestamps
NUM_SACKS = 4  # blocks the receiver remembers (Linux's TCP_NUM_SACKS)
ACK_SACKS = 3  # blocks an ACK carries: the option space that timestamps leave


class Reassembly:
    """The receiver: `nxt`, the next byte due in order, the blocks held beyond
    it (sorted, disjoint, not touching), and the SACK blocks to report (RFC
    2018, as Linux keeps them: up to `NUM_SACKS`, the most recently changed
    first)."""

    __slots__ = ("dup", "ends", "nxt", "recent", "starts")

    def __init__(self) -> None:
        self.nxt = 0
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.recent: list[tuple[int, int]] = []  # held blocks, the latest first
        self.dup = False  # the last arrival held nothing new (a D-SACK goes)

    def add(self, seq: int, end: int) -> None:
        """Take bytes [seq, end): the block that now holds them goes to the
        front of `recent`, and blocks now in order leave it."""
        starts, ends = self.starts, self.ends
        self.dup = end <= self.nxt
        if self.dup:
            return
        if seq <= self.nxt:
            self.nxt = end
            while starts and starts[0] <= self.nxt:  # what was held now joins on
                if ends[0] > self.nxt:
                    self.nxt = ends[0]
                del starts[0], ends[0]
            if self.recent:
                self.recent = [r for r in self.recent if r[0] > self.nxt]
            return
        i = bisect_left(starts, seq)
        lo = i - 1 if i > 0 and ends[i - 1] >= seq else i
        hi = i
        while hi < len(starts) and starts[hi] <= end:
            hi += 1
        if lo == hi:
            starts.insert(lo, seq)
            ends.insert(lo, end)
            a, b = seq, end
        else:
            a, b = min(seq, starts[lo]), max(end, ends[hi - 1])
            self.dup = a == starts[lo] and b == ends[lo] and hi - lo == 1
            starts[lo:hi], ends[lo:hi] = [a], [b]
        recent = [r for r in self.recent if not a <= r[0] < b]
        recent.insert(0, (a, b))
        del recent[NUM_SACKS:]
        self.recent = recent

    def blocks(self) -> tuple[tuple[int, int], ...]:
        """The SACK blocks of the ACK of the last arrival: the first holds it
        (when held out of order), then the most recently reported others; a
        duplicate's ACK gives the first of its `ACK_SACKS` slots to a D-SACK
        block, which the sender does not use and so is not sent."""
        return tuple(self.recent[: ACK_SACKS - 1 if self.dup else ACK_SACKS])


class Scoreboard:
    """The sender's outstanding cells from `una_k` on, and RACK's state."""

    __slots__ = (
        "cache", "flight", "lost", "lost_heap", "marked", "min_rtt", "rack_k",
        "rack_rtt", "rack_ts", "sacked", "una_k",
    )  # fmt: skip

    def __init__(self) -> None:
        self.una_k = 0  # cells below it are acknowledged
        self.flight: OrderedDict[int, float] = OrderedDict()  # cell -> last send, send order
        self.sacked: set[int] = set()
        self.lost: set[int] = set()  # marked lost, not sent again yet
        self.lost_heap: list[int] = []  # the same, lowest first (may hold stale cells)
        self.rack_ts = -1.0  # send time of the most recently sent cell delivered ...
        self.rack_k = -1  # ... that cell ...
        self.rack_rtt = 0.0  # ... and its round trip
        self.min_rtt = float("inf")
        self.marked = 0  # cells RACK marked lost
        self.cache: list[tuple[int, int]] = []  # cells whole in the last ACK's blocks

    @property
    def pipe(self) -> int:
        return len(self.flight)

    def sent(self, k: int, now: float) -> None:
        """Cell `k` (or a piece of it) went out now."""
        flight = self.flight
        if k in flight:
            flight.move_to_end(k)
        flight[k] = now
        self.lost.discard(k)
        self.sacked.discard(k)  # new bytes in a cell SACKed in part: not held whole

    def next_lost(self) -> int | None:
        """The lowest cell marked lost and not sent since (taken off the list)."""
        heap, lost = self.lost_heap, self.lost
        while heap:
            k = heapq.heappop(heap)
            if k in lost:
                lost.remove(k)
                return k
        return None

    def ack_to(self, una_k: int, everything: bool) -> int:
        """The cumulative ACK passed every cell below `una_k` (`everything`:
        all that was sent, a cell sent in part included): how many of them
        were not SACKed (newly delivered)."""
        n = 0
        flight, sacked, lost = self.flight, self.sacked, self.lost
        for k in range(self.una_k, una_k):
            if k in sacked:
                sacked.remove(k)
            else:
                n += 1
                flight.pop(k, None)
                lost.discard(k)
        if una_k > self.una_k:
            self.una_k = una_k
        if everything and flight:
            n += len(flight)
            flight.clear()
        if everything:
            sacked.clear()
            lost.clear()
        return n

    def sack(self, blocks: tuple[tuple[int, int], ...], written: int) -> int:
        """An ACK's SACK blocks (bytes): mark their cells held, a cell sent in
        part when its written bytes are; how many were newly SACKed. Cells
        whole in the last ACK's blocks are skipped (Linux's SACK cache: a
        receiver's blocks only grow), so an ACK costs what it tells anew."""
        n = 0
        cache: list[tuple[int, int]] = []
        old = sorted(self.cache)
        for a, b in blocks:
            lo, full = max(-(-a // MSS), self.una_k), b // MSS
            k = lo
            for clo, chi in old:
                if chi > k and clo < full:
                    n += self._mark(k, min(clo, full))
                    k = max(k, chi)
            n += self._mark(k, full)
            if full * MSS < written <= b and full >= lo:  # the partial last cell
                n += self._mark(full, full + 1)
            if full > lo:
                cache.append((lo, full))
        self.cache = cache
        return n

    def _mark(self, lo: int, hi: int) -> int:
        n = 0
        sacked, flight, lost = self.sacked, self.flight, self.lost
        for k in range(lo, hi):
            if k not in sacked:
                sacked.add(k)
                flight.pop(k, None)
                lost.discard(k)
                n += 1
        return n

    def delivered(self, k: int, ts: float, now: float) -> None:
        """Cell `k`, sent at `ts`, was delivered (RACK's latest, if it was sent later)."""
        if ts > self.rack_ts or (ts == self.rack_ts and k > self.rack_k):
            self.rack_ts, self.rack_k, self.rack_rtt = ts, k, now - ts

    def detect(self, now: float, reo: float) -> float | None:
        """RACK: mark lost each cell in flight sent before RACK's latest and
        more than its round trip plus `reo` ago; when the next such cell will
        be due (None: none waits)."""
        flight = self.flight
        while flight:
            k, t = next(iter(flight.items()))
            if t > self.rack_ts or (t == self.rack_ts and k >= self.rack_k):
                return None
            due = t + self.rack_rtt + reo
            if due > now:
                return due
            del flight[k]
            self._lose(k)
        return None

    def lose_all(self) -> None:
        """The retransmission timer: every cell in flight is lost."""
        for k in self.flight:
            self.lost.add(k)
            heapq.heappush(self.lost_heap, k)
        self.flight.clear()

    def _lose(self, k: int) -> None:
        self.lost.add(k)
        heapq.heappush(self.lost_heap, k)
        self.marked += 1
