"""SACK for the TCP model: the receiver's out-of-order blocks and the sender's
scoreboard with RACK's loss detection (RFC 8985).

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

__all__ = ["MSS", "Reassembly", "Scoreboard"]

MSS = 1448  # payload of a 1514-byte frame with timestamps


class Reassembly:
    """The receiver: `nxt`, the next byte due in order, and the blocks held
    beyond it (sorted, disjoint, not touching)."""

    __slots__ = ("ends", "nxt", "starts")

    def __init__(self) -> None:
        self.nxt = 0
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, seq: int, end: int) -> tuple[int, int]:
        """Take bytes [seq, end); the SACK block that now holds them (RFC
        2018's first block), or (-1, -1) when they came in order or were old."""
        starts, ends = self.starts, self.ends
        if end <= self.nxt:
            return -1, -1
        if seq <= self.nxt:
            self.nxt = end
            while starts and starts[0] <= self.nxt:  # what was held now joins on
                if ends[0] > self.nxt:
                    self.nxt = ends[0]
                del starts[0], ends[0]
            return -1, -1
        i = bisect_left(starts, seq)
        lo = i - 1 if i > 0 and ends[i - 1] >= seq else i
        hi = i
        while hi < len(starts) and starts[hi] <= end:
            hi += 1
        if lo == hi:
            starts.insert(lo, seq)
            ends.insert(lo, end)
            return seq, end
        a, b = min(seq, starts[lo]), max(end, ends[hi - 1])
        starts[lo:hi], ends[lo:hi] = [a], [b]
        return a, b


class Scoreboard:
    """The sender's outstanding cells from `una_k` on, and RACK's state."""

    __slots__ = (
        "flight", "lost", "lost_heap", "marked", "min_rtt", "rack_k", "rack_rtt",
        "rack_ts", "sacked", "una_k",
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

    def sack(self, k0: int, a: int, b: int, written: int) -> int:
        """The block [a, b) of bytes is held and the arrival that made it was in
        cell `k0`: mark the block's whole cells from `k0` outward, stopping at
        one already SACKed (those beyond were marked by earlier ACKs); how many
        were newly SACKed."""
        n = 0
        for k, step in ((k0, -1), (k0 + 1, 1)):
            while k >= self.una_k and a <= k * MSS < b and min(k * MSS + MSS, written) <= b:
                if k in self.sacked:
                    break
                self.sacked.add(k)
                self.flight.pop(k, None)
                self.lost.discard(k)
                n += 1
                k += step
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
