"""The daemon's probe plan (dlcp/core/probeplan.py), in virtual time: at most
`budget` probes an interval over every peer and path, none starved, the
probes that decide a path's state first, a dead path down within the
documented bound; driven by the plan's own `next_timer`, as the daemon is."""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict

import pytest

from dlcp.core.pathhealth import HealthConfig, PathHealth, PathStatus, health_config
from dlcp.core.probeplan import ProbePlan, detection_bound
from dlcp.daemon.config import parse
from dlcp.errors import DlcpError, LocalError

CFG = health_config(0.01)
assert CFG is not None
RTT = 0.001


class Net:
    """`peers` x `paths` paths probed by one plan; each probe's echo comes back
    RTT later unless its path is in `dead`; every peer has traffic (a touch)
    every 5 ms. `sent[(peer, path)]` is when each probe left."""

    def __init__(self, peers: int, paths: int, budget: int, cfg: HealthConfig = CFG) -> None:
        self.plan: ProbePlan[int] = ProbePlan(budget)
        self.healths = [PathHealth(paths, cfg) for _ in range(peers)]
        for k, h in enumerate(self.healths):
            self.plan.add(k, h)
        self.dead: set[tuple[int, int]] = set()
        self.inflight: list[tuple[float, int, int, int]] = []
        self.sent: dict[tuple[int, int], list[float]] = defaultdict(list)
        self.downs: dict[tuple[int, int], float] = {}
        self.now = 0.0
        self.next_touch = 0.0
        self.wakeups = 0

    def run(self, until: float) -> None:
        plan = self.plan
        while self.now < until:
            now = self.now
            if now >= self.next_touch:
                for h in self.healths:
                    h.touch(now)
                self.next_touch = now + 0.005
            while self.inflight and self.inflight[0][0] <= now:
                _, k, path, seq = heapq.heappop(self.inflight)
                self.healths[k].on_echo(path, seq, now)
            for k, path, seq in plan.due(now):
                self.sent[(k, path)].append(now)
                if (k, path) not in self.dead:
                    heapq.heappush(self.inflight, (now + RTT, k, path, seq))
            for k in plan.touched:
                for path, _old, new, at in self.healths[k].changes:
                    if new == PathStatus.DOWN:
                        self.downs.setdefault((k, path), at)
                self.healths[k].changes.clear()
            plan.touched.clear()
            nxt = [self.next_touch]
            t = plan.next_timer()
            if t is not None:
                nxt.append(t)
            if self.inflight:
                nxt.append(self.inflight[0][0])
            self.now = max(min(nxt), now)
            if self.now == now:
                self.now = now + 1e-6  # (a timer due now was served: no spin)
            self.wakeups += 1


def windows(times: list[float], width: float, start: float, end: float) -> list[int]:
    counts = [0] * round((end - start) / width)
    for t in times:
        if start <= t < end:
            counts[int((t - start) / width)] += 1
    return counts


def test_64_peers_on_4_paths_send_at_most_the_budget_an_interval_and_none_starves() -> None:
    net = Net(63, 4, budget=32)
    net.run(1.0)
    every = [t for ts in net.sent.values() for t in ts]
    # the bucket holds one interval's budget: no 10 ms window carries more than
    # two intervals' worth, and over the second as a whole, one an interval
    assert max(windows(every, 0.01, 0.0, 1.0)) <= 2 * 32
    assert 0.9 * 3200 <= len(every) <= 3200 + 32
    # every path is probed, about every interval x paths / budget (79 ms)
    assert len(net.sent) == 63 * 4
    for ts in net.sent.values():
        gaps = [b - a for a, b in itertools.pairwise(ts)]
        assert ts[0] < 0.1 and max(gaps) < 0.1
    assert not net.downs  # all answered: no path left use


def test_without_a_budget_every_path_is_probed_every_interval() -> None:
    net = Net(15, 4, budget=0)
    net.run(0.5)
    for ts in net.sent.values():
        assert len(ts) == pytest.approx(50, abs=1)
    assert len(net.sent) == 60


def test_a_budget_above_the_paths_changes_nothing() -> None:
    free, bounded = Net(2, 2, budget=0), Net(2, 2, budget=32)
    free.run(0.5)
    bounded.run(0.5)
    assert free.sent == bounded.sent


