"""A TCP model for the ring baseline: one reliable byte stream a flow, as much
of Linux's TCP as decides an all-reduce's tail.

Kept: slow start from 10 segments and congestion avoidance (Reno growth);
fast retransmit on three duplicate ACKs and fast recovery with SACK in
brief (each ACK reports the segment that arrived out of order, the first
SACK block; the sender keeps them and in recovery retransmits the holes
below the highest one, two an ACK, and passes over them again a round trip
later, so a lost retransmission goes again: RACK's rule in brief); a
tail-loss probe (Linux's TLP: with data out and no ACK for max(2 SRTT,
10 ms) the last segment goes again, so a lost tail is found by SACK rather
than the RTO); the retransmission timer from smoothed RTT and its variance
(RFC 6298) with Linux's 200 ms minimum, exponential backoff and go-back-N
after a timeout; an RTT sample from every ACK (timestamps). Left out:
RACK's timers, SACK's pipe accounting, delayed ACKs, receive-window limits
(the receiver's buffer never fills), pacing, ECN/DCTCP, CUBIC's growth
(Reno's), the CPU.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING

from dlcp.sim.events import Timer
from dlcp.sim.port import Packet

if TYPE_CHECKING:
    from dlcp.sim.fabric import Fabric

__all__ = ["MIN_RTO", "MSS", "TcpFlow"]

MSS = 1448  # payload of a 1514-byte frame with timestamps
HEADERS = 66  # Ethernet 14, IP 20, TCP 20 + 12 of timestamps
INIT_CWND = 10
MIN_RTO = 0.2
TLP_MIN = 0.01
INIT_RTO = 1.0


class TcpFlow:
    """Bytes written at `src` come out in order at `dst` (`on_data(n)`).
    Segments and ACKs cross `fabric` in class `cls` on spine `spine`."""

    def __init__(
        self, fabric: Fabric, src: int, dst: int, *, cls: int, spine: int,
        on_data: Callable[[int], None],
    ) -> None:  # fmt: skip
        self.fabric, self.loop = fabric, fabric.loop
        self.src, self.dst, self.cls, self.spine = src, dst, cls, spine
        self.on_data = on_data
        # sender
        self.written = 0
        self.una = 0
        self.nxt = 0
        self.cwnd = float(INIT_CWND * MSS)
        self.ssthresh = float("inf")
        self.dupacks = 0
        self.recover: int | None = None  # NewReno: in recovery until this is acked
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.rto = INIT_RTO
        self.rto_at: float | None = None
        # one heap event each however often they are re-armed (an ACK re-arms both)
        self._rto_timer = Timer(self.loop, self._on_rto)
        self._tlp_timer = Timer(self.loop, self._on_probe)
        self.sacked: set[int] = set()  # segments (seq // MSS) reported held beyond una
        self.high_sack = -1
        self.rtx_k = 0  # the next hole to retransmit in recovery
        self.pass_at = 0.0  # when the pass over the holes began
        self.retransmits = 0
        self.probes = 0
        self.timeouts = 0
        self.fast_retransmits = 0
        # receiver
        self.rcv_nxt = 0
        self.ooo: dict[int, int] = {}  # start -> end of held out-of-order segments
        self.ooo_heap: list[int] = []

    # -- sender ---------------------------------------------------------------
    def write(self, n: int) -> None:
        self.written += n
        self._send_new()

    def _segment(self, seq: int) -> None:
        end = min(seq - seq % MSS + MSS, self.written)  # on the MSS grid
        self.fabric.send(
            self.src, self.dst, self.cls, end - seq + HEADERS,
            (self, 0, seq, end, self.loop.now), self.spine,
        )  # fmt: skip

    def _send_new(self) -> None:
        while self.nxt < self.written and self.nxt - self.una < self.cwnd:
            self._segment(self.nxt)
            self.nxt = min(self.nxt - self.nxt % MSS + MSS, self.written)
        if self.nxt > self.una and self.rto_at is None:
            self._arm()

    def _arm(self) -> None:
        """The RTO from now, and the tail-loss probe's timer before it (none
        when the probe would not come first)."""
        now = self.loop.now
        self.rto_at = now + self.rto
        self._rto_timer.set(self.rto_at)
        pto = max(2 * self.srtt, TLP_MIN) if self.srtt is not None else INIT_RTO
        if pto < self.rto:
            self._tlp_timer.set(now + pto)
        else:
            self._tlp_timer.cancel()

    def _disarm(self) -> None:
        self.rto_at = None
        self._rto_timer.cancel()
        self._tlp_timer.cancel()

    def _on_probe(self) -> None:
        """Tail-loss probe: the last segment sent goes again."""
        if self.una >= self.nxt or self.recover is not None:
            return
        last = self.nxt - 1
        self._segment(last - last % MSS if last - last % MSS >= self.una else self.una)
        self.retransmits += 1
        self.probes += 1

    def _holes(self, n: int) -> None:
        """Retransmit up to `n` segments below the highest SACKed one that were
        not reported held. A pass over the holes that has reached the highest
        SACK starts again from `una` once a round trip has passed since it
        began (a retransmission still missing then was lost too: RACK's rule,
        in brief)."""
        now = self.loop.now
        k = max(self.rtx_k, self.una // MSS)
        if k >= self.high_sack and self.srtt is not None and now - self.pass_at > 1.25 * self.srtt:
            k, self.pass_at = self.una // MSS, now
        while n and k < self.high_sack:
            if k not in self.sacked and k * MSS < self.nxt:
                self._segment(max(k * MSS, self.una))
                self.retransmits += 1
                n -= 1
            k += 1
        self.rtx_k = k

    def _on_ack(self, ack: int, ts: float, sack: int) -> None:
        now = self.loop.now
        if sack >= 0:
            self.sacked.add(sack)
            if sack > self.high_sack:
                self.high_sack = sack
        if ack > self.una:
            rtt = now - ts
            if self.srtt is None:
                self.srtt, self.rttvar = rtt, rtt / 2
            else:
                self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
                self.srtt = 0.875 * self.srtt + 0.125 * rtt
            self.rto = max(MIN_RTO, self.srtt + 4 * self.rttvar)
            acked = ack - self.una
            self.una = ack
            if self.sacked:
                self.sacked = {k for k in self.sacked if k * MSS >= ack}
            if self.nxt < ack:
                self.nxt = ack
            self.dupacks = 0
            if self.recover is not None:
                if ack >= self.recover:  # full ACK: recovery ends
                    self.recover = None
                    self.cwnd = self.ssthresh
                else:  # partial ACK: the next holes
                    self._holes(2)
            elif self.cwnd < self.ssthresh:
                self.cwnd += min(acked, MSS)
            else:
                self.cwnd += MSS * MSS / self.cwnd
            self._disarm()
            if self.nxt > self.una:
                self._arm()
        elif ack == self.una and self.nxt > self.una:
            self.dupacks += 1
            if self.dupacks == 3 and self.recover is None:
                flight = self.nxt - self.una
                self.ssthresh = max(flight / 2, 2.0 * MSS)
                self.cwnd = self.ssthresh + 3 * MSS
                self.recover = self.nxt
                self.rtx_k = self.una // MSS
                self.pass_at = self.loop.now
                self._segment(self.una)
                self.rtx_k += 1
                self.retransmits += 1
                self.fast_retransmits += 1
            elif self.recover is not None:
                self.cwnd += MSS  # a segment left the network: one more may go
                self._holes(2)
        self._send_new()

    def _on_rto(self) -> None:
        self._tlp_timer.cancel()
        if self.una >= self.nxt:
            self.rto_at = None
            return
        self.timeouts += 1
        self.ssthresh = max((self.nxt - self.una) / 2, 2.0 * MSS)
        self.cwnd = float(MSS)
        self.recover = None
        self.dupacks = 0
        self.nxt = self.una  # go back N
        self.sacked.clear()
        self.high_sack = -1
        self.rto = min(2 * self.rto, 60.0)
        self._disarm()
        self._segment(self.una)
        self.retransmits += 1
        self.nxt = min(self.una - self.una % MSS + MSS, self.written)
        self._arm()

    # -- receiver -------------------------------------------------------------
    def _on_segment(self, seq: int, end: int, ts: float) -> None:
        before = self.rcv_nxt
        sack = -1
        if seq <= self.rcv_nxt < end:
            self.rcv_nxt = end
            heap, ooo = self.ooo_heap, self.ooo
            while heap and heap[0] <= self.rcv_nxt:  # what was held and now joins on
                k = heapq.heappop(heap)
                self.rcv_nxt = max(self.rcv_nxt, ooo.pop(k))
        elif seq > self.rcv_nxt:
            if seq not in self.ooo:
                heapq.heappush(self.ooo_heap, seq)
            self.ooo[seq] = max(end, self.ooo.get(seq, end))
            sack = seq // MSS
        self.fabric.send(
            self.dst, self.src, self.cls, HEADERS, (self, 1, self.rcv_nxt, sack, ts), self.spine
        )
        if self.rcv_nxt > before:
            self.on_data(self.rcv_nxt - before)


def deliver(pkt: Packet) -> None:
    """A TCP packet reached its node: to its flow's sender or receiver."""
    flow, kind, a, b, ts = pkt.data
    if kind == 0:
        flow._on_segment(a, b, ts)
    else:
        flow._on_ack(a, ts, b)
