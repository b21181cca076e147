"""Rate control maths: AIMD rates per path to a destination, and a token-bucket pacer.

dlcp tolerates loss, so it needs only a minimal rate control (DESIGN.md "Load
balancing and rate control"): enough to keep UDP from collapsing a congested
network and to share a bottleneck fairly among dlcp flows. `RateController`
is AIMD on a sending rate, with a slow-start-like start, an optional delay
signal and an optional loss tolerance (random loss below it is not taken for
congestion); `PathRates` keeps one controller per path to a peer, so that a
congested or lossy path is slowed on its own; `Pacer` turns a rate into send
times. Sans-IO: time comes in as `now` (seconds).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dlcp.errors import LocalError

__all__ = ["WIRE_OVERHEAD", "Pacer", "PathRates", "RateConfig", "RateController"]

# Bytes a UDP datagram takes on an Ethernet link beyond its payload (Ethernet
# 14, IPv4 20, UDP 8): what a link, and a switch's shaper, count. Pacers count
# them too, or H - 1 senders paced at the link's share overfill it (by 2.9 %
# with 1472-byte datagrams at MTU 1500).
WIRE_OVERHEAD = 42


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LocalError(f"rate.{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise LocalError(f"rate.{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclass(frozen=True)
class RateConfig:
    """Settings of every destination's rate controller and pacer (rates in bit/s).

    The maximum rate is `link_rate_bps` when known, else `ceiling_bps`. The
    daemon takes `link_rate_bps` as its link's rate (each path's) and caps
    each destination's path at `utilization` of it over the hosts that send to
    that destination (`fan_in_rate`): H - 1 senders converging on one port
    (incast) then fill at most `utilization` of it, in wire bytes (pacers count
    each datagram's Ethernet, IP and UDP headers, `WIRE_OVERHEAD`), which
    leaves its queues room to drain.
    Without `initial_rate_bps` a flow starts at 10 packets per `initial_rtt`.
    Each RTT of acknowledged data adds `increase_packets` packets per RTT to the
    rate; a loss multiplies it by `beta` (at most once per RTT). With
    `delay_target` (seconds), an RTT sample more than that above the smallest
    seen multiplies it by `delay_beta` instead. A loss reported with the path's
    recent loss rate (lost / sent) at or below `loss_tolerance` leaves the rate
    alone: random loss at that level is not congestion (the `adaptive` load
    balancer weighs such a path by its goodput instead). With `loss_backoff`
    False, losses never cut the rate (they are still counted): the daemon's
    default, where the fan-in cap keeps dlcp's own senders within a port and
    the switch's classes keep other traffic below dlcp's; there loss is
    random, and backing off from it only slowed the round (a burst of 50 %
    loss for 300 ms cut a 97 Mbit/s path to its 20 Mbit/s floor, and the
    additive increase, driven by result packets, took seconds to recover).
    """

    link_rate_bps: float | None = None
    ceiling_bps: float = 10e9
    min_rate_bps: float = 1e6
    initial_rate_bps: float | None = None
    initial_rtt: float = 0.001
    mss_bytes: int = 1500
    increase_packets: float = 1.0
    beta: float = 0.5
    delay_target: float | None = None
    delay_beta: float = 0.85
    rtt_gain: float = 0.125
    burst_bytes: int = 15000
    loss_tolerance: float = 0.0
    utilization: float = 0.97
    loss_backoff: bool = True

    def __post_init__(self) -> None:
        for name in ("ceiling_bps", "min_rate_bps", "initial_rtt", "increase_packets"):
            _positive(name, getattr(self, name))
        for name in ("link_rate_bps", "initial_rate_bps", "delay_target"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in ("mss_bytes", "burst_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LocalError(f"rate.{name} must be an integer >= 1, got {value!r}")
        for name in ("beta", "delay_beta"):
            _positive(name, getattr(self, name))
            if not getattr(self, name) < 1:
                raise LocalError(f"rate.{name} must be in (0, 1), got {getattr(self, name)}")
        _positive("rtt_gain", self.rtt_gain)
        if self.rtt_gain > 1:
            raise LocalError(f"rate.rtt_gain must be in (0, 1], got {self.rtt_gain}")
        if not isinstance(self.loss_backoff, bool):
            raise LocalError(f"rate.loss_backoff must be true or false, got {self.loss_backoff!r}")
        _positive("utilization", self.utilization)
        if self.utilization > 1:
            raise LocalError(f"rate.utilization must be in (0, 1], got {self.utilization}")
        _positive("loss_tolerance", self.loss_tolerance, allow_zero=True)
        if not self.loss_tolerance < 1:
            raise LocalError(f"rate.loss_tolerance must be in [0, 1), got {self.loss_tolerance}")
        if self.min_rate_bps > self.max_rate_bps:
            raise LocalError(
                f"rate.min_rate_bps {self.min_rate_bps} exceeds the maximum {self.max_rate_bps}"
            )

    @property
    def max_rate_bps(self) -> float:
        """The link rate when known, else the configured ceiling."""
        return self.ceiling_bps if self.link_rate_bps is None else self.link_rate_bps

    def fan_in_rate(self, senders: int) -> float | None:
        """A destination's rate cap when `senders` hosts (this one included)
        send to it: `utilization` of the link shared among them; None when
        the link rate is not known."""
        if self.link_rate_bps is None:
            return None
        return self.link_rate_bps * self.utilization / max(1, senders)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> RateConfig:
        """From a TOML table; unknown keys are a LocalError (dashes read as underscores)."""
        known = {f.name for f in dataclasses.fields(cls)}
        params = {str(k).replace("-", "_"): v for k, v in cfg.items()}
        unknown = sorted(set(params) - known)
        if unknown:
            raise LocalError(
                f"unknown rate settings {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**params)


class RateController:
    """AIMD sending rate towards one destination.

    Starts in slow start (the rate doubles per RTT of acknowledged data) until
    the first loss or delay signal, then adds `increase_packets` packets per
    RTT per RTT of acknowledged data and multiplies by `beta` on loss, at most
    once per smoothed RTT. The rate stays within [min_rate_bps, max_rate_bps].
    """

    def __init__(self, config: RateConfig | None = None) -> None:
        self.config = config = config if config is not None else RateConfig()
        self.max_rate_bps = config.max_rate_bps
        self.min_rate_bps = config.min_rate_bps
        start = config.initial_rate_bps
        if start is None:
            start = 10 * config.mss_bytes * 8 / config.initial_rtt
        # internal state
        self._rate = self._clamp(start)
        self.srtt = config.initial_rtt
        self.min_rtt: float | None = None
        self.slow_start = True
        self._last_decrease: float | None = None
        # stats
        self.decreases = 0
        self.acked_bytes = 0
        self.lost_packets = 0

    @property
    def rate_bps(self) -> float:
        """The current sending rate, bit/s."""
        return self._rate

    def set_max_rate(self, max_rate_bps: float) -> None:
        """A new maximum (the link rate once learnt); the rate is clamped to it."""
        _positive("max_rate_bps", max_rate_bps)
        self.max_rate_bps = float(max_rate_bps)
        self.min_rate_bps = min(self.config.min_rate_bps, self.max_rate_bps)
        self._rate = self._clamp(self._rate)

    def on_ack(self, nbytes: int, rtt: float | None, now: float) -> None:
        """`nbytes` were confirmed delivered at `now`; `rtt`, if known, sampled then."""
        if nbytes < 0:
            raise LocalError(f"acknowledged bytes must be >= 0, got {nbytes}")
        self.acked_bytes += nbytes
        if rtt is not None:
            if not (math.isfinite(rtt) and rtt > 0):
                raise LocalError(f"rtt must be > 0 seconds, got {rtt}")
            self.srtt += self.config.rtt_gain * (rtt - self.srtt)
            self.min_rtt = rtt if self.min_rtt is None else min(self.min_rtt, rtt)
            target = self.config.delay_target
            if target is not None and rtt - self.min_rtt > target:
                self._decrease(self.config.delay_beta, now)
                return
        bits = nbytes * 8.0
        if self.slow_start:
            grow = bits / self.srtt
        else:
            step = self.config.increase_packets * self.config.mss_bytes * 8.0 / self.srtt
            grow = step * bits / (self._rate * self.srtt)
        self._rate = self._clamp(self._rate + grow)

    def on_loss(self, n_lost: int, now: float, *, loss_rate: float | None = None) -> None:
        """`n_lost` packets were found lost at `now` (NACKs, missing droppable data).

        `loss_rate`, if known, is the recent fraction of packets lost; at or
        below `config.loss_tolerance` the rate is kept.
        """
        if n_lost < 0:
            raise LocalError(f"lost packets must be >= 0, got {n_lost}")
        if n_lost == 0:
            return
        self.lost_packets += n_lost
        if loss_rate is not None:
            if not (math.isfinite(loss_rate) and 0 <= loss_rate <= 1):
                raise LocalError(f"loss rate must be in [0, 1], got {loss_rate}")
            if loss_rate <= self.config.loss_tolerance:
                return
        if self.config.loss_backoff:
            self._decrease(self.config.beta, now)

    def _decrease(self, factor: float, now: float) -> None:
        self.slow_start = False
        last = self._last_decrease
        if last is not None and now - last < self.srtt:
            return
        self._last_decrease = now
        self._rate = self._clamp(self._rate * factor)
        self.decreases += 1

    def _clamp(self, rate: float) -> float:
        return min(self.max_rate_bps, max(self.min_rate_bps, rate))


class PathRates:
    """One `RateController` per path to a destination.

    Losses are known per path (a NACK names packets, the sender remembers
    which path each took), so a congested path is slowed alone and the others
    keep their rate. Deliveries are not: a peer's results and ACKs confirm
    what all paths carried, so `on_ack` shares acknowledged bytes among the
    paths in proportion to the bytes `on_sent` reported since the previous
    acknowledgement. A path's rate is cut at most once per `decrease_interval`
    seconds (NACKs arrive in clumps; one clump is one signal).
    """

    def __init__(
        self, n_paths: int, config: RateConfig | None = None, *, decrease_interval: float = 0.05
    ) -> None:
        if isinstance(n_paths, bool) or not isinstance(n_paths, int) or n_paths < 1:
            raise LocalError(f"a destination needs at least one path, got {n_paths!r}")
        _positive("decrease_interval", decrease_interval, allow_zero=True)
        self.config = config = config if config is not None else RateConfig()
        self.decrease_interval = float(decrease_interval)
        self.paths = [RateController(config) for _ in range(n_paths)]
        # internal state
        self._since_ack = [0] * n_paths  # bytes sent per path since the last ack
        self._split = [1.0 / n_paths] * n_paths  # how the last ack was shared
        self._last_cut = [float("-inf")] * n_paths
        # stats
        self.nacked_packets = 0

    @property
    def rate_bps(self) -> float:
        """The destination's total sending rate (the sum over paths), bit/s."""
        return sum(c.rate_bps for c in self.paths)

    @property
    def lost_packets(self) -> int:
        """Packets the destination reported missing (every NACKed index, repeats too)."""
        return self.nacked_packets

    def rates(self) -> list[float]:
        """Each path's sending rate, bit/s."""
        return [c.rate_bps for c in self.paths]

    def on_nacked(self, n: int) -> None:
        """The destination's NACK named `n` packets (counted; the rates follow `on_loss`)."""
        if n < 0:
            raise LocalError(f"NACKed packets must be >= 0, got {n}")
        self.nacked_packets += n

    def on_sent(self, path: int, nbytes: int) -> None:
        """`nbytes` went out on `path`."""
        if nbytes < 0:
            raise LocalError(f"sent bytes must be >= 0, got {nbytes}")
        self._since_ack[path] += nbytes

    def on_ack(self, nbytes: int, rtt: float | None, now: float) -> None:
        """`nbytes` were confirmed delivered at `now`: shared among the paths by what they sent."""
        if nbytes < 0:
            raise LocalError(f"acknowledged bytes must be >= 0, got {nbytes}")
        total = sum(self._since_ack)
        if total > 0:
            self._split = [b / total for b in self._since_ack]
            self._since_ack = [0] * len(self.paths)
        for c, share in zip(self.paths, self._split, strict=True):
            if share > 0:
                c.on_ack(round(nbytes * share), rtt, now)

    def on_loss(
        self, path: int, n_lost: int, now: float, *, loss_rate: float | None = None
    ) -> None:
        """`n_lost` packets sent on `path` were found lost at `now`; `loss_rate` is
        the path's recent lost / sent (see `RateController.on_loss`)."""
        if n_lost < 0:
            raise LocalError(f"lost packets must be >= 0, got {n_lost}")
        if n_lost == 0:
            return
        c = self.paths[path]
        if now < self._last_cut[path] + self.decrease_interval:
            c.lost_packets += n_lost  # same clump: counted, no second cut
            return
        before = c.decreases
        c.on_loss(n_lost, now, loss_rate=loss_rate)
        if c.decreases != before:
            self._last_cut[path] = now

    def set_max_rate(self, max_rate_bps: float) -> None:
        """A new maximum for every path (see `RateController.set_max_rate`)."""
        for c in self.paths:
            c.set_max_rate(max_rate_bps)


class Pacer:
    """Token bucket: bytes go out at `rate_bps` with bursts of up to `burst_bytes`.

    `consume` reserves bytes and says how long to wait before sending them;
    reservations beyond the tokens run into debt that later calls pay off, so a
    caller that sends each reservation no earlier than told never sends more
    than max(burst_bytes, largest reservation) + rate * window in any window.
    A reservation larger than the burst always waits for the difference, so
    set burst_bytes to at least the largest batch (GSO send) the daemon makes.

    With `burst_seconds` the burst is at least that much time at the current
    rate (`rate_bps * burst_seconds / 8` bytes, following `set_rate`): a sender
    whose event loop comes back to send only every few milliseconds at high
    rates would otherwise lose every token beyond a fixed burst and fall far
    below its rate; scaled with the rate, the burst stays a fixed time of the
    path's share (small on slow or congested paths).
    """

    def __init__(
        self,
        *,
        rate_bps: float,
        burst_bytes: float = 15000,
        now: float = 0.0,
        burst_seconds: float = 0.0,
        tokens: float | None = None,
    ) -> None:
        _positive("rate_bps", rate_bps)
        _positive("burst_bytes", burst_bytes)
        _positive("burst_seconds", burst_seconds, allow_zero=True)
        self._rate = float(rate_bps)
        self._min_burst = float(burst_bytes)
        self._burst_seconds = float(burst_seconds)
        self.burst_bytes = self._burst_for(self._rate)
        # bytes that may go at once from the start: a full burst unless told
        self._tokens = self.burst_bytes if tokens is None else min(tokens, self.burst_bytes)
        self._updated = now

    def _burst_for(self, rate_bps: float) -> float:
        return max(self._min_burst, rate_bps * self._burst_seconds / 8.0)

    @property
    def rate_bps(self) -> float:
        """The pacing rate, bit/s."""
        return self._rate

    def set_rate(self, rate_bps: float, now: float) -> None:
        """Pace at `rate_bps` from `now` on (tokens earned so far are kept; a
        lower rate keeps at most its burst)."""
        _positive("rate_bps", rate_bps)
        self._refill(now)
        lower = rate_bps < self._rate
        self._rate = float(rate_bps)
        self.burst_bytes = self._burst_for(self._rate)
        if lower:
            self._tokens = min(self._tokens, self.burst_bytes)

    def catch_up(self, late: float, now: float) -> None:
        """The sender, with bytes waiting, came back `late` seconds after the
        time it was told (busy elsewhere, or not scheduled): the tokens earned
        in those seconds are kept even beyond the burst, so that a late sender
        still holds its rate over time instead of losing them. It may then send
        up to burst + rate x late at once; `settle` drops what is left of that
        once nothing waits."""
        _positive("late", late, allow_zero=True)
        self._refill(now, late)

    def retune(self, rate_bps: float, late: float, now: float) -> None:
        """`catch_up(late, now)` where `late` > 0, then `set_rate(rate_bps,
        now)`: what a flush does to each pacer before sending, in one call
        (the checks of a finite positive float done inline)."""
        if late > 0:
            if type(late) is not float or late == math.inf:
                _positive("late", late, allow_zero=True)
            self._refill(now, late)
        if type(rate_bps) is not float or not 0.0 < rate_bps < math.inf:
            _positive("rate_bps", rate_bps)
        if now - self._updated > 0:
            self._refill(now)
        if rate_bps != self._rate:  # else set_rate would change nothing
            lower = rate_bps < self._rate
            self._rate = float(rate_bps)
            self.burst_bytes = self._burst_for(self._rate)
            if lower:
                self._tokens = min(self._tokens, self.burst_bytes)

    def budget(self, now: float) -> tuple[float, float]:
        """(`delay(1.0, now)`, `tokens(now)`): whether a datagram may go now
        and how many bytes may, in one call."""
        if now - self._updated > 0:  # else `_refill` has nothing to do
            self._refill(now)
        tokens = self._tokens
        short = 1.0 - tokens
        return (short if short > 0.0 else 0.0) * 8.0 / self._rate, tokens

    def settle(self, now: float, keep: float | None = None) -> None:
        """Nothing waits any more: tokens beyond the burst (a catch-up's) are
        dropped, or beyond `keep` bytes where that is less."""
        self._refill(now)
        cap = self.burst_bytes if keep is None else min(self.burst_bytes, keep)
        self._tokens = min(self._tokens, cap)

    def tokens(self, now: float) -> float:
        """Bytes that may go at `now` without waiting (negative: debt)."""
        self._refill(now)
        return self._tokens

    def delay(self, nbytes: float, now: float) -> float:
        """Seconds from `now` until `nbytes` could go, without reserving them."""
        self._refill(now)
        short = nbytes - self._tokens
        return max(0.0, short) * 8.0 / self._rate

    def next_send_time(self, nbytes: float, now: float) -> float:
        """When `nbytes` could go, without reserving them."""
        return now + self.delay(nbytes, now)

    def consume(self, nbytes: float, now: float) -> float:
        """Reserve `nbytes`; the seconds from `now` to wait before sending them."""
        if nbytes < 0:
            raise LocalError(f"cannot pace {nbytes} bytes")
        if now - self._updated > 0:
            self._refill(now)
        self._tokens -= nbytes
        debt = -self._tokens
        return (debt if debt > 0.0 else 0.0) * 8.0 / self._rate

    def _refill(self, now: float, late: float = 0.0) -> None:
        """Earn tokens for the time since the last refill, up to the burst, or
        beyond it by what `late` of that time earned (`catch_up`). Tokens already
        beyond the cap (a catch-up's) stay."""
        elapsed = now - self._updated
        if elapsed > 0:  # a clock that steps back earns nothing
            # min() and max() written out in this module's per-send paths:
            # they are called several times a batch (same results, NaN too)
            cap = self.burst_bytes + (elapsed if elapsed < late else late) * self._rate / 8.0
            if self._tokens < cap:
                tokens = self._tokens + elapsed * self._rate / 8.0
                self._tokens = tokens if tokens < cap else cap
            self._updated = now
