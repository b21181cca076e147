"""Path health (dlcp/core/pathhealth.py): the states a path goes through as its
probes are answered or not, in virtual time; the probe's wire format; the
daemon's setting."""

from __future__ import annotations

import pytest

from dlcp.core.pathhealth import HealthConfig, PathHealth, PathStatus, health_config
from dlcp.daemon.config import parse
from dlcp.errors import DlcpError, LocalError
from dlcp.wire.credit import credit_of, credit_payload
from dlcp.wire.probe import probe_of, probe_payload

UP, SUSPECT, DOWN, PROBING = PathStatus.UP, PathStatus.SUSPECT, PathStatus.DOWN, PathStatus.PROBING
CFG = HealthConfig(interval=0.01, down_interval=0.05, timeout=0.025, down_after=3, up_after=3)


def step(h: PathHealth, now: float, answer: set[int], *, until: float, dt: float = 0.001) -> float:
    """Run probes from `now` to `until` in `dt` steps; paths in `answer` echo
    each probe 1 ms after it left."""
    inflight: list[tuple[float, int, int]] = []
    while now < until:
        for path, seq in h.probes_due(now):
            if path in answer:
                inflight.append((now + 0.001, path, seq))
        for item in [i for i in inflight if i[0] <= now]:
            inflight.remove(item)
            h.on_echo(item[1], item[2], now)
        h.poll(now)
        now = round(now + dt, 9)
    return now


def test_every_path_is_up_and_in_use_until_probes_go_unanswered() -> None:
    h = PathHealth(2, CFG)
    assert h.statuses() == [UP, UP] and h.usable() is None
    h.touch(0.0)
    now = step(h, 0.0, {0, 1}, until=0.2)
    assert h.statuses() == [UP, UP] and h.usable() is None
    assert h.probes_sent == h.echoes == 40  # every 10 ms on each path, all answered
    assert h.rtt(0) == pytest.approx(0.001, abs=2e-3)
    assert now == pytest.approx(0.2)


def test_a_dead_path_goes_suspect_then_down_within_three_deadlines_and_leaves_use() -> None:
    h = PathHealth(2, CFG)
    h.touch(0.0)
    now = step(h, 0.0, {0, 1}, until=0.1)
    h.touch(now)
    # path 1 dies at 0.1: its first unanswered probe turns it suspect at its
    # deadline, still in use; the third in a row takes it down
    step(h, now, {0}, until=0.14)
    assert h.status(1) == SUSPECT and h.usable() is None
    step(h, 0.14, {0}, until=0.2)
    assert h.status(1) == DOWN
    assert h.usable() == [True, False]
    went_down = [at for p, _old, new, at in h.changes if p == 1 and new == DOWN]
    assert len(went_down) == 1 and went_down[0] - 0.1 < 0.08
    assert h.transitions[(1, SUSPECT)] == 1 and h.transitions[(1, DOWN)] == 1


def test_a_down_path_is_probed_slowly_and_comes_back_after_three_echoes() -> None:
    h = PathHealth(2, CFG)
    h.touch(0.0)
    step(h, 0.0, {0}, until=0.2)
    assert h.status(1) == DOWN
    sent = h.probes_sent
    h.touch(0.2)
    step(h, 0.2, {0}, until=0.5)
    # path 0 every 10 ms, the down path every 50 ms
    assert h.probes_sent - sent == pytest.approx(30 + 6, abs=2)
    h.touch(0.5)
    now = step(h, 0.5, {0, 1}, until=0.56)
    assert h.status(1) in (PROBING, UP)
    assert h.usable() == ([True, False] if h.status(1) == PROBING else None)
    step(h, now, {0, 1}, until=0.7)
    assert h.status(1) == UP and h.usable() is None
    assert [new for p, _o, new, _t in h.changes if p == 1] == [SUSPECT, DOWN, PROBING, UP]


def test_a_probing_path_that_misses_again_goes_back_down() -> None:
    h = PathHealth(2, CFG)
    h.touch(0.0)
    step(h, 0.0, {0}, until=0.2)
    h.touch(0.2)
    now = step(h, 0.2, {0, 1}, until=0.26)  # one echo: probing
    assert h.status(1) in (PROBING, UP)
    h2 = PathHealth(2, CFG)
    h2.touch(0.0)
    step(h2, 0.0, {0}, until=0.2)
    seq = [s for p, s in h2.probes_due(0.25) if p == 1]
    assert seq
    h2.on_echo(1, seq[0], 0.251)
    assert h2.status(1) == PROBING
    h2.touch(0.26)
    step(h2, 0.26, {0}, until=0.4)
    assert h2.status(1) == DOWN
    assert now > 0.2


