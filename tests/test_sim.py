"""dlcp simulate (dlcp/sim): the event network, a port's strict priority and
queue drops, the TCP model's recovery, a small transpose round's exact sums
through the real engines, determinism for a seed, the CLI's argument errors."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import numpy as np
import pytest

from dlcp.cli import build_parser
from dlcp.core.engine import RoundComplete, RoundFailed
from dlcp.errors import LocalError
from dlcp.sim.cli import settings_of
from dlcp.sim.dlcprun import DlcpRun
from dlcp.sim.events import EventLoop
from dlcp.sim.fabric import Fabric, Topology
from dlcp.sim.host import DlcpHost
from dlcp.sim.port import Packet, Port
from dlcp.sim.run import simulate
from dlcp.sim.scenario import Scenario
from dlcp.sim.settings import Settings
from dlcp.sim.tcp import MIN_RTO, MSS, TcpFlow, deliver


def _port(limits: list[int]) -> tuple[EventLoop, Port, list[Packet]]:
    loop = EventLoop()
    got: list[Packet] = []
    return loop, Port(loop, "p", 8e6, 0.0, limits, got.append), got


def test_port_serves_strict_priority_and_drops_past_a_class_limit() -> None:
    loop, port, got = _port([10] * 7 + [2])
    first = Packet(6, 1000, 0, 1, (port,), "first")
    port.offer(first)  # in service at once
    for i in range(4):
        port.offer(Packet(7, 1000, 0, 1, (port,), f"low{i}"))
    port.offer(Packet(6, 1000, 0, 1, (port,), "mid"))
    port.offer(Packet(0, 1000, 0, 1, (port,), "top"))
    loop.run(10.0)
    assert [p.data for p in got] == ["first", "top", "mid", "low0", "low1"]
    assert port.drops == [0] * 7 + [2]
    # 5 frames of 1000 bytes at 8 Mbit/s: one a millisecond
    assert loop.now == pytest.approx(5e-3)


def test_event_loop_runs_in_time_then_sequence_order() -> None:
    loop = EventLoop()
    seen: list[str] = []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")
    loop.run(5.0)
    assert seen == ["a", "b", "c"]


def _flow(drop: set[int]) -> tuple[EventLoop, TcpFlow, list[tuple[int, float]]]:
    """A flow over a 100 Mbit/s switch whose sender's port drops the data
    segments whose (1-based) sequence of offers is in `drop`, once each."""
    loop = EventLoop()
    fabric = Fabric(loop, Topology(rate_bps=100e6, delay_s=50e-6))
    for _ in range(2):
        fabric.add_endpoint(0, deliver)
    got: list[tuple[int, float]] = []  # (bytes delivered in order, when)

    def on_data(n: int) -> None:
        got.append((n, loop.now))

    flow = TcpFlow(fabric, 0, 1, cls=6, spine=0, on_data=on_data)
    send = fabric.send
    count = [0]

    def lossy(src: int, dst: int, cls: int, wire: int, data: Any, spine: int = 0) -> None:
        if data[1] == 0:  # a data segment (1: an ACK)
            count[0] += 1
            if count[0] in drop:
                return
        send(src, dst, cls, wire, data, spine)

    fabric.send = lossy  # type: ignore[method-assign]
    return loop, flow, got


def test_tcp_fast_retransmit_recovers_a_loss_without_a_timeout() -> None:
    loop, flow, got = _flow({5})
    flow.write(100 * MSS)
    loop.run(10.0)
    assert sum(n for n, _ in got) == 100 * MSS
    assert flow.fast_retransmits == 1 and flow.timeouts == 0
    assert got[-1][1] < MIN_RTO  # done before any timer of 200 ms could fire


def test_tcp_retransmission_timer_recovers_a_lost_retransmission() -> None:
    # a flow of 3 segments: the third and its tail probe are lost; with no
    # duplicate ACKs to come only the RTO (at least 200 ms) brings it
    loop, flow, got = _flow({3, 4})
    flow.write(3 * MSS)
    loop.run(10.0)
    assert sum(n for n, _ in got) == 3 * MSS
    assert flow.timeouts == 1 and flow.fast_retransmits == 0
    assert got[-1][1] >= MIN_RTO


def test_small_transpose_round_completes_with_exact_sums() -> None:
    """4 hosts, no loss bound: every host's result is the sum of the bench's
    four buffers (integers times powers of two: fp32 sums are exact)."""
    s = Settings(hosts=4, rate_bps=100e6, size_bytes=40_000, iters=1, warmup=0, loss_bound=0.0)
    run = DlcpRun(s)
    sums: dict[int, np.ndarray] = {}
    orig = run._on_event

    def keep(host: DlcpHost, ev: RoundComplete | RoundFailed, now: float) -> None:
        if isinstance(ev, RoundComplete):
            sums[host.me] = np.asarray(ev.sums, np.float32).copy()
        orig(host, ev, now)

    for h in run.hosts:
        h.on_event = keep
    steps = run.run()
    assert len(steps) == 1 and not steps[0].failed
    assert steps[0].lost == 0 and sorted(sums) == [0, 1, 2, 3]
    want = np.sum([c.lanes.astype(np.float64) for c in run.parts[0]], axis=0)
    for me, got in sums.items():
        np.testing.assert_array_equal(
            got[: want.size], want.astype(np.float32), err_msg=f"host {me}"
        )


def test_same_seed_same_run_another_seed_another() -> None:
    loss = Scenario("loss", loss_pct=5)
    s = Settings(hosts=3, rate_bps=100e6, size_bytes=200_000, iters=2, warmup=0, scenario=loss)
    a = simulate(s, ["dlcp", "ring"])
    b = simulate(s, ["dlcp", "ring"])
    c = simulate(dataclasses.replace(s, seed=1), ["dlcp", "ring"])
    for x, y in zip(a, b, strict=True):
        assert x["times_s"] == y["times_s"] and x["drops_per_class"] == y["drops_per_class"]
        assert x["random_losses"] == y["random_losses"] and x["events"] == y["events"]
    assert [x["random_losses"] for x in a] != [x["random_losses"] for x in c]


def test_backends_in_processes_of_their_own_give_the_same_records() -> None:
    """`simulate(..., processes=2)`: each backend spawned in a process, the
    records in the backends' order, key for key those of one after the other."""
    loss = Scenario("loss", loss_pct=5)
    s = Settings(hosts=3, rate_bps=100e6, size_bytes=200_000, iters=2, warmup=0, scenario=loss)
    one = simulate(s, ["dlcp", "ring"])
    both = simulate(s, ["dlcp", "ring"], processes=2)
    for x, y in zip(one, both, strict=True):
        x.pop("wall_s"), y.pop("wall_s")
        assert x == y


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hosts", "1"], "--hosts must be at least 2"),
        (["--rate", "fast"], "bad rate 'fast'"),
        (["--size", "big"], "bad size 'big'"),
        (["--topology", "torus"], "--topology: single or leafspine"),
        (["--mode", "tree"], "--mode must be one of transpose, ps, switch"),
        (["--scenario", "storm"], "--scenario must be one of"),
        (["--backends", "gloo"], "--backends: unknown ['gloo']"),
        (["--loss", "150", "--scenario", "loss"], "--loss must be a percentage"),
        (["--oversub", "0.5"], "--oversub must be >= 1"),
        (["--iters", "0"], "--iters must be at least 1"),
    ],
)
def test_cli_arguments_are_checked_with_one_clear_line(argv: list[str], message: str) -> None:
    base = {"--hosts": "3", "--rate": "200mbit", "--size": "1MB"}
    for k, v in zip(argv[::2], argv[1::2], strict=True):
        base[k] = v
    args: argparse.Namespace = build_parser().parse_args(
        ["simulate", *[x for kv in base.items() for x in kv]]
    )
    with pytest.raises(LocalError, match=message.replace("[", r"\[").replace("]", r"\]")):
        settings_of(args)


