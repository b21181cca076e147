"""Path health: which of a peer's paths may carry traffic, from probes and echoes (sans-IO).

Spraying packets over several paths pays only if a failed path costs almost
nothing; otherwise every extra path is one more way to stall a round. A path
that silently drops everything (a dead link or switch port) shows up late in
the data: the receiver NACKs what it missed only once a DONE reaches it, and
the DONEs, NACKs, retransmissions and credits that go on the dead path are
lost as well, until a round times out. So each peer with two or more paths
is probed on every path while the daemon has traffic for it (`touch`): a
small CONTROL packet, top class, that the peer echoes on the same path
(dlcp/wire/probe.py). Probes are cheap (one per path every `interval`, only
while there is traffic, only for peers with several paths; at most the
daemon's probe budget an interval over all of them, dlcp/core/probeplan.py) and say within a
few of their round trips what the data would say only after a round.

A path's state, driven by its probes' deadlines and echoes:
- up: in use.
- suspect: a probe went unanswered past its deadline (max(`timeout`,
  `rtt_factor` x the path's smoothed probe RTT)); still in use, probed again
  at once. An echo brings it back up.
- down: `down_after` probes in a row unanswered. Nothing but probes goes on
  it (the daemon moves its traffic to the live paths); it is probed every
  `down_interval`.
- probing: a down path's probe was answered (one sent after it went down: a
  late echo of an earlier one is not a recovery); still unused until `up_after`
  echoes in a row, then up (a miss sends it down again).
- degraded: up, but losing more than `degraded_loss` of its probes (a smoothed
  rate, 1/16 a probe), or its smoothed probe round trip is over
  `degraded_rtt` times the best path's and `degraded_delay` longer: out of
  use for balancers that do not weigh the paths themselves (spray, weighted,
  flow); `adaptive` weighs its loss and delay into its share instead. Back up
  when the loss falls under half that rate and the round trip under half
  that factor. The loss rate counts only while the path is in use (up or
  suspect): a dead path comes back with the rate it went down with.

A path goes down only while another path to the peer is up: when every
path falls silent at once the cause is more likely this daemon or the peer
(a stall, a busy CPU) than every path, and they stay suspect, in use. Should
every path be out of use all the same, all are used (`usable` returns None,
as when all are up).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from dlcp.errors import LocalError

__all__ = ["HealthConfig", "PathHealth", "PathStatus", "health_config"]


class PathStatus(enum.IntEnum):
    UP = 0
    SUSPECT = 1
    DOWN = 2
    PROBING = 3
    DEGRADED = 4

    @property
    def label(self) -> str:
        return self.name.lower()


_IN_USE = (PathStatus.UP, PathStatus.SUSPECT)
_LOSS_GAIN = 1 / 16  # the probe loss rate's smoothing, a probe
_OUTSTANDING_MAX = 64  # probes awaiting an echo per path (older ones are forgotten)


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Probe timing (seconds) and the state thresholds (see the module)."""

    interval: float = 0.01
    down_interval: float = 0.05
    timeout: float = 0.025
    rtt_factor: float = 4.0
    down_after: int = 3
    up_after: int = 3
    idle_after: float = 1.0  # no traffic for this long: probing stops
    degraded_loss: float = 0.25
    degraded_rtt: float = 4.0
    degraded_delay: float = 0.01

    def __post_init__(self) -> None:
        for name in ("interval", "down_interval", "timeout", "idle_after"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and 0 < v < 60):
                raise LocalError(f"path health {name} must be in (0, 60) seconds, got {v!r}")
        if not 0.0 < self.degraded_loss <= 1.0:
            raise LocalError(f"path health degraded_loss must be in (0, 1]: {self.degraded_loss}")
        if not 1.0 < self.degraded_rtt <= 1000.0 or not self.degraded_delay >= 0.0:
            raise LocalError("path health degraded_rtt must be in (1, 1000], degraded_delay >= 0")
        if not 1.0 <= self.rtt_factor <= 100.0:
            raise LocalError(f"path health rtt_factor must be in [1, 100], got {self.rtt_factor}")
        for name in ("down_after", "up_after"):
            v = getattr(self, name)
            if not (isinstance(v, int) and 1 <= v <= 100):
                raise LocalError(f"path health {name} must be an integer 1..100, got {v!r}")


def health_config(interval: float) -> HealthConfig | None:
    """The daemon's settings for `[network] probe_interval_s` (0: no probes)."""
    if interval <= 0:
        return None
    return HealthConfig(interval=interval, down_interval=max(interval, 0.05))


@dataclass(slots=True)
class _Path:
    status: PathStatus = PathStatus.UP
    seq: int = 0  # the last probe's sequence number
    outstanding: dict[int, float] = field(default_factory=dict)  # seq -> sent at
    misses: int = 0  # probes in a row past their deadline without an echo
    echoes: int = 0  # echoes in a row while probing
    next_probe: float = 0.0
    srtt: float | None = None
    since: float = 0.0  # when it entered its status
    loss: float = 0.0  # smoothed probe loss rate
    degraded: bool = False
    down_seq: int = 0  # the last probe sent before it went down