@pytest.mark.parametrize(("peers", "paths"), [(2, 2), (15, 4), (63, 4)])
def test_a_dead_path_goes_down_within_the_documented_bound(peers: int, paths: int) -> None:
    net = Net(peers, paths, budget=32)
    net.run(0.3)
    cut = net.now
    net.dead = {(peers // 2, 1)}
    net.run(cut + 0.5)
    bound = detection_bound(CFG, peers * paths, 32)
    assert set(net.downs) == net.dead
    assert net.downs[(peers // 2, 1)] - cut <= bound
    assert net.healths[peers // 2].usable() == [p != 1 for p in range(paths)]


def test_the_documented_bounds() -> None:
    assert detection_bound(CFG, 2 * 2, 32) == pytest.approx(0.07, abs=0.002)
    assert detection_bound(CFG, 63 * 4, 32) == pytest.approx(0.14, abs=0.002)
    assert detection_bound(CFG, 63 * 4, 0) == pytest.approx(0.07, abs=0.001)


def test_a_dead_spine_takes_every_peers_path_down_and_no_live_one() -> None:
    """Path 1 dead to all 63 peers at once: 63 suspect paths want a probe an
    interval, more than the budget; they go outside it, and each is down
    within the bound, the routine probes of the others going on."""
    net = Net(63, 4, budget=32)
    net.run(0.3)
    cut = net.now
    net.dead = {(k, 1) for k in range(63)}
    net.run(cut + 0.6)
    assert set(net.downs) == net.dead
    assert max(net.downs.values()) - cut <= detection_bound(CFG, 63 * 4, 32)
    # the urgent probes were a burst: a few a dead path (one an interval
    # from its first miss to its third)
    after = sum(1 for ts in net.sent.values() for t in ts if cut <= t < cut + 0.6)
    per_path = CFG.down_after - 1 + CFG.timeout / CFG.interval
    assert after <= 0.6 / 0.01 * 32 + 32 + 63 * per_path


def test_suspect_paths_are_probed_before_routine_ones_that_waited_longer() -> None:
    net = Net(63, 4, budget=32)
    net.run(0.3)
    net.dead = {(7, 2)}
    cut = net.now
    net.run(cut + 0.2)
    down = net.downs[(7, 2)]
    # while suspect its probes went every interval, not every 79 ms
    suspect = [t for t in net.sent[(7, 2)] if cut + 0.02 < t < down]
    assert len(suspect) >= 2
    assert max(b - a for a, b in itertools.pairwise(suspect)) <= 0.012


def test_an_idle_peer_is_not_probed_and_is_again_after_traffic() -> None:
    cfg = HealthConfig(interval=0.01, down_interval=0.05, idle_after=0.05)
    plan: ProbePlan[str] = ProbePlan(8)
    h = PathHealth(2, cfg)
    plan.add("a", h)
    assert plan.next_timer() is None  # no traffic yet
    plan.touched.clear()
    h.touch(0.0)
    assert plan.next_timer() == 0.0 and plan.touched == ["a"]
    now, sent = 0.0, 0
    while now < 0.2:
        for _k, path, seq in plan.due(now):
            sent += 1
            h.on_echo(path, seq, now)
        t = plan.next_timer()
        if t is None:
            break
        now = max(t, now + 1e-6)
    assert t is None and 8 <= sent <= 14  # every 10 ms on 2 paths for 50 ms
    h.touch(1.0)
    t = plan.next_timer()
    assert t is not None and t <= 1.0  # due at once
    assert [p for _k, p, _s in plan.due(1.0)] == [0, 1]


def test_a_pump_with_nothing_due_costs_no_probes_and_the_heaps_stay_small() -> None:
    net = Net(63, 4, budget=32)
    net.run(0.5)
    net.plan.due(net.now)  # what is due now goes: then nothing more is
    assert net.plan.due(net.now) == []
    heaps = net.plan._h
    assert len(heaps.urgent) + len(heaps.routine) <= 2 * 63 * 4
    assert len(heaps.deadlines) <= 2 * 63
    # the wake-ups follow the probes (32 an interval) and their echoes, not
    # peers x paths (252 an interval)
    sent = sum(len(ts) for ts in net.sent.values())
    assert sent <= 0.5 / 0.01 * 32 + 32
    assert net.wakeups <= 2 * sent + 0.5 / 0.005 + 10


def test_the_daemon_setting_probe_budget() -> None:
    assert parse({}).probe_budget == 32
    assert parse({"network": {"probe_budget": 0}}).probe_budget == 0
    for bad in (-1, 1.5, "many", True):
        with pytest.raises(DlcpError, match="probe_budget"):
            parse({"network": {"probe_budget": bad}})
    with pytest.raises(LocalError):
        ProbePlan(-1)
