"""dlcp simulate's event bookkeeping (dlcp/sim/events.py `Timer`, the ports'
`push`, `Fabric.send_frames`) and the daemons' settings the simulated hosts
take (their MAC): what keeps a 64-host run's heap small without moving any
event in virtual time."""

from __future__ import annotations

from dlcp.core.engine import JobSpec
from dlcp.sim.dlcprun import DlcpRun, daemon_config
from dlcp.sim.events import EventLoop, Timer
from dlcp.sim.fabric import Fabric, Topology
from dlcp.sim.port import Packet
from dlcp.sim.settings import Settings
from dlcp.sim.tcp import MSS, TcpFlow, deliver


def _timer() -> tuple[EventLoop, Timer, list[float]]:
    loop = EventLoop()
    fired: list[float] = []
    return loop, Timer(loop, lambda: fired.append(loop.now)), fired


def test_timer_fires_once_at_its_last_deadline_moved_later_with_one_event() -> None:
    loop, timer, fired = _timer()
    for k in range(1, 101):  # re-armed a hundred times, each later
        timer.set(0.01 * k)
    assert loop.pending() == 1  # not one event a set
    loop.run(10.0)
    assert fired == [1.0] and timer.deadline is None


def test_timer_moved_earlier_fires_then_and_not_again() -> None:
    loop, timer, fired = _timer()
    timer.set(1.0)
    timer.set(0.25)
    loop.run(10.0)
    assert fired == [0.25]


def test_timer_cancelled_does_not_fire_and_can_be_set_again() -> None:
    loop, timer, fired = _timer()
    timer.set(0.5)
    timer.cancel()
    loop.run(1.0)
    assert fired == []
    timer.set(2.0)
    loop.run(10.0)
    assert fired == [2.0]


def test_timer_set_in_its_own_callback_fires_again() -> None:
    loop = EventLoop()
    fired: list[float] = []

    def again() -> None:
        fired.append(loop.now)
        if len(fired) < 3:
            timer.set(loop.now + 0.1)

    timer = Timer(loop, again)
    timer.set(0.1)
    loop.run(10.0)
    assert [round(t, 9) for t in fired] == [0.1, 0.2, 0.3]


def test_a_long_tcp_transfer_keeps_its_timers_at_one_event_each() -> None:
    """Every ACK re-arms the RTO and the tail-loss probe; the heap holds the
    packets on the wire (the rest wait in the ports' queues, not the heap) and
    those two timers, never a stale timer an ACK (an event a set: about 3000
    here)."""
    loop = EventLoop()
    fabric = Fabric(loop, Topology(rate_bps=1e9, delay_s=20e-6))
    for _ in range(2):
        fabric.add_endpoint(0, deliver)
    got: list[int] = []
    flow = TcpFlow(fabric, 0, 1, cls=6, spine=0, on_data=got.append)
    flow.write(2000 * MSS)
    most, t = 0, 0.0
    while loop.pending() and t < 10.0:
        t += 1e-4
        loop.run(t)
        most = max(most, loop.pending())
    assert sum(got) == 2000 * MSS and flow.timeouts == 0
    assert most < 100


def test_send_frames_offers_each_frame_in_order_with_its_wire_bytes() -> None:
    loop = EventLoop()
    fabric = Fabric(loop, Topology(rate_bps=1e9, delay_s=1e-6))
    seen: list[Packet] = []
    for _ in range(2):
        fabric.add_endpoint(0, seen.append)
    frames = [b"a" * 100, b"b" * 1400, b"c" * 7]
    fabric.send_frames(0, 1, 3, frames, 42)
    loop.run(1.0)
    assert [p.data for p in seen] == frames
    assert [p.wire for p in seen] == [142, 1442, 49]
    assert {(p.cls, p.src, p.dst) for p in seen} == {(3, 0, 1)}
    assert fabric.up[0].sent_packets == 3 and fabric.down[1].sent_packets == 3


def test_simulated_jobs_use_the_daemons_mac() -> None:
    run = DlcpRun(Settings(hosts=3, rate_bps=100e6, size_bytes=40_000, iters=1, warmup=0))
    want = daemon_config(3, 100e6).mac
    assert want == "ghash-aes"  # the daemon's default, not JobSpec's
    assert {h.spec.mac for h in run.hosts} == {want}


def test_job_members_kept_and_a_replaced_spec_has_its_own() -> None:
    import dataclasses

    spec = JobSpec.transpose(1, b"k" * 32, 0, 4)
    assert spec.members is spec.members and spec.members == frozenset(range(4))
    ps = dataclasses.replace(spec, owners=(5,), contributors=(0, 1))
    assert ps.members == frozenset({0, 1, 5}) and spec.members == frozenset(range(4))
