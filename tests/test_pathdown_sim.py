"""A path that dies under running rounds, in virtual time (tests/switchsim.py).

Three hosts on two paths at 200 Mbit/s, the daemons' configuration as the
benchmark makes it; 0.3 s in, host 0's port on path 0 goes down, 0.6 s later
up again. Before the daemons probed their paths, the round in flight waited
for the port to come back (a DONE, NACK or retransmission that went on the
dead path was lost each time it was sent again there): its time was the
outage's. Now the dead path is out of use within a few probe deadlines, what
urgent went on it is sent again on the live one, and every round completes
in about the time that host's remaining port allows.
"""

from __future__ import annotations

from collections import Counter
from statistics import median

import pytest

from dlcp.core.pathhealth import PathStatus
from tests.switchsim import RunResult, SwitchSim, bench_config, run_rounds

CUT, HEAL = 0.3, 0.9
ROUNDS, ELEMENTS = 12, 1 << 19


def run(probe_interval_s: float, samples: dict[float, Counter[tuple[int, int, int]]]) -> RunResult:
    """The cut and heal, and the packets each host sent per (peer host, path,
    data or not) at each time in `samples`' keys."""
    cfg = bench_config(3, 200e6)
    cfg.probe_interval_s = probe_interval_s

    def sample(t: float) -> tuple[float, object]:
        def take(sim: SwitchSim) -> None:
            c: Counter[tuple[int, int, int]] = Counter()
            for h in sim.hosts:
                for n, peer in h.peers.items():
                    for (cls, path), k in peer.sent_packets.items():
                        c[(h.me, n, path, int(cls != 0))] += k  # type: ignore[index]
            samples[t] = c  # type: ignore[assignment]

        return t, take

    def down(sim: SwitchSim) -> None:
        sim.set_port(0, 0, False)

    def up(sim: SwitchSim) -> None:
        sim.set_port(0, 0, True)

    at = [(CUT, down), (HEAL, up), *(sample(t) for t in samples)]
    return run_rounds(ROUNDS, ELEMENTS, 3, paths=2, config=cfg, at=at)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def probed() -> tuple[RunResult, dict[float, Counter[tuple[int, int, int]]]]:
    samples: dict[float, Counter[tuple[int, int, int]]] = {
        t: Counter() for t in (CUT + 0.1, HEAL - 0.01, HEAL + 0.2)
    }
    return run(0.01, samples), samples


def test_every_round_completes_within_its_bound_with_a_dead_path(
    probed: tuple[RunResult, dict[float, Counter[tuple[int, int, int]]]],
) -> None:
    res, _ = probed
    for rs in res.rounds:
        assert len(rs) == ROUNDS and not [r.failed for r in rs if r.failed]
        # nothing but droppable lanes left out, within the 5 % bound of the
        # three contributions
        assert all(r.lost_lanes <= 0.05 * 3 * ELEMENTS for r in rs)
    assert res.sim.dead_drops > 0  # the port did drop what went to it


def test_the_round_in_flight_at_the_cut_takes_no_longer_than_three_clean_rounds(
    probed: tuple[RunResult, dict[float, Counter[tuple[int, int, int]]]],
) -> None:
    times = probed[0].round_times()
    assert max(times) <= 3 * median(times)
    clean = median(times[:4])
    cut_round = max(times[4:6])
    # the outage itself is 0.6 s (about 9 clean rounds)
    assert cut_round <= 3 * clean


def test_traffic_leaves_the_dead_path_and_comes_back(
    probed: tuple[RunResult, dict[float, Counter[tuple[int, int, int]]]],
) -> None:
    res, samples = probed
    early, late, healed = (samples[t] for t in sorted(samples))

    def data(c: Counter[tuple[int, int, int]], host: int, path: int) -> int:
        return sum(v for (h, n, p, d), v in c.items() if d and p == path and host in (h, n))

    # from shortly after the cut until it heals nothing but probes (class 0)
    # goes to or from host 0 on path 0, while path 1 carries its traffic
    assert data(late, 0, 0) == data(early, 0, 0)
    assert data(late, 0, 1) > data(early, 0, 1)
    # healed: path 0 carries data again
    assert data(healed, 0, 0) > data(late, 0, 0)
    for h in res.sim.hosts:
        for n, peer in h.peers.items():
            assert peer.health is not None
            assert peer.health.statuses() == [PathStatus.UP, PathStatus.UP]
            if 0 in (h.me, n):  # the paths through host 0's dead port went down and up
                assert peer.health.transitions[(0, PathStatus.DOWN)] == 1
                assert peer.health.transitions[(0, PathStatus.UP)] == 1
            else:
                assert peer.health.transitions[(0, PathStatus.DOWN)] == 0


def test_without_probes_the_round_at_the_cut_waits_for_the_port() -> None:
    """What the daemons did before: the cut round lasted until the heal."""
    res = run(0.0, {})
    times = res.round_times()
    assert all(not r.failed for rs in res.rounds for r in rs)
    assert max(times) > HEAL - CUT - 0.1 > 3 * median(times)


def test_a_lossy_path_leaves_the_default_spray_and_every_round_completes() -> None:
    """Not dead but degraded: 40 % loss both ways on host 0's port on path 0
    from 0.2 s. Its probes say so; the default balancer (spray) stops putting
    data on it, the path to and from host 0 stays in use for probes only."""
    cfg = bench_config(3, 200e6)
    seen: dict[str, Counter[int]] = {}

    def lossy(sim: SwitchSim) -> None:
        sim.set_port_loss(0, 0, 0.4)

    def take(name: str) -> tuple[float, object]:
        def sample(sim: SwitchSim) -> None:
            c: Counter[int] = Counter()
            for peer in sim.hosts[0].peers.values():
                for (_cls, path), k in peer.sent_packets.items():
                    c[path] += k
            seen[name] = c

        return (0.6 if name == "a" else 1.0), sample

    res = run_rounds(
        ROUNDS, ELEMENTS, 3, paths=2, config=cfg, at=[(0.2, lossy), take("a"), take("b")]
    )  # type: ignore[list-item]
    for rs in res.rounds:
        assert len(rs) == ROUNDS and not [r.failed for r in rs if r.failed]
    h0 = res.sim.hosts[0]
    for peer in h0.peers.values():
        assert peer.health is not None
        assert peer.health.status(0) != PathStatus.UP  # degraded, or down for a while
        assert peer.health.probe_loss(0) > 0.25
        assert peer.health.transitions[(0, PathStatus.DEGRADED)] >= 1
        assert peer.usable == [False, True]
    # between 0.6 s and 1.0 s host 0 sent (almost) nothing on path 0: only
    # what it had queued there, while path 1 carried its traffic
    on0 = seen["b"][0] - seen["a"][0]
    on1 = seen["b"][1] - seen["a"][1]
    assert on1 > 0 and on0 <= 0.02 * on1, (on0, on1)