def test_suspect_path_answered_again_is_up_without_leaving_use() -> None:
    h = PathHealth(2, CFG)
    h.touch(0.0)
    step(h, 0.0, {0, 1}, until=0.05)
    # path 1 silent for 30 ms (one deadline passes, not three), then answers again
    now = step(h, 0.05, {0}, until=0.08)
    assert h.status(1) == SUSPECT and h.usable() is None
    h.touch(now)
    step(h, now, {0, 1}, until=0.2)
    assert h.status(1) == UP
    assert h.transitions[(1, SUSPECT)] == 1 and h.transitions[(1, DOWN)] == 0


def test_every_path_silent_keeps_every_path_in_use() -> None:
    """A daemon or peer that stalls makes every path miss at once: not a path
    fault. None goes down (no alert, no log of a dead path), all stay in use,
    and when the stall ends the answering ones are back (degraded for a while:
    the stall's lost probes count); a path that stays silent then, beside
    paths that answer, goes down."""
    h = PathHealth(3, CFG)
    h.touch(0.0)
    now = step(h, 0.0, set(), until=0.3)
    assert h.statuses() == [SUSPECT, SUSPECT, SUSPECT]
    assert h.usable() is None and h.transitions[(0, DOWN)] == 0
    h.touch(now)
    now = step(h, now, {0, 1}, until=now + 0.2)
    assert h.statuses()[2] == DOWN and h.transitions[(2, DOWN)] == 1
    assert h.usable(degraded=True) == [True, True, False]
    assert h.transitions[(0, DOWN)] == h.transitions[(1, DOWN)] == 0


def test_no_probes_without_traffic_and_old_probes_forgotten_after_idle() -> None:
    h = PathHealth(2, CFG)
    assert h.probes_due(0.0) == [] and h.next_timer() is None
    h.touch(0.0)
    assert len(h.probes_due(0.0)) == 2
    assert h.next_timer() == pytest.approx(0.01)
    # idle for longer than idle_after: nothing due, no timer, nothing judged
    assert h.probes_due(5.0) == [] and h.next_timer() is None
    assert h.statuses() == [UP, UP]
    h.touch(5.0)  # the unanswered probes of before the pause are dropped
    h.poll(5.5)
    assert h.statuses() == [UP, UP]


def test_echoes_of_unknown_paths_or_sequence_numbers_are_ignored() -> None:
    h = PathHealth(2, CFG)
    h.touch(0.0)
    h.probes_due(0.0)
    h.on_echo(5, 1, 0.001)
    h.on_echo(0, 99, 0.001)
    h.on_echo(0, 0, 0.001)
    assert h.echoes == 0
    h.on_echo(0, 1, 0.002)
    assert h.echoes == 1


def test_next_timer_is_the_first_probe_or_deadline_due() -> None:
    h = PathHealth(2, CFG)
    h.touch(0.0)
    h.probes_due(0.0)
    assert h.next_timer() == pytest.approx(0.01)
    h.probes_due(0.01)
    assert h.next_timer() == pytest.approx(0.02)  # the next probes, before any deadline
    h.probes_due(0.02)
    assert h.next_timer() == pytest.approx(0.025)  # the first probes' deadline
    h.poll(0.025)
    assert h.statuses() == [SUSPECT, SUSPECT]
    assert h.next_timer() == pytest.approx(0.025)  # suspect: probed again at once


@pytest.mark.parametrize(
    ("field", "value"),
    [("interval", 0), ("timeout", -1), ("rtt_factor", 0.5), ("down_after", 0), ("up_after", 1.5)],
)
def test_bad_settings_are_refused(field: str, value: float) -> None:
    with pytest.raises(LocalError, match=field):
        HealthConfig(**{field: value})  # type: ignore[arg-type]


def test_probe_and_echo_payloads_round_trip_and_credits_are_not_probes() -> None:
    p = probe_of(probe_payload(1, 77))
    assert p is not None and (p.echo, p.path, p.seq) == (False, 1, 77)
    e = probe_of(probe_payload(3, 2**32 - 1, echo=True))
    assert e is not None and (e.echo, e.path, e.seq) == (True, 3, 2**32 - 1)
    assert probe_of(credit_payload(1, 2)) is None
    assert credit_of(probe_payload(1, 2)) is None
    assert probe_of(b"\x02\x01") is None  # too short


