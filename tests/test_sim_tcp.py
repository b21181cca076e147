"""The TCP model's SACK blocks and scoreboard, RACK, PRR, TLP and CUBIC with HyStart
(dlcp/sim/tcp.py, tcp_sack.py, tcp_cubic.py), in virtual time: scripted
losses of chosen segments and what the sender does about them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from dlcp.sim.events import EventLoop
from dlcp.sim.fabric import Fabric, Topology
from dlcp.sim.tcp import MIN_RTO, MSS, TcpFlow, deliver
from dlcp.sim.tcp_cubic import BETA
from dlcp.sim.tcp_sack import Reassembly, Scoreboard

Drop = Callable[[int, int], bool]  # (segment index, its nth transmission from 1) -> lose it


def _flow(
    drop: Drop, *, rate_bps: float = 100e6, queue: int = 1000, drop_ack: Drop | None = None
) -> tuple[EventLoop, Fabric, TcpFlow, list[tuple[int, float]]]:
    """A flow over one switch whose sender's data segments are lost where
    `drop` says, and its ACKs where `drop_ack` says (by the segment that
    made the ACK and that segment's nth arrival)."""
    loop = EventLoop()
    fabric = Fabric(loop, Topology(rate_bps=rate_bps, delay_s=25e-6, queue_packets=queue))
    for _ in range(2):
        fabric.add_endpoint(0, deliver)
    got: list[tuple[int, float]] = []
    flow = TcpFlow(fabric, 0, 1, cls=6, spine=0, on_data=lambda n: got.append((n, loop.now)))
    send = fabric.send
    sent: Counter[int] = Counter()
    acked: Counter[int] = Counter()

    def lossy(src: int, dst: int, cls: int, wire: int, data: Any, spine: int = 0) -> None:
        if data[1] == 0:
            k = data[2] // MSS
            sent[k] += 1
            if drop(k, sent[k]):
                return
        elif drop_ack is not None:
            k = data[4] // MSS
            acked[k] += 1
            if drop_ack(k, acked[k]):
                return
        send(src, dst, cls, wire, data, spine)

    fabric.send = lossy  # type: ignore[method-assign]
    return loop, fabric, flow, got


def _send_all(loop: EventLoop, flow: TcpFlow, got: list[tuple[int, float]], segments: int) -> None:
    """`segments` written and the run to its end: every byte came out."""
    flow.write(segments * MSS)
    loop.run(10.0)
    assert sum(n for n, _ in got) == segments * MSS


def test_many_holes_in_one_window_recover_in_one_episode_without_a_timeout() -> None:
    # seven segments of one window lost: the scoreboard sends each once, no RTO
    holes = {40, 43, 44, 50, 61, 62, 70}
    loop, _, flow, got = _flow(lambda k, n: k in holes and n == 1)
    _send_all(loop, flow, got, 300)
    assert flow.timeouts == 0 and flow.fast_retransmits == 1
    assert flow.retransmits == len(holes) and flow.sb.marked == len(holes)
    assert got[-1][1] < MIN_RTO


def test_a_lost_retransmission_is_resent_by_rack_before_the_rto() -> None:
    # segment 20 is lost, and its first retransmission too: RACK finds that
    # from the later segments' SACKs, not the 200 ms timer
    loop, _, flow, got = _flow(lambda k, n: k == 20 and n <= 2)
    _send_all(loop, flow, got, 200)
    assert flow.timeouts == 0 and flow.retransmits == 2
    assert got[-1][1] < MIN_RTO


@pytest.mark.parametrize(("holes", "acks_lost"), [({40, 42}, {41}), ({40, 42, 44}, {41, 43})])
def test_lost_acks_sack_blocks_come_again_in_the_next_ack(
    holes: set[int], acks_lost: set[int]
) -> None:
    # the ACKs of 41 (and 43) are lost: the next ACK's second (and third) block
    # says they are held, so only the holes go again (with one block RACK
    # would take 41 and 43 as lost too: sent before a cell SACKed later)
    loop, _, flow, got = _flow(
        lambda k, n: k in holes and n == 1, drop_ack=lambda k, n: k in acks_lost and n == 1
    )
    _send_all(loop, flow, got, 200)
    assert flow.timeouts == 0 and flow.fast_retransmits == 1
    assert flow.retransmits == len(holes) and flow.sb.marked == len(holes)
    assert got[-1][1] < MIN_RTO


def test_an_in_order_arrivals_ack_repeats_the_blocks_beyond() -> None:
    # 40 and 50 lost, and the first ACK of every cell from 51 on: the ACK of
    # 40's retransmission (in order) says 51.. are held, so RACK does not take
    # them for lost (sent before that retransmission)
    loop, _, flow, got = _flow(
        lambda k, n: k in (40, 50) and n == 1, drop_ack=lambda k, n: 50 < k < 70 and n == 1
    )
    _send_all(loop, flow, got, 200)
    assert flow.timeouts == 0 and flow.retransmits == flow.sb.marked == 2
    assert got[-1][1] < MIN_RTO


def test_a_lost_tail_is_found_by_the_probe_not_the_rto() -> None:
    # the last segment of a write is lost: no ACK follows it, the probe goes
    loop, _, flow, got = _flow(lambda k, n: k == 29 and n == 1)
    _send_all(loop, flow, got, 30)
    assert flow.probes == 1 and flow.timeouts == 0
    assert got[-1][1] < MIN_RTO


def test_prr_ends_recovery_at_the_cubic_cut_of_the_window() -> None:
    entered: list[float] = []  # the window as recovery began
    left: list[float] = []  # ... and as it ended
    loop, _, flow, _ = _flow(lambda k, n: k == 300 and n == 1)
    enter, on_ack = flow._enter_recovery, flow._on_ack

    def spy_enter() -> None:
        entered.append(flow.cwnd)
        enter()

    def spy_ack(*args: Any) -> None:
        before = flow.state
        on_ack(*args)
        if before != flow.state == 0:
            left.append(flow.cwnd)

    flow._enter_recovery = spy_enter  # type: ignore[method-assign]
    flow._on_ack = spy_ack  # type: ignore[method-assign]
    flow.write(600 * MSS)
    loop.run(10.0)
    assert flow.fast_retransmits == 1 and flow.timeouts == 0
    assert len(entered) == len(left) == 1 and entered[0] > 10
    # ssthresh is the cut; recovery hands over at it (the same ACK then grows it a little)
    assert flow.cc.ssthresh == pytest.approx(entered[0] * BETA)
    assert left[0] == pytest.approx(entered[0] * BETA, rel=0.01)


def test_hystart_leaves_slow_start_before_the_queue_overflows() -> None:
    # a long transfer into a 200 Mbit/s port with the tc plan's 1000 packets:
    # Reno's slow start doubled past the queue; HyStart stops it on the way
    loop, fabric, flow, got = _flow(lambda k, n: False, rate_bps=200e6)
    _send_all(loop, flow, got, 20_000)
    assert flow.cc.found and flow.cc.ssthresh < 1000
    assert sum(fabric.down[1].drops) == 0 and flow.retransmits == 0


def test_without_hystart_slow_start_overflows_the_queue() -> None:
    # the same transfer into a short queue with HyStart kept off: drops
    loop, fabric, flow, got = _flow(lambda k, n: False, rate_bps=200e6, queue=100)
    flow.cc.found = True  # as if HyStart had fired and reset: it stays off
    _send_all(loop, flow, got, 3000)
    assert sum(fabric.down[1].drops) > 0 and flow.retransmits > 0


@pytest.mark.parametrize(
    ("segments", "blocks", "nxt"),
    [
        ([(0, 10)], [()], 10),
        ([(0, 10), (20, 30), (40, 50)], [(), ((20, 30),), ((40, 50), (20, 30))], 10),
        ([(20, 30), (30, 40), (10, 20)], [((20, 30),), ((20, 40),), ((10, 40),)], 0),
        ([(20, 30), (40, 50), (30, 40)], [((20, 30),), ((40, 50), (20, 30)), ((20, 50),)], 0),
        ([(20, 30), (0, 20)], [((20, 30),), ()], 30),
        # a duplicate's ACK: the D-SACK takes a slot
        ([(20, 30), (20, 30), (0, 5)], [((20, 30),), ((20, 30),), ((20, 30),)], 5),
        ([(0, 10), (0, 10)], [(), ()], 10),
        # the block of the arrival first, then the most recent others, three at most
        (
            [(10, 20), (30, 40), (50, 60), (70, 80), (35, 45)],
            [
                ((10, 20),),
                ((30, 40), (10, 20)),
                ((50, 60), (30, 40), (10, 20)),
                ((70, 80), (50, 60), (30, 40)),
                ((30, 45), (70, 80), (50, 60)),
            ],
            0,
        ),
        # an in-order arrival's ACK repeats the blocks still held
        ([(10, 20), (30, 40), (0, 10)], [((10, 20),), ((30, 40), (10, 20)), ((30, 40),)], 20),
    ],
)
def test_reassembly_reports_the_block_of_each_arrival_then_the_latest_others(
    segments: list[tuple[int, int]], blocks: list[tuple[tuple[int, int], ...]], nxt: int
) -> None:
    r = Reassembly()
    got = []
    for a, b in segments:
        r.add(a, b)
        got.append(r.blocks())
    assert got == blocks
    assert r.nxt == nxt


def test_rack_marks_what_was_sent_before_a_delivered_cell_once_its_window_passes() -> None:
    sb = Scoreboard()
    for k in range(5):
        sb.sent(k, 0.001 * k)
    # cell 3 (sent at 3 ms) is SACKed at 4 ms, a round trip of 1 ms
    assert sb.sack(((3 * MSS, 4 * MSS),), 10 * MSS) == 1
    sb.delivered(3, 0.003, 0.004)
    # cells 0..2 were sent before it: due at their send + 1 ms + the window
    assert sb.detect(0.004, 0.0015) == pytest.approx(0.0045)  # cell 2 waits
    assert sorted(sb.lost) == [0, 1] and 4 in sb.flight
    assert sb.detect(0.0046, 0.0015) is None  # cell 4 was sent after cell 3
    assert sorted(sb.lost) == [0, 1, 2] and sb.pipe == 1
    assert [sb.next_lost(), sb.next_lost(), sb.next_lost(), sb.next_lost()] == [0, 1, 2, None]


def test_sack_marks_every_block_and_not_a_partly_held_cell() -> None:
    sb = Scoreboard()
    for k in range(12):
        sb.sent(k, 0.0)
    # cells 3..5 held (the ACKs of 3 and 4 were lost): the ACK of 5 marks all three
    assert sb.sack(((3 * MSS, 6 * MSS),), 12 * MSS) == 3
    assert sb.sacked == {3, 4, 5} and sb.pipe == 9
    # a block from inside cell 6 does not make cell 6 held
    assert sb.sack(((6 * MSS + 100, 8 * MSS), (3 * MSS, 6 * MSS)), 12 * MSS) == 1
    assert sb.sacked == {3, 4, 5, 7}
    # a new block first, the old one repeated: only the new cell counts
    assert sb.sack(((9 * MSS, 10 * MSS), (3 * MSS, 6 * MSS)), 12 * MSS) == 1
    assert sb.sacked == {3, 4, 5, 7, 9}
    # a second and third block tell what lost ACKs would have
    assert sb.sack(((11 * MSS, 12 * MSS), (9 * MSS, 10 * MSS), (1 * MSS, 2 * MSS)), 12 * MSS) == 2
    assert sb.sacked == {1, 3, 4, 5, 7, 9, 11}
    # the cumulative ACK of 0..5 delivers the two not SACKed
    assert sb.ack_to(6, False) == 2 and sb.sacked == {7, 9, 11} and list(sb.flight) == [6, 8, 10]