def test_compare_table_states_each_ratio_against_its_bar(tmp_path: Any) -> None:
    from pathlib import Path

    from dlcp.sim.compare import table

    rec = {"scenario": "clean", "loss_pct": 0.0, "iters": 2, "loss_frac": 0.0}
    sim = Path(tmp_path) / "sim.json"
    bench = Path(tmp_path) / "bench.json"
    sim.write_text(json.dumps([{**rec, "backend": "dlcp", "p50_s": 1.1, "p99_s": 1.5}]))
    bench.write_text(json.dumps([{**rec, "backend": "dlcp", "p50_s": 1.0, "p99_s": 1.0}]))
    row = table([(sim, bench)]).splitlines()[-1]
    assert "1.10 (met)" in row and "1.50 (**not met**)" in row


def test_leafspine_routes_cross_the_named_spine_and_ecmp_is_seeded() -> None:
    loop = EventLoop()
    topo = Topology(kind="leafspine", rate_bps=10e9, hosts_per_leaf=2, spines=4, oversub=2)
    fabric = Fabric(loop, topo, seed=3)
    for n in range(4):
        fabric.add_endpoint(n // 2, lambda p: None)
    assert topo.fabric_bps == 2 * 10e9 / (4 * 2)
    near = fabric.route(0, 1, 2)
    assert [p.tier for p in near] == ["host-up", "host-down"]
    far = [fabric.route(0, 3, s) for s in range(4)]
    assert all(
        [p.tier for p in r] == ["host-up", "leaf-up", "spine-down", "host-down"] for r in far
    )
    assert len({r[1].name for r in far}) == 4  # a path a spine: dlcp's spray
    again = Fabric(EventLoop(), topo, seed=3)
    other = Fabric(EventLoop(), topo, seed=4)
    flows = [(a, b, f) for a in range(4) for b in range(4) for f in range(4) if a != b]
    assert [fabric.ecmp_spine(*x) for x in flows] == [again.ecmp_spine(*x) for x in flows]
    assert [fabric.ecmp_spine(*x) for x in flows] != [other.ecmp_spine(*x) for x in flows]