def test_the_daemon_setting_probe_interval_s() -> None:
    assert parse({}).probe_interval_s == 0.01
    assert health_config(0.0) is None
    cfg = health_config(0.02)
    assert cfg is not None and cfg.interval == 0.02 and cfg.down_interval == 0.05
    assert parse({"network": {"probe_interval_s": 0}}).probe_interval_s == 0.0
    for bad in (-0.1, 2, "fast", True):
        with pytest.raises(DlcpError, match="probe_interval_s"):
            parse({"network": {"probe_interval_s": bad}})


def lossy_step(h: PathHealth, now: float, until: float, drop_every: dict[int, int]) -> float:
    """Probes from `now` to `until`, echoed after 1 ms, but path p's every
    `drop_every[p]`-th probe lost (0: none)."""
    inflight: list[tuple[float, int, int]] = []
    while now < until:
        for path, seq in h.probes_due(now):
            k = drop_every.get(path, 0)
            if not (k and seq % k == 0):
                inflight.append((now + 0.001, path, seq))
        for item in [i for i in inflight if i[0] <= now]:
            inflight.remove(item)
            h.on_echo(item[1], item[2], now)
        h.poll(now)
        now = round(now + 0.001, 9)
    return now


def test_a_lossy_path_is_degraded_out_of_spray_but_weighed_by_adaptive_and_recovers() -> None:
    h = PathHealth(2, CFG)
    h.touch(0.0)
    # every second probe on path 1 lost (50 %): never three misses in a row
    now = lossy_step(h, 0.0, 1.0, {1: 2})
    assert h.status(1) == PathStatus.DEGRADED and h.probe_loss(1) > 0.25
    assert h.usable() == [True, False]
    assert h.usable(degraded=True) is None  # adaptive weighs it itself
    assert h.transitions[(1, PathStatus.DEGRADED)] >= 1
    assert h.transitions[(1, DOWN)] == 0
    h.touch(now)
    lossy_step(h, now, now + 1.0, {})
    assert h.status(1) == UP and h.usable() is None and h.probe_loss(1) < 0.125
    # a loss rate as random loss has it (1 in 20) never degrades a path
    h2 = PathHealth(2, CFG)
    h2.touch(0.0)
    lossy_step(h2, 0.0, 1.0, {0: 20, 1: 20})
    assert h2.statuses() == [UP, UP]


def test_a_path_much_slower_than_the_best_is_degraded() -> None:
    h = PathHealth(2, CFG)
    h.touch(0.0)
    inflight: list[tuple[float, int, int]] = []
    now = 0.0
    while now < 1.0:
        for path, seq in h.probes_due(now):
            inflight.append((now + (0.001 if path == 0 else 0.02), path, seq))
        for item in [i for i in inflight if i[0] <= now]:
            inflight.remove(item)
            h.on_echo(item[1], item[2], now)
        now = round(now + 0.001, 9)
    assert h.status(1) == PathStatus.DEGRADED and h.status(0) == UP
    assert h.usable() == [True, False]
    rtt0, rtt1 = h.rtt(0), h.rtt(1)
    assert rtt0 is not None and rtt1 is not None and rtt1 > 10 * rtt0


def test_when_every_live_path_is_degraded_they_all_stay_in_use() -> None:
    h = PathHealth(2, CFG)
    h.touch(0.0)
    lossy_step(h, 0.0, 1.0, {0: 2, 1: 2})
    assert h.statuses() == [PathStatus.DEGRADED, PathStatus.DEGRADED]
    assert h.usable() is None


def test_a_late_echo_of_a_probe_from_before_the_path_went_down_is_no_recovery() -> None:
    """A probe sent just before the path died whose echo comes back after it
    was found down says nothing about the path now: it stays down (it went
    down, came back probing and went down again before: two downs in a row)."""
    h = PathHealth(2, CFG)
    h.touch(0.0)
    early = [s for p, s in h.probes_due(0.0) if p == 1]
    step(h, 0.0, {0}, until=0.2)
    assert h.status(1) == DOWN
    h.on_echo(1, early[0], 0.2)  # late, from before the cut
    assert h.status(1) == DOWN and h.transitions[(1, PROBING)] == 0
    h.touch(0.2)
    step(h, 0.2, {0, 1}, until=0.4)  # the probes sent while down are answered: back up
    assert h.status(1) == UP and h.transitions[(1, DOWN)] == 1
