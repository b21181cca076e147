"""A round's phases (`dlcp.core.round`), the table of open rounds
(`dlcp.core.rounds.OpenRounds`, through the engine that drives it) and the
closed-round memory (`dlcp.core.closed.ClosedRounds`), each built through its
constructor."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dlcp.core.closed import ClosedRounds
from dlcp.core.engine import Engine, JobSpec, RoundComplete
from dlcp.core.round import TRANSITIONS, Phase, Round, Step
from dlcp.core.timing import Timing
from dlcp.errors import LocalError
from dlcp.wire import Codec
from tests.netsim import Network

KEY = b"k" * 32
JOB = 7


def _spec(me: int = 0, hosts: int = 2, window: int = 8) -> JobSpec:
    return JobSpec.transpose(JOB, KEY, me, hosts, window=window)


# -- the phase table ---------------------------------------------------------
@pytest.mark.parametrize(("phase", "step"), list(itertools.product(Phase, Step)))
def test_a_round_moves_only_by_the_table(phase: Phase, step: Step) -> None:
    r = Round(_spec(), (JOB, 0, 0))
    r.phase = phase
    want = TRANSITIONS.get((phase, step))
    if want is None:
        with pytest.raises(LocalError, match=step.value):
            r.move(step)
        assert r.phase is phase
    else:
        r.move(step)
        assert r.phase is want


def test_a_round_begins_aggregating_and_is_idle_until_it_holds_something() -> None:
    r = Round(_spec(), (JOB, 3, 1))
    assert r.phase is Phase.AGGREGATING and r.idle()
    r.gathered.append([b"x"])
    assert not r.idle()
    r.gathered.clear()
    r.move(Step.SUBMIT)
    assert r.phase is Phase.OPEN and not r.idle()  # an open round is live however empty
    r.move(Step.HOLD)
    assert not r.idle()
    r.move(Step.RELEASE)
    assert r.phase is Phase.CLOSED and r.idle()


# -- the closed-round memory -------------------------------------------------
def test_closed_rounds_say_what_is_late_and_forget_it_after_retain() -> None:
    spec = _spec()
    closed = ClosedRounds(Timing(retain=0.5))
    op = (JOB, 4, 0)
    assert not closed.is_late(spec, op, 0) and closed.next_expiry() is None
    closed.close_round(op, 1.0)
    assert closed.round_closed(op) and closed.is_late(spec, op, 1)
    closed.shard_aggregated(spec, (JOB, 5, 0), 1, 1.2)
    assert closed.is_late(spec, (JOB, 5, 0), 1) and not closed.is_late(spec, (JOB, 5, 0), 0)
    assert closed.next_expiry() == pytest.approx(1.5)
    closed.expire(1.6)
    assert not closed.round_closed(op) and not closed.is_late(spec, op, 1)
    assert closed.next_expiry() == pytest.approx(1.7)
    closed.expire(1.7)
    # the bitmap still says shard 1 of round 5 closed, for the whole window
    assert not closed.shards and closed.is_late(spec, (JOB, 5, 0), 1)


def test_the_bitmap_covers_the_window_and_what_lies_behind_it() -> None:
    spec = _spec(window=8)
    closed = ClosedRounds(Timing())
    for rnd in (10, 12, 18):
        closed.close_shard(spec, (JOB, rnd, 2), 0)
    late = [rnd for rnd in range(0, 20) if closed.is_late(spec, (JOB, rnd, 2), 0)]
    # 10 and 12 closed, 18 the highest; below 18 - 8 = 10 nothing can be live
    assert late == [*range(0, 10), 10, 12, 18]
    assert not closed.is_late(spec, (JOB, 12, 3), 0)  # another bucket
    closed.close_shard(None, (JOB, 19, 2), 0)  # a job no longer here: nothing kept
    assert not closed.is_late(spec, (JOB, 19, 2), 0)


def test_seeing_newer_rounds_prunes_entries_behind_the_window() -> None:
    spec = _spec(window=8)
    closed = ClosedRounds(Timing())
    closed.see(spec, JOB, 1)
    closed.close_shard(spec, (JOB, 1, 0), 0)
    closed.close_shard(spec, (JOB, 30, 1), 0)
    closed.see(spec, JOB, 30)
    assert closed.newest[JOB] == 30
    assert list(closed.bitmaps[JOB]) == [(1, 0)]  # (0, 0): 1 + 8 < 30, dropped
    closed.forget_job(JOB)
    assert not closed.bitmaps and JOB not in closed.newest


# -- the table of open rounds, driven by the engine ---------------------------
def _engines(timing: Timing | None = None) -> dict[int, Engine]:
    out = {}
    for me in range(2):
        e = Engine(timing=timing)
        e.add_job(JobSpec.transpose(JOB, KEY, me, 2))
        out[me] = e
    return out


def test_a_round_is_open_from_submit_to_its_end_then_leaves_the_table() -> None:
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(3000).astype(np.float32) for _ in range(2)]
    net = Network(_engines(), seed=3)
    op = (JOB, 0, 0)
    for me, x in enumerate(xs):
        e = net.engines[me]
        e.submit(job=JOB, round=0, bucket=0, codec=Codec.FP32, total=x.size,
                 lanes=x.tobytes(), now=0.0)  # fmt: skip
        r = e.rounds.get(op)
        assert r is not None and r.phase is Phase.OPEN and r.contribution is not None
        assert e.pending_rounds() == 1
    net.run(until=1.0)  # well within `retain`
    for me, e in net.engines.items():
        (ev,) = net.events[me]
        assert isinstance(ev, RoundComplete)
        np.testing.assert_array_equal(ev.sums, xs[0] + xs[1])
        assert e.pending_rounds() == 0 and e.closed.round_closed(op)
        r = e.rounds.get(op)
        # what may remain is the finished shard kept for the peer's NACKs
        assert r is None or (r.phase is Phase.CLOSED and not r.aggs and r.contribution is None)
    net.run(until=net.now + 60.0)
    for e in net.engines.values():
        e.handle_timer(net.now)
        assert not e.rounds.table and not e.closed.rounds and e.get_timer() is None


def test_removing_a_job_fails_its_open_rounds_and_empties_the_table() -> None:
    e = _engines()[0]
    x = np.ones(3000, np.float32)
    for bucket in range(3):
        e.submit(job=JOB, round=0, bucket=bucket, codec=Codec.FP32, total=x.size,
                 lanes=x.tobytes(), now=0.0)  # fmt: skip
    assert e.pending_rounds() == 3
    e.remove_job(JOB, 1.0)
    reasons = [(ev.bucket, getattr(ev, "reason", None)) for ev in iter(e.next_event, None)]
    assert reasons == [(0, "job removed"), (1, "job removed"), (2, "job removed")]
    assert not e.rounds.table and not e.closed.rounds and e.pending_rounds() == 0