class PathHealth:
    """The health of one peer's `n_paths` paths (indices as the outbox's)."""

    def __init__(self, n_paths: int, config: HealthConfig | None = None) -> None:
        if n_paths < 1:
            raise LocalError("path health needs at least one path")
        self.config = config or HealthConfig()
        self._paths = [_Path() for _ in range(n_paths)]
        self._active_until = -1.0
        # (path, new status) -> times; and (path, old, new, at) not yet read
        self.transitions: Counter[tuple[int, PathStatus]] = Counter()
        self.changes: list[tuple[int, PathStatus, PathStatus, float]] = []
        self.probes_sent = 0
        self.echoes = 0
        # called when the next probe may be due sooner than its schedule said
        # (traffic after idle, a state change): `ProbePlan` reschedules then
        self.on_wake: Callable[[], None] | None = None

    @property
    def n_paths(self) -> int:
        return len(self._paths)

    def status(self, path: int) -> PathStatus:
        """The path's state; an up path that loses or lags too much is DEGRADED."""
        p = self._paths[path]
        return PathStatus.DEGRADED if p.degraded and p.status == PathStatus.UP else p.status

    def statuses(self) -> list[PathStatus]:
        return [self.status(i) for i in range(len(self._paths))]

    def probe_loss(self, path: int) -> float:
        """The path's smoothed probe loss rate."""
        return self._paths[path].loss

    def rtt(self, path: int) -> float | None:
        """The path's smoothed probe round trip (seconds), None before an echo."""
        return self._paths[path].srtt

    # -- traffic ----------------------------------------------------------
    def touch(self, now: float) -> None:
        """The daemon has traffic for (or from) the peer at `now`: probe until
        `idle_after` without any."""
        woke = now >= self._active_until
        if woke:  # waking from idle: old probes say nothing
            for p in self._paths:
                p.outstanding.clear()
                p.next_probe = min(p.next_probe, now)
        self._active_until = now + self.config.idle_after
        if woke and self.on_wake is not None:
            self.on_wake()

    def active(self, now: float) -> bool:
        return now < self._active_until

    def usable(self, degraded: bool = False) -> list[bool] | None:
        """Which paths may carry data now; None when all may (all in use, or
        none: then the fault is more likely not the paths'). `degraded`: a
        degraded path may (for a balancer that weighs the paths itself);
        when every live path is degraded, they all may."""
        live = [p.status in _IN_USE for p in self._paths]
        use = live
        if not degraded:
            use = [u and not p.degraded for u, p in zip(live, self._paths, strict=True)]
        if not any(use):
            use = live
        if all(use) or not any(use):
            return None
        return use

    # -- probes -----------------------------------------------------------
    def probes_due(self, now: float) -> list[tuple[int, int]]:
        """(path, sequence number) of each probe to send now; they count as
        sent. Deadlines that passed are judged first."""
        if not self.active(now):
            self._active_until = -1.0  # idle: no timer until the next `touch`
            return []
        self.poll(now)
        out = []
        for i, p in enumerate(self._paths):
            if p.next_probe <= now:
                out.append((i, self._probe(i, p, now)))
        return out

    def probe_at(self, path: int) -> float | None:
        """When `path`'s next probe is due (None while idle: see `probe`)."""
        return None if self._active_until < 0 else self._paths[path].next_probe

    def urgent(self, path: int) -> bool:
        """Whether `path`'s next probe settles a question (suspect: down or
        not; probing: back or not), to go before the routine ones."""
        return self._paths[path].status in (PathStatus.SUSPECT, PathStatus.PROBING)

    def probe(self, path: int, now: float) -> int | None:
        """Send `path`'s probe now: its sequence number (it counts as sent);
        None without traffic since `idle_after` (idle: nothing is due until
        the next `touch`)."""
        if not self.active(now):
            self._active_until = -1.0
            return None
        return self._probe(path, self._paths[path], now)

    def _probe(self, i: int, p: _Path, now: float) -> int:
        p.seq += 1
        p.outstanding[p.seq] = now
        if len(p.outstanding) > _OUTSTANDING_MAX:
            del p.outstanding[min(p.outstanding)]
        cfg = self.config
        p.next_probe = now + (cfg.down_interval if p.status == PathStatus.DOWN else cfg.interval)
        self.probes_sent += 1
        return p.seq

    def next_deadline(self) -> float | None:
        """When the earliest probe awaiting an echo runs out (None: none waits)."""
        t: float | None = None
        for p in self._paths:
            if p.outstanding:
                d = min(p.outstanding.values()) + self._deadline(p)
                if t is None or d < t:
                    t = d
        return t

    def _deadline(self, p: _Path) -> float:
        cfg = self.config
        return cfg.timeout if p.srtt is None else max(cfg.timeout, cfg.rtt_factor * p.srtt)

    def poll(self, now: float) -> None:
        """Count the probes whose deadline passed without an echo as misses."""
        for i, p in enumerate(self._paths):
            if not p.outstanding:
                continue
            wait = self._deadline(p)
            late = [s for s, t in p.outstanding.items() if t + wait <= now]  # as next_timer
            for s in late:
                del p.outstanding[s]
                self._miss(i, p, now)

    def _probe_lost(self, i: int, p: _Path, lost: bool, now: float, judge: bool = True) -> None:
        """One probe of path `i` lost or answered: its loss rate, and (`judge`)
        whether it is degraded now; a path in use only (frozen while down)."""
        if p.status not in _IN_USE:
            return
        p.loss += _LOSS_GAIN * ((1.0 if lost else 0.0) - p.loss)
        if judge:
            self._judge(i, p, now)

    def _miss(self, i: int, p: _Path, now: float) -> None:
        self._probe_lost(i, p, True, now)
        p.misses += 1
        p.echoes = 0
        if p.status == PathStatus.UP:
            self._set(i, p, PathStatus.SUSPECT, now)
            p.next_probe = now  # ask again at once
        elif p.status == PathStatus.PROBING or (
            p.status == PathStatus.SUSPECT
            and p.misses >= self.config.down_after
            and self._others_answer(i)
        ):
            self._set(i, p, PathStatus.DOWN, now)

    def _others_answer(self, i: int) -> bool:
        """Whether some other path to the peer is up (its probes answered): the
        peer and this daemon are alive, so path `i`'s silence is its own."""
        return any(q.status == PathStatus.UP for j, q in enumerate(self._paths) if j != i)

    def on_echo(self, path: int, seq: int, now: float) -> float | None:
        """The peer echoed probe `seq` of `path` at `now` (late ones count as
        evidence too, without an RTT sample); unknown paths and sequence
        numbers never sent are ignored. Returns the RTT sample, if any."""
        if not 0 <= path < len(self._paths):
            return None
        p = self._paths[path]
        if not 0 < seq <= p.seq:
            return None
        if p.status in (PathStatus.DOWN, PathStatus.PROBING) and seq <= p.down_seq:
            return None  # a late echo of a probe from before it went down: not a recovery
        self.echoes += 1
        sent = p.outstanding.pop(seq, None)
        rtt = None
        if sent is not None:
            rtt = max(now - sent, 0.0)
            p.srtt = rtt if p.srtt is None else p.srtt + 0.125 * (rtt - p.srtt)
            # Overtaken (a path's probes keep their order): lost, for the loss
            # rate; not misses, since the path answers
            for s in [s for s in p.outstanding if s < seq]:
                del p.outstanding[s]
                self._probe_lost(path, p, True, now, judge=False)
            self._probe_lost(path, p, False, now)
        p.misses = 0
        if p.status == PathStatus.SUSPECT:
            self._set(path, p, PathStatus.UP, now)
        elif p.status == PathStatus.DOWN:
            p.echoes = 1
            self._set(path, p, PathStatus.PROBING, now)
            p.next_probe = min(p.next_probe, now + self.config.interval)
        elif p.status == PathStatus.PROBING:
            p.echoes += 1
        if p.status == PathStatus.PROBING and p.echoes >= self.config.up_after:
            self._set(path, p, PathStatus.UP, now)
        return rtt

    def _judge(self, i: int, p: _Path, now: float) -> None:
        """Whether path `i` is degraded, from its probe loss and round trip
        against the best path's (with hysteresis: see the module)."""
        cfg = self.config
        best = min((q.srtt for q in self._paths if q.srtt is not None), default=None)
        k = 0.5 if p.degraded else 1.0  # back up only under half the limits
        lags = (
            p.srtt is not None
            and best is not None
            and p.srtt > best * cfg.degraded_rtt * k
            and p.srtt - best > cfg.degraded_delay * k
        )
        bad = p.loss > cfg.degraded_loss * k or lags
        if bad == p.degraded:
            return
        was = self.status(i)
        p.degraded = bad
        if p.status == PathStatus.UP:  # a state change as seen from outside
            self._changed(i, was, now)

    def _set(self, i: int, p: _Path, status: PathStatus, now: float) -> None:
        was = self.status(i)
        p.status = status
        p.since = now
        if status == PathStatus.DOWN:
            p.down_seq = p.seq
        self._changed(i, was, now)

    def _changed(self, i: int, was: PathStatus, now: float) -> None:
        """Path `i`'s state went from `was` to what `status` says now: noted."""
        now_is = self.status(i)
        self.changes.append((i, was, now_is, now))
        self.transitions[(i, now_is)] += 1
        if self.on_wake is not None:
            self.on_wake()

    def next_timer(self) -> float | None:
        """When `probes_due` or `poll` has something to do next; None when idle."""
        if self._active_until < 0:
            return None
        t: float | None = None
        for p in self._paths:
            cand = p.next_probe
            if p.outstanding:
                cand = min(cand, min(p.outstanding.values()) + self._deadline(p))
            t = cand if t is None else min(t, cand)
        if t is None or t >= self._active_until:
            return None
        return t
