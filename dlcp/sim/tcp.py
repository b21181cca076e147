"""A TCP model for the ring baseline: one reliable byte stream a flow, as much
of Linux's TCP as decides an all-reduce's tail.

Kept: CUBIC with HyStart from 10 segments (dlcp/sim/tcp_cubic.py); a SACK
scoreboard (dlcp/sim/tcp_sack.py): every arrival is ACKed at once, and the
ACK carries up to 3 SACK blocks as Linux's with timestamps (RFC 2018: the
block holding the segment that made it first, then the most recently
reported others; an in-order arrival's ACK repeats those still held; a
duplicate's, 2, its D-SACK taking a slot), so what a lost ACK said comes
again in the next; the sender keeps every segment's state, sends while the
pipe (the segments in flight, RFC 6675's) is under the window,
retransmissions of the lost first, lowest first; RACK loss detection (RFC
8985: a segment sent before one delivered is lost once that one's round trip
plus a reorder window has passed since it was sent, a quarter of the least
RTT, none in recovery or from 3 SACKed segments on, with its timer), so a
lost retransmission goes again before the RTO; fast recovery with PRR (RFC
6937 with its slow-start reduction bound, in Linux's integers), one window
cut an episode; a tail-loss probe (TLP: out of recovery, with data out and
no ACK for max(2 SRTT, 10 ms) a new segment or the last one goes, so a lost
tail is found by SACK and RACK rather than the RTO); the retransmission
timer from smoothed RTT and its variance as Linux's (SRTT + max(4 RTTVAR,
200 ms)), restarted by each ACK of new data and by the head's
retransmission, exponential backoff, every segment in flight marked lost
after a timeout (the SACKed kept) and slow start again; an RTT sample from
every ACK of new data (timestamps); congestion window growth only while the
window limits the flow. Left out: D-SACK's use (the block is not sent: it
only undoes spurious cuts and widens RACK's reorder window, neither
modelled), undoing spurious cuts (F-RTO, Eifel), the window's restart after
idle, delayed ACKs, receive-window limits (the receiver's buffer never
fills), pacing, ECN/DCTCP, the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from dlcp.sim.events import Timer
from dlcp.sim.port import Packet
from dlcp.sim.tcp_cubic import Cubic
from dlcp.sim.tcp_sack import MSS, Reassembly, Scoreboard

if TYPE_CHECKING:
    from dlcp.sim.fabric import Fabric

__all__ = ["MIN_RTO", "MSS", "TcpFlow"]

HEADERS = 66  # Ethernet 14, IP 20, TCP 20 + 12 of timestamps
SACK_OPTION = 4  # and on an ACK with SACK blocks, 8 bytes each (two NOPs, kind, length)
MIN_RTO = 0.2
TLP_MIN = 0.01
INIT_RTO = 1.0
DUPTHRESH = 3
OPEN, RECOVERY, LOSS = 0, 1, 2  # Linux's CA states that matter here


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
        self.cc = Cubic()
        self.sb = Scoreboard()
        self.state = OPEN
        self.recover = 0  # in recovery or loss until this is acknowledged
        self.prior_cwnd = 0.0  # PRR's
        self.prr_delivered = 0
        self.prr_out = 0
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.rto = INIT_RTO
        self.rto_at: float | None = None
        # one heap event each however often they are re-armed (an ACK re-arms them)
        self._rto_timer = Timer(self.loop, self._on_rto)
        self._tlp_timer = Timer(self.loop, self._on_probe)
        self._reo_timer = Timer(self.loop, self._on_reorder)
        self.retransmits = 0
        self.probes = 0
        self.timeouts = 0
        self.fast_retransmits = 0  # recoveries entered
        # receiver
        self.rcv = Reassembly()

    @property
    def cwnd(self) -> float:
        """The congestion window, in segments."""
        return self.cc.cwnd

    @property
    def rcv_nxt(self) -> int:
        return self.rcv.nxt

    # -- sender ---------------------------------------------------------------
    def write(self, n: int) -> None:
        self.written += n
        self._transmit()

    def _send(self, k: int, seq: int) -> None:
        """Cell `k` from byte `seq` to its end (or what is written) goes out."""
        end = min(k * MSS + MSS, self.written)
        now = self.loop.now
        self.fabric.send(
            self.src, self.dst, self.cls, end - seq + HEADERS, (self, 0, seq, end, now),
            self.spine,
        )  # fmt: skip
        self.sb.sent(k, now)
        if end > self.nxt:
            self.nxt = end
        if self.state == RECOVERY:
            self.prr_out += 1

    def _transmit(self) -> None:
        """Send while the pipe is under the window: the lost first, then new bytes."""
        sb = self.sb
        while sb.pipe < int(self.cc.cwnd):
            k = sb.next_lost()
            if k is not None:
                self._send(k, max(k * MSS, self.una))
                self.retransmits += 1
                if k == sb.una_k:  # the head went again: the RTO from now (Linux's)
                    self._arm()
            elif self.nxt < self.written:
                self._send(self.nxt // MSS, self.nxt)
            else:
                break
        if self.nxt > self.una and self.rto_at is None:
            self._arm()

    def _arm(self) -> None:
        """The RTO from now, and in the open state the tail-loss probe's timer
        before it (none when the probe would not come first)."""
        now = self.loop.now
        self.rto_at = now + self.rto
        self._rto_timer.set(self.rto_at)
        pto = max(2 * self.srtt, TLP_MIN) if self.srtt is not None else INIT_RTO
        if self.state == OPEN and pto < self.rto:
            self._tlp_timer.set(now + pto)
        else:
            self._tlp_timer.cancel()

    def _disarm(self) -> None:
        self.rto_at = None
        self._rto_timer.cancel()
        self._tlp_timer.cancel()

    def _on_probe(self) -> None:
        """Tail-loss probe: a new segment if one is written, else the last again."""
        if self.una >= self.nxt or self.state != OPEN:
            return
        if self.nxt < self.written:
            self._send(self.nxt // MSS, self.nxt)
        else:
            k = (self.nxt - 1) // MSS
            self._send(k, max(k * MSS, self.una))
            self.retransmits += 1
        self.probes += 1

    def _reo_window(self) -> float:
        sb = self.sb
        if self.state != OPEN or len(sb.sacked) >= DUPTHRESH or self.srtt is None:
            return 0.0
        return min(sb.min_rtt / 4, self.srtt)

    def _detect(self) -> None:
        """RACK over the scoreboard; the reorder timer for what is not yet due."""
        due = self.sb.detect(self.loop.now, self._reo_window())
        if due is None:
            self._reo_timer.cancel()
        else:
            self._reo_timer.set(due)

    def _enter_recovery(self) -> None:
        self.state = RECOVERY
        self.recover = self.nxt
        self.prior_cwnd = self.cc.cwnd
        self.prr_delivered = self.prr_out = 0
        self.cc.on_loss()
        self.fast_retransmits += 1
        self._tlp_timer.cancel()

    def _prr(self, delivered: int) -> None:
        """PRR (RFC 6937, in Linux's integers): the window in recovery from what
        was delivered; under ssthresh, the slow-start reduction bound, one
        segment more than was delivered (Linux grants that one only on an ACK
        that advances una and marks nothing newly lost)."""
        if delivered <= 0:
            return
        self.prr_delivered += delivered
        pipe = self.sb.pipe
        ssthresh = int(self.cc.ssthresh)
        delta = ssthresh - pipe
        if delta < 0:
            prior = max(int(self.prior_cwnd), 1)
            sndcnt = (ssthresh * self.prr_delivered + prior - 1) // prior - self.prr_out
        else:
            sndcnt = min(delta, max(self.prr_delivered - self.prr_out, delivered) + 1)
        sndcnt = max(sndcnt, 0 if self.prr_out else 1)
        self.cc.cwnd = float(pipe + sndcnt)

    def _on_ack(self, ack: int, ts: float, seq: int, blocks: tuple[tuple[int, int], ...]) -> None:
        now = self.loop.now
        sb, cc = self.sb, self.cc
        advanced = ack > self.una
        rtt: float | None = None
        delivered = 0
        if advanced:
            rtt = now - ts
            if self.srtt is None:
                self.srtt, self.rttvar = rtt, rtt / 2
            else:
                self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
                self.srtt = 0.875 * self.srtt + 0.125 * rtt
            self.rto = self.srtt + max(4 * self.rttvar, MIN_RTO)
            sb.min_rtt = min(sb.min_rtt, rtt)
            delivered += sb.ack_to(ack // MSS, ack >= self.nxt)
            self.una = ack
        if blocks:
            delivered += sb.sack(blocks, self.written)
        if delivered or advanced:
            sb.delivered(seq // MSS, ts, now)
        self._detect()
        if self.state != OPEN and self.una >= self.recover:
            if self.state == RECOVERY:
                cc.cwnd = cc.ssthresh
            self.state = OPEN
        if self.state == OPEN and sb.lost:
            self._enter_recovery()
        if self.state == RECOVERY:
            self._prr(delivered)
        elif self.nxt < self.written or sb.pipe >= int(cc.cwnd) - 1:  # the window limits
            cc.on_ack(delivered, rtt, now, self.una, self.nxt)
        if advanced:
            self._disarm()
            if self.nxt > self.una:
                self._arm()
        self._transmit()

    def _on_reorder(self) -> None:
        """The reorder window of a cell sent before RACK's latest ran out."""
        self._detect()
        if self.sb.lost:
            if self.state == OPEN:
                self._enter_recovery()
                self._prr(1)
            self._transmit()

    def _on_rto(self) -> None:
        self._tlp_timer.cancel()
        if self.una >= self.nxt:
            self.rto_at = None
            return
        self.timeouts += 1
        self.cc.on_timeout(self.state == OPEN)
        self.state = LOSS
        self.recover = self.nxt
        self.sb.lose_all()
        self._reo_timer.cancel()
        self.rto = min(2 * self.rto, 60.0)
        self._disarm()
        self._transmit()
        self._arm()

    # -- receiver -------------------------------------------------------------
    def _on_segment(self, seq: int, end: int, ts: float) -> None:
        rcv = self.rcv
        before = rcv.nxt
        rcv.add(seq, end)
        blocks = rcv.blocks()  # every arrival is ACKed at once, in order or not
        self.fabric.send(
            self.dst, self.src, self.cls, HEADERS + SACK_OPTION * bool(blocks) + 8 * len(blocks),
            (self, 1, rcv.nxt, ts, seq, blocks), self.spine,
        )  # fmt: skip
        if rcv.nxt > before:
            self.on_data(rcv.nxt - before)


def deliver(pkt: Packet) -> None:
    """A TCP packet reached its node: to its flow's sender or receiver."""
    d = pkt.data
    if d[1] == 0:
        d[0]._on_segment(d[2], d[3], d[4])
    else:
        d[0]._on_ack(d[2], d[3], d[4], d[5])
