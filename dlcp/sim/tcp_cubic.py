"""CUBIC with HyStart (RFC 9438; Linux's tcp_cubic.c) for the TCP model, in
segments.

Slow start ends at the first loss or when HyStart sees the queue build: a
round's ACK train lasting past half of (the least RTT + 1 ms, Linux's cap on
its ACK delay allowance), or a round's least RTT of its first 8 ACKs past
the least RTT by an eighth of it (clamped to 4..16 ms); both from 16
segments up. Congestion avoidance follows the cubic curve (C 0.4) through
the window at the last loss, with Reno's growth as a floor (TCP
friendliness) and at most one segment for two ACKed; a loss multiplies the
window by 0.7, with fast convergence. Left out: the epoch's shift over idle
time, Linux's integer counters.
"""

from __future__ import annotations

__all__ = ["BETA", "Cubic"]

BETA = 0.7
C = 0.4
INIT_CWND = 10
HYSTART_LOW = 16
HYSTART_ACK_DELTA = 2e-3  # ACKs closer than this form a train
HYSTART_ACK_DELAY = 1e-3  # Linux's allowance for delayed and aggregated ACKs, at most
HYSTART_SAMPLES = 8
DELAY_MIN, DELAY_MAX = 4e-3, 16e-3


class Cubic:
    """`cwnd` and `ssthresh` in segments; `on_ack` grows the window, `on_loss`
    and `on_timeout` cut it."""

    __slots__ = (
        "cwnd", "delay_min", "end_seq", "epoch", "found", "k", "last_ack", "origin",
        "round_rtt", "round_start", "samples", "ssthresh", "tcp_cwnd", "w_max",
    )  # fmt: skip

    def __init__(self) -> None:
        self.cwnd = float(INIT_CWND)
        self.ssthresh = float("inf")
        self.w_max = 0.0
        self.epoch: float | None = None  # when the current cubic curve began
        self.k = 0.0
        self.origin = 0.0
        self.tcp_cwnd = 0.0  # Reno's window over the same epoch
        # HyStart
        self.found = False
        self.delay_min = float("inf")
        self.end_seq = 0  # the round ends when this is acknowledged
        self.round_start = self.last_ack = 0.0
        self.round_rtt = float("inf")
        self.samples = 0

    @property
    def in_slow_start(self) -> bool:
        return self.cwnd < self.ssthresh

    def on_ack(self, acked: int, rtt: float | None, now: float, una: int, nxt: int) -> None:
        """`acked` segments newly delivered (cumulatively or by SACK) outside
        recovery; `rtt`, this ACK's sample (None: none)."""
        if rtt is not None:
            self.delay_min = min(self.delay_min, rtt)
            if self.in_slow_start and not self.found and self.cwnd >= HYSTART_LOW:
                self._hystart(rtt, now, una, nxt)
        if acked <= 0:
            return
        if self.in_slow_start:
            room = self.ssthresh - self.cwnd
            if acked <= room:
                self.cwnd += acked
                return
            self.cwnd, acked = self.ssthresh, acked - int(room)
        self._avoid(acked, now)

    def _hystart(self, rtt: float, now: float, una: int, nxt: int) -> None:
        if una >= self.end_seq:  # a new round
            self.round_start = self.last_ack = now
            self.end_seq = nxt
            self.round_rtt, self.samples = float("inf"), 0
        if now - self.last_ack <= HYSTART_ACK_DELTA:
            self.last_ack = now
            if now - self.round_start > (self.delay_min + HYSTART_ACK_DELAY) / 2:
                self._leave_slow_start()
                return
        self.round_rtt = min(self.round_rtt, rtt)
        if self.samples < HYSTART_SAMPLES:
            self.samples += 1
        elif self.round_rtt > self.delay_min + min(max(self.delay_min / 8, DELAY_MIN), DELAY_MAX):
            self._leave_slow_start()

    def _leave_slow_start(self) -> None:
        self.found = True
        self.ssthresh = self.cwnd

    def _avoid(self, acked: int, now: float) -> None:
        cwnd = self.cwnd
        if self.epoch is None:
            self.epoch = now
            self.tcp_cwnd = cwnd
            if cwnd < self.w_max:
                self.k = ((self.w_max - cwnd) / C) ** (1 / 3)
                self.origin = self.w_max
            else:
                self.k, self.origin = 0.0, cwnd
        delay = self.delay_min if self.delay_min < float("inf") else 0.0
        t = now - self.epoch + delay
        target = self.origin + C * (t - self.k) ** 3
        grow = (target - cwnd) / cwnd if target > cwnd else 0.01 / cwnd
        self.tcp_cwnd += acked * 3 * (1 - BETA) / (1 + BETA) / cwnd
        if self.tcp_cwnd > cwnd:
            grow = max(grow, (self.tcp_cwnd - cwnd) / cwnd)
        self.cwnd = cwnd + acked * min(grow, 0.5)

    def on_loss(self) -> None:
        """A loss detected by SACK or RACK: the multiplicative decrease."""
        cwnd = self.cwnd
        self.w_max = cwnd * (1 + BETA) / 2 if cwnd < self.w_max else cwnd
        self.ssthresh = max(cwnd * BETA, 2.0)
        self.epoch = None

    def on_timeout(self, cut: bool) -> None:
        """The retransmission timer: ssthresh as for a loss when `cut` (Linux
        keeps the one a recovery under way set, and a backed-off timer's), the
        curve and HyStart begin again, a window of one segment."""
        if cut:
            self.on_loss()
        self.epoch = None
        self.w_max = 0.0
        self.found = False
        self.cwnd = 1.0
