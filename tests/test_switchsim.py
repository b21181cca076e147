"""Late rounds: back-to-back all-reduce rounds through the daemon's outbox and a
shaped switch, in virtual time (tests/switchsim.py).

On the testbed (3 hosts, 200 Mbit/s ports, clean) rounds ran at about twice
the line-rate time: a host whose own shard was aggregated sent its results
(classes 1-5) ahead of its remaining droppable data (class 7) and the DONE
held behind that data, so the other hosts' aggregations waited for its whole
result leg; and pacers that count UDP payload only let two senders at link / 2
overfill a port by 2.9 %, so the short class-7 queue overflowed.

Checked here, with the benchmark's daemon config, on a clean switch: (a) every
round completes within SLACK times the line-rate time, (b) with the hosts in
lockstep no lane is lost and the switch drops nothing; with one host 40 ms
behind (a third of this round's line time), at most LOST_BOUND of the lanes:
a few droppable packets are still dropped at the on-time hosts' ports there
(0.36 % of the lanes with the fixes, against 1.8 % at 5bacec6; the testbed's 10 MB
rounds lost none), (c) the outbox never leaves packets queued without
asking to be woken (they would wait for whatever event comes next: a DONE
released by the last packets of its shard in a flush of a lower class once
waited there for the collector's grace, 0.5 s in the benchmark's config at 5bacec6).
"""

from __future__ import annotations

import pytest

from tests.switchsim import run_rounds

HOSTS = 3
LINK_BPS = 200e6
ELEMENTS = 1 << 19  # a 2 MiB fp32 bucket: 1490 packets, a 0.120 s line-rate round
ROUNDS = 3
SLACK = 1.15  # a round may take this much more than the line-rate time
LOST_BOUND = 0.005  # of the lanes, where hosts are out of step


@pytest.mark.parametrize(
    "think",
    [(0.0, 0.0, 0.0), (0.0, 0.0, 0.04)],
    # hosts never run in lockstep: the benchmark's workers decode a round and
    # submit the next on a shared CPU; here host 2 takes 40 ms longer each time
    ids=["lockstep", "host2-40ms-behind"],
)
def test_back_to_back_rounds_run_at_line_rate_without_loss(think: tuple[float, ...]) -> None:
    res = run_rounds(ROUNDS, ELEMENTS, HOSTS, link_bps=LINK_BPS, think=think)
    line = res.line_time
    # a round's time runs from its last submit (no transport completes a round
    # before every contribution is in) to its last completion
    times = [t / line for t in res.round_times()]
    own = [[round((r.end - r.start) / line, 2) for r in rs] for rs in res.rounds]
    lost = [[r.lost_lanes for r in rs] for rs in res.rounds]
    short = [[r.short_lanes for r in rs] for rs in res.rounds]
    failed = [
        f"host {r.host} round {r.round}: {r.failed}" for rs in res.rounds for r in rs if r.failed
    ]
    stalls = [h.stalls for h in res.sim.hosts]
    problems = []
    if failed or [len(rs) for rs in res.rounds] != [ROUNDS] * HOSTS:
        problems.append(f"(a) not every round completed: {failed}")
    if not times or max(times) > SLACK:
        problems.append(f"(a) rounds took {[round(t, 3) for t in times]} x the line-rate time")
    lockstep = not any(think)
    # lanes from every contribution of the bucket, per host and round
    lanes = ELEMENTS * HOSTS
    if any(x > (0 if lockstep else LOST_BOUND * lanes) for rs in lost for x in rs):
        problems.append(f"(b) lanes lost per host and round (RoundComplete.lost_lanes): {lost}")
    if any(x > (0 if lockstep else LOST_BOUND * lanes) for rs in short for x in rs):
        problems.append(f"(b) lanes summed without every contribution, likewise: {short}")
    if res.drops and lockstep:
        problems.append(f"(b) switch drops per class: {dict(sorted(res.drops.items()))}")
    if any(stalls):
        problems.append(f"(c) flushes that left packets queued, no wake-up, per host: {stalls}")
    depth = [p.depth for p in res.sim.down[0]]
    assert not problems, "\n".join(
        [
            *problems,
            f"line-rate round {line * 1e3:.1f} ms; each host's own round times (x line): {own}",
            f"deepest switch queue per downlink and class: {depth}",
        ]
    )


@pytest.mark.parametrize(("loss", "slack"), [(0.01, 1.15), (0.05, 1.30)])
def test_random_loss_costs_a_bounded_share_of_the_round(loss: float, slack: float) -> None:
    """Random loss at every switch port (seeded): every round completes within
    the loss bound, and every round takes at most `slack` x the line-rate
    time. Measured on this tree, rounds 0-2: 1.07x, 1.07x, 1.07x at 1 %;
    1.22x, 1.18x, 1.19x at 5 %. Before, 1.16x, 1.16x, 1.14x and 1.70x, 1.62x,
    1.21x: a lost packet was asked for only at the end of its leg (its
    sender's DONE, then `nack_delay`), and again after `nack_interval` until
    the peer's answers were timed; now as soon as what came after it says it
    is lost (`dlcp.core.stream`), and a lost ACK no longer holds an owner's
    completion for `ack_wait` (ACKs go twice). What remains is the mechanism:
    an owner sends its shard's results only once every required packet of
    the shard is in, so each leg still ends with the last losses' round trip
    while its uplink idles."""
    res = run_rounds(ROUNDS, ELEMENTS, HOSTS, link_bps=LINK_BPS, loss=loss, loss_seed=1)
    failed = [r.failed for rs in res.rounds for r in rs if r.failed]
    assert not failed and [len(rs) for rs in res.rounds] == [ROUNDS] * HOSTS, failed
    assert res.sim.lost > 0
    lanes = ELEMENTS * HOSTS
    lost = [[r.lost_lanes for r in rs] for rs in res.rounds]
    assert all(x <= 0.05 * lanes for rs in lost for x in rs), lost
    times = [t / res.line_time for t in res.round_times()]
    assert max(times) <= slack, [round(t, 3) for t in times]
