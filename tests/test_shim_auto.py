"""codec="auto": the decision logic without sockets, and one run over real daemons.

The unit tests drive `AutoCodec` as the hook does (bucket sizes and hook
times in, steps ended), with a made-up calibration so that the expected
codec follows from the cost model alone; the ranks' agreement is played by
averaging their vectors here as `DlcpState` does over the process group.
"""

from __future__ import annotations

import copyreg
import math
import pickle
import statistics
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dlcp.shim as dlcp
from dlcp.costmodel.calibrate import Calibration, CodecCost, Linear, default_cache
from dlcp.costmodel.model import choose_codec
from dlcp.errors import LocalError
from dlcp.shim.auto import (
    UNAVAILABLE_S,
    AutoCodec,
    correction,
    error_penalty,
    host_calibration,
    judge,
    link_from_status,
    payback_step,
    pick,
)
from dlcp.shim.auto_measure import Measurements
from tests.daemons import loopback_daemons
from tests.test_shim import make_model, reference_grads, spawn, train_steps

# DDP-like buckets of a 1M-value model: sizes in backward order, ready times (s)
BUCKETS = [(262_144, 0.002), (524_288, 0.006), (266_762, 0.009)]


def cost(
    spec: str, push: float, pull: float, cpu_per_value: float, err: float, scale: float = 1.0
) -> CodecCost:
    per = Linear(2e-5 * scale, cpu_per_value * scale)
    return CodecCost(spec, (push,), (pull,), per, per, per, err, 3)


def calibration(scale: float = 1.0) -> Calibration:
    """Costs shaped like this machine's (`dlcp plan`): compression costs CPU."""
    return Calibration(
        codecs={
            "fp32": cost("fp32", 4.0, 4.0, 1e-9, 0.0, scale),
            "fp16": cost("fp16", 2.0, 2.0, 1.5e-8, 1e-4, scale),
            "thc8": cost("thc8", 1.0, 1.6, 2.2e-8, 0.12, scale),
            "thc4": cost("thc4", 0.5, 1.2, 2.4e-8, 1.7, scale),
        }
    )


def feed_step(
    auto: AutoCodec,
    buckets: Sequence[tuple[int, float]] = BUCKETS,
    *,
    t0: float = 100.0,
    hook_s: float = 0.003,
    sent: Sequence[tuple[int, float, float]] = (),
    took: float | None = None,
) -> None:
    """One backward pass as the hook reports it: each bucket enters the hook when
    ready (after the hook time of the ones before) and spends `hook_s` in it;
    `sent`: the exchanges with the daemon (values, submitted, replied); `took`:
    when the step's results are in, seconds after backward began."""
    spent = 0.0
    for numel, ready in buckets:
        auto.bucket_entered(numel, t0 + ready + spent)
        spent += hook_s
        auto.bucket_left(t0 + ready + spent)
    auto.end_step(sent, hosts=3, now=None if took is None else t0 + took)


def decide(ranks: Sequence[AutoCodec], hosts: int = 3) -> list[str]:
    """The agreement as `AutoDriver.step` runs it: average, pick, MAX."""
    vectors = [r.local_times(hosts) for r in ranks]
    mean = torch.tensor(vectors, dtype=torch.float32).sum(0) / len(ranks)
    times = mean.tolist()
    agreed = max(r.proposal(times) for r in ranks)
    for r in ranks:
        r.adopt(agreed, times)
    return [r.current for r in ranks]


def ready_auto(link_bps: float | None = None, **kw: Any) -> AutoCodec:
    # the decisions as designed for fp32, by time alone: a codec's error costs
    # nothing and a trial needs no payback and has no budget (their tests set them)
    kw = {
        "warmup_codec": "fp32",
        "warmup": 2,
        "error_cost": 0.0,
        "payback": 0.0,
        "explore_budget": None,
        **kw,
    }
    auto = AutoCodec(link_bps=link_bps, **kw)
    auto.calibration = calibration()
    return auto


# -- pick and the link rate ------------------------------------------------------------

PICK_CASES = [
    # (times, min_gain, expected): the first (most accurate) within the gain wins
    ([4.0, 3.0, 2.0, 1.0], 0.05, "thc4"),
    ([1.0, 1.0, 1.0, 1.0], 0.0, "fp32"),  # ties go to the earlier candidate
    ([1.03, 9.0, 1.0, 0.99], 0.05, "fp32"),
    ([1.05, 9.0, 1.0, 0.99], 0.05, "thc8"),
    ([2.0, 1.2, 1.0, UNAVAILABLE_S], 0.05, "thc8"),
    ([2.0, 1.2, 1.0, UNAVAILABLE_S], 0.25, "fp16"),
    ([UNAVAILABLE_S] * 4, 0.05, "fp32"),
]


@pytest.mark.parametrize(("times", "gain", "want"), PICK_CASES)
def test_pick(times: list[float], gain: float, want: str) -> None:
    assert pick(times, ("fp32", "fp16", "thc8", "thc4"), gain) == want


def test_pick_wants_one_time_per_candidate() -> None:
    with pytest.raises(LocalError):
        pick([1.0], ("fp32", "thc8"))


def test_link_rate_is_the_sum_of_this_jobs_peer_rates() -> None:
    status = {
        "peers": [
            {"peer": "10.0.0.2:7000", "rate_bps": 100e6},
            {"peer": "10.0.0.3:7000", "rate_bps": 100e6},
            {"peer": "10.9.9.9:7000", "rate_bps": 5e9},  # another job's peer
        ]
    }
    assert link_from_status(status, ["10.0.0.2:7000", "10.0.0.3:7000"]) == 200e6
    assert link_from_status(status) == 5.2e9
    assert link_from_status({"peers": []}, ["10.0.0.2:7000"]) is None


def test_link_rate_from_env_or_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLCP_LINK_BPS", "200mbit")
    auto = AutoCodec()
    assert auto.fixed_link_bps == 200e6 and not auto.reads_link
    auto.observe_link(1e9)  # a fixed rate is not overridden by the daemon's
    assert auto.link_bps == 200e6
    assert AutoCodec(link_bps=1e9).link_bps == 1e9
    monkeypatch.delenv("DLCP_LINK_BPS")
    assert AutoCodec().reads_link


@pytest.mark.parametrize(
    "kw",
    [
        {"candidates": ["fp32", "fft-sim"]},  # not a wire codec
        {"candidates": []},
        {"every": 0},
        {"warmup": 0},
        {"min_gain": -1.0},
        {"cpu_share": 0.0},
        {"link_bps": "fast"},
        {"link_bps": -5.0},
        {"error_cost": -1.0},
        {"error_cost": float("nan")},
        {"payback": -1.0},
        {"explore_budget": -0.1},
        {"explore_budget": float("inf")},
    ],
)
def test_bad_settings_are_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(LocalError):
        AutoCodec(**kw)


# -- learning and deciding ------------------------------------------------------------------


def test_profile_is_learned_from_the_hook_times() -> None:
    auto = ready_auto()
    assert auto.profile() is None
    feed_step(auto)
    prof = auto.profile()
    assert prof is not None
    assert [b.numel for b in prof.buckets] == [n for n, _ in BUCKETS]
    # time inside the hook is not backward; the first bucket is extrapolated by size
    gaps = [0.004, 0.003]
    first = sum(gaps) * BUCKETS[0][0] / sum(n for n, _ in BUCKETS[1:])
    want = [first, first + gaps[0], first + sum(gaps)]
    assert [b.ready_s for b in prof.buckets] == pytest.approx(want)
    assert prof.backward_s == pytest.approx(want[-1])
    # medians over the last steps of the same shape: one slow step changes nothing
    feed_step(auto)
    feed_step(auto, [(n, 10 * r) for n, r in BUCKETS])
    again = auto.profile()
    assert again is not None and again.backward_s == pytest.approx(want[-1])


def test_a_failed_step_is_forgotten() -> None:
    auto = ready_auto()
    auto.bucket_entered(123, 1.0)
    auto.bucket_left(1.5)
    auto.discard_step()
    feed_step(auto)
    prof = auto.profile()
    assert auto.steps == 1 and prof is not None
    assert [b.numel for b in prof.buckets] == [n for n, _ in BUCKETS]


def test_warmup_codec_until_the_first_decision_then_every_k_steps() -> None:
    auto = ready_auto(200e6, warmup=2, every=3)
    schedule = []
    for _ in range(9):
        assert auto.current == (auto.codec or "fp32")
        feed_step(auto)
        schedule.append(auto.scheduled())
        if auto.scheduled():
            decide([auto])
    assert schedule == [False, True, False, False, True, False, False, True, False]
    assert auto.decisions == 3 and auto.codec == "thc4" and auto.switches == 0
    assert auto.history == [[2, "thc4"]]


@pytest.mark.parametrize("link", [20e6, 100e6, 200e6, 1e9, 3e9, 10e9, None])
def test_auto_picks_what_the_cost_model_says(link: float | None) -> None:
    auto = ready_auto(link)
    feed_step(auto)
    [chosen] = decide([auto])
    prof = auto.profile()
    assert prof is not None
    want = choose_codec(
        prof, link, hosts=3, calibration=calibration(), candidates=["fp32", "fp16", "thc8", "thc4"]
    )
    assert chosen == want


def test_slow_links_compress_fast_links_do_not() -> None:
    slow, fast = ready_auto(200e6), ready_auto(10e9)
    feed_step(slow)
    feed_step(fast)
    assert decide([slow]) == ["thc4"]
    assert slow.predicted["thc4"] < slow.predicted["thc8"] < slow.predicted["fp32"]
    assert decide([fast]) == ["fp32"]
    careful = ready_auto(200e6, max_rel_error=0.5)  # thc4's one-round error is too large
    feed_step(careful)
    assert decide([careful]) == ["thc8"]
    assert careful.describe()["predicted_s"]["thc4"] is None


def exchanges(
    goodput_bps: float, per_value: float = 8.0, hosts: int = 3
) -> list[tuple[int, float, float]]:
    """The step's buckets in flight one after another at `goodput_bps` (fp32 bytes)."""
    out: list[tuple[int, float, float]] = []
    t = 200.0
    for numel, _ in BUCKETS:
        dur = 0.003 + numel * per_value * (hosts - 1) / hosts * 8 / goodput_bps
        out.append((numel, t, t + dur))
        t += dur
    return out


def test_measured_goodput_caps_the_link_rate() -> None:
    auto = ready_auto(10e9)
    for _ in range(3):
        auto.bucket_entered(BUCKETS[0][0], 1.0)  # (the profile is not the point here)
        auto.end_step(exchanges(150e6), hosts=3)
    assert auto.goodput_bps == pytest.approx({"fp32": 150e6}, rel=1e-6)
    assert auto.network().push_bytes_s == pytest.approx(150e6 / 8)
    assert decide([auto]) == ["thc4"]  # a daemon that moves 150 Mbit/s on a 10 Gbit/s link
    blind = ready_auto(10e9, measure=False)
    blind.bucket_entered(BUCKETS[0][0], 1.0)
    blind.end_step(exchanges(150e6), hosts=3)
    assert decide([blind]) == ["fp32"]
    # a measurement above the link rate does not raise it
    fast = ready_auto(200e6)
    fast.bucket_entered(BUCKETS[0][0], 1.0)
    fast.end_step(exchanges(5e9), hosts=3)
    assert fast.network().push_bytes_s == pytest.approx(200e6 * 0.95 / 8)


def test_codecs_that_ran_are_judged_by_their_measured_iterations() -> None:
    # the model (an idle host's calibration) favours thc4; this host's iterations
    # say fp16: auto tries what the model favours and settles on what ran fastest
    took = {"fp32": 0.9, "fp16": 0.4, "thc8": 0.55, "thc4": 0.6}
    auto = ready_auto(200e6, warmup=2, every=1000, window=3, explore=0.6)  # tries them all
    for step in range(30):
        feed_step(auto, t0=10.0 * step, took=took[auto.current])
        if auto.scheduled():
            decide([auto])
    tried = [c for _, c in auto.history]
    assert tried[0] == "thc4" and auto.current == "fp16"
    assert len(tried) == len(set(tried))  # each codec tried once
    for c in tried:
        assert auto.measured(c) == pytest.approx(took[c], abs=0.005)
    assert auto.predicted["fp16"] == pytest.approx(took["fp16"], abs=0.005)
    assert auto.measured("fp32") == pytest.approx(took["fp32"], abs=0.005)  # step 1 only
    assert len(auto.describe()["measured_s"]) == len(tried) + 1


def run_auto(auto: AutoCodec, took: dict[str, Any], steps: int) -> list[str]:
    """`steps` steps of one rank; `took[codec]`: its iteration seconds, or a list
    of them (one per step in that codec, the last repeated). Returns the codec
    of every step."""
    ran: list[str] = []
    for step in range(steps):
        c = auto.current
        t = took[c]
        if isinstance(t, list):
            t = t[min(ran.count(c), len(t) - 1)]
        ran.append(c)
        feed_step(auto, t0=10.0 * step, took=t)
        if auto.scheduled():
            decide([auto])
    return ran


def test_judge_corrects_untried_codecs_by_the_measured_ones() -> None:
    cands = ("fp32", "fp16", "thc8", "thc4")
    pred = {"fp32": 0.1, "fp16": 0.08, "thc8": 0.05, "thc4": 0.04}
    # nothing measured: the model's predictions as they are
    assert judge(cands, pred, {}, 0.15) == (list(pred.values()), None)
    # fp32 took 3x its prediction: the others are corrected by 3 and made
    # optimistic by the margin; a codec without a prediction cannot be chosen
    times, factor = judge(
        cands, {k: v for k, v in pred.items() if k != "thc4"}, {"fp32": 0.3}, 0.15
    )
    assert factor == pytest.approx((3.0, 3.0))
    assert times == pytest.approx([0.3, 0.24 / 1.15, 0.15 / 1.15, UNAVAILABLE_S])
    # without the CPU parts: one factor, the median over the measured codecs
    times, factor = judge(cands, pred, {"fp32": 0.3, "fp16": 0.16, "thc8": 0.5}, 0.0)
    assert factor == pytest.approx((3.0, 3.0))
    assert times == pytest.approx([0.3, 0.16, 0.5, 0.12])


def test_the_correction_separates_cpu_work_from_the_rest() -> None:
    # the model's CPU seconds are 3x too low (cores shared), the rest 1.2x:
    # two measured codecs with different CPU shares give both factors, and
    # the untried codecs' corrected predictions are their true times
    cands = ("fp32", "fp16", "thc8", "thc4")
    cpu = {"fp32": 0.002, "fp16": 0.01, "thc8": 0.03, "thc4": 0.032}
    rest = {"fp32": 0.2, "fp16": 0.1, "thc8": 0.06, "thc4": 0.04}
    pred = {c: cpu[c] + rest[c] for c in cands}
    truth = {c: 3.0 * cpu[c] + 1.2 * rest[c] for c in cands}
    seen = {c: truth[c] for c in ("fp16", "thc8")}
    times, factor = judge(cands, pred, seen, 0.0, cpu)
    assert factor == pytest.approx((3.0, 1.2))
    assert times == pytest.approx([truth[c] for c in cands])
    # one measured codec, or two with the same CPU share: one factor for both
    assert correction(pred, cpu, {"fp16": truth["fp16"]}) == pytest.approx(
        (truth["fp16"] / pred["fp16"],) * 2
    )
    same = {"a": 0.1, "b": 0.2}
    both = correction(same, {"a": 0.05, "b": 0.1}, {"a": 0.2, "b": 0.5})
    assert both == pytest.approx((2.25, 2.25))  # the median of 2 and 2.5
    # a fit that would make a factor negative falls back to the median
    assert correction(pred, cpu, {"fp16": 0.5, "thc8": 0.01}) == pytest.approx(
        (statistics.median([0.5 / pred["fp16"], 0.01 / pred["thc8"]]),) * 2
    )


def test_codecs_the_corrected_model_puts_well_behind_are_never_tried() -> None:
    # 1 Gbit/s: the model puts fp16 17 % and THC 30 % behind fp32; fp32 runs
    # at 2x its prediction, and (unknown to auto) the others would be faster
    took = {"fp32": 0.12, "fp16": 0.05, "thc8": 0.05, "thc4": 0.05}
    auto = ready_auto(1e9, warmup=2, every=10, explore=0.15)
    assert run_auto(auto, took, 30) == ["fp32"] * 30
    assert auto.explored_steps == 0 and set(auto.describe()["measured_s"]) == {"fp32"}
    assert auto.correction == pytest.approx((took["fp32"] / 0.0615,) * 2, rel=0.05)
    # with a wider margin, fp16 (within 50 % once corrected) is worth a try, and kept
    bold = ready_auto(1e9, warmup=2, every=10, explore=0.5)
    ran = run_auto(bold, took, 30)
    assert ran[:2] == ["fp32", "fp32"] and ran[2:] == ["fp16"] * 28
    assert bold.explored_steps == 0


def test_a_clearly_worse_trial_ends_after_its_probe_steps() -> None:
    took = {"fp32": 0.5, "fp16": 0.6, "thc8": 0.6, "thc4": 0.9}
    auto = ready_auto(200e6, warmup=2, every=1000, probe=2)
    ran = run_auto(auto, took, 20)
    # thc4, the model's favourite, is tried for 1 + 2 steps (the first not
    # counted), measures worse than fp32, and auto goes back for good: the
    # corrected predictions of fp16 and thc8 are no longer within the margin
    assert ran == ["fp32"] * 2 + ["thc4"] * 3 + ["fp32"] * 15
    assert auto.history == [[2, "thc4"], [5, "fp32"]]
    assert auto.explored_steps == 3
    assert auto.measured("thc4") == pytest.approx(0.9, abs=0.005)
    assert auto.predicted["thc4"] == pytest.approx(0.9, abs=0.005)
    assert auto.correction is not None and min(auto.correction) > 1


def test_a_new_codecs_first_step_is_not_counted() -> None:
    took = {"fp32": 0.5, "fp16": 0.6, "thc8": 0.6, "thc4": [3.0, 0.2]}
    auto = ready_auto(200e6, warmup=2, every=1000, probe=2)
    ran = run_auto(auto, took, 12)
    assert ran == ["fp32"] * 2 + ["thc4"] * 10  # its slow first step did not count
    assert auto.measured("thc4") == pytest.approx(0.2, abs=0.005)
    assert auto.explored_steps == 0 and auto.decisions == 2


def test_ranks_with_their_own_corrections_agree() -> None:
    ranks = [ready_auto(200e6, warmup=2, every=1000, probe=2) for _ in range(3)]
    for i, r in enumerate(ranks):  # each rank measured its own times
        took = 0.3 + 0.2 * i
        feed_step(r, took=took)
        feed_step(r, took=took)
    chosen = decide(ranks)
    assert len(set(chosen)) == 1
    assert len({r.correction for r in ranks}) == 3


def test_a_link_change_counts_where_the_link_is_the_bottleneck() -> None:
    auto = ready_auto(warmup=1)
    auto.observe_link(2e9)
    feed_step(auto, sent=exchanges(60e6), took=0.5)
    decide([auto])
    auto.observe_link(20e9)  # unthrottled: the rate controller's rate far above the goodput
    assert not auto.link_changed()
    auto.observe_link(50e6)  # now the link is slower than what the daemon moved
    assert auto.link_changed()
    auto.forget()  # (what a decision on a link change does first, on every rank)
    assert auto.goodput_bps == {} and auto.measured("fp32") is None
    assert decide([auto]) == ["thc4"]  # the model alone, at 50 Mbit/s


def test_goodput_counts_overlapping_exchanges_once() -> None:
    auto = ready_auto(10e9)
    # two buckets in flight together for 0.1 s, then one more alone for 0.1 s
    auto.end_step([(1_000_000, 0.0, 0.1), (1_000_000, 0.0, 0.1), (1_000_000, 0.1, 0.2)], hosts=3)
    wire = 3 * 1_000_000 * 8.0 * 2 / 3
    assert auto.goodput_bps["fp32"] == pytest.approx(8 * wire / (0.2 - 3 * 0.003))


def test_each_codec_is_judged_by_its_own_goodput() -> None:
    # a 10 Gbit/s link, but the daemon moves float lanes at 150 Mbit/s and THC's
    # lanes slower (more work per byte): auto tries what the model favours,
    # measures it, and settles where the model with every measurement in points
    cal = calibration()
    truth = {"fp32": 150e6, "fp16": 150e6, "thc8": 60e6, "thc4": 20e6}

    def bytes_per_value(codec: str) -> float:
        return sum(cal[codec].push) + sum(cal[codec].pull)

    auto = ready_auto(10e9, warmup=2, every=1000, window=3)
    for _ in range(40):
        c = auto.current
        feed_step(auto, sent=exchanges(truth[c], bytes_per_value(c)))
        if auto.scheduled():
            decide([auto])
    tried = [c for _, c in auto.history]
    assert tried[0] == "thc4" and len(tried) == len(set(tried)) <= 4  # no codec twice
    assert auto.decisions == len(tried) + 1  # each switch to a new codec is checked once
    assert set(auto.goodput_bps) == {"fp32", *tried}
    for c, g in auto.goodput_bps.items():
        assert g == pytest.approx(truth[c], rel=1e-6)
    informed = ready_auto(10e9, window=3)
    for c in truth:  # every codec measured
        informed.codec = c
        feed_step(informed, sent=exchanges(truth[c], bytes_per_value(c)))
    assert decide([informed]) == [auto.current] and auto.current != "thc4"


def test_switches_when_the_link_rate_changes() -> None:
    auto = ready_auto(warmup=1, every=1000, change=0.3, probe=10)
    auto.observe_link(200e6)
    feed_step(auto)
    assert auto.scheduled() and decide([auto]) == ["thc4"]
    for rate, moved in ((230e6, False), (150e6, False), (10e9, True)):
        auto.observe_link(rate)
        feed_step(auto)
        assert not auto.scheduled()
        assert auto.link_changed() == moved, rate
    assert decide([auto]) == ["fp32"]
    assert auto.switches == 1 and auto.decided_link_bps == 10e9
    assert not auto.link_changed()
    auto.observe_link(200e6)  # and back
    assert auto.link_changed() and decide([auto]) == ["thc4"]
    assert auto.switches == 2
    assert [c for _, c in auto.history] == ["thc4", "fp32", "thc4"]


# -- a codec's error, and when an untried codec is worth a trial ------------------------------

# as in `dlcp bench train` on this host: the model (an idle host's costs) favours
# THC at 200 Mbit/s, the iterations say fp16, and thc4, the fastest here, has a
# one-round error of 170 % (`calibration`)
BENCH_TOOK = {"fp32": 0.6, "fp16": 0.4, "thc8": 0.45, "thc4": 0.3}


def test_error_penalty_and_payback_step() -> None:
    assert error_penalty(0.0) == 1.0
    assert error_penalty(0.12) == pytest.approx(1.0144)
    assert error_penalty(1.7) == pytest.approx(3.89)
    assert error_penalty(1.7, weight=0.5) == pytest.approx(2.445)
    assert error_penalty(1.7, weight=0.0) == 1.0
    assert error_penalty(float("nan")) == math.inf
    # steps x gain = the trial's cost
    assert payback_step(0.25, 3) == pytest.approx(12.0)
    assert payback_step(0.5, 3, payback=2.0) == pytest.approx(12.0)
    assert payback_step(0.0, 3) == math.inf and payback_step(-0.1, 3) == math.inf
    assert payback_step(0.01, 3, payback=0.0) == 0.0


def measure_all(auto: AutoCodec, took: dict[str, float]) -> None:
    """Two steps in every codec (the first step of the run is not counted)."""
    for c, t in took.items():
        auto.codec = c
        feed_step(auto, took=t)
        feed_step(auto, took=t)


def test_a_lossy_codec_must_be_faster_by_more_than_its_error_costs() -> None:
    # every codec measured: thc4 runs the fastest iterations, but a step of it
    # makes the progress of 1 / 3.89 of an exact step; thc8's 12 % error costs 1.4 %
    auto = AutoCodec(link_bps=200e6, warmup_codec="fp32", warmup=2)
    auto.calibration = calibration()
    measure_all(auto, BENCH_TOOK)
    assert decide([auto]) == ["fp16"]
    for c, err in (("thc4", 1.7), ("thc8", 0.12), ("fp16", 1e-4)):
        m = auto.measured(c)
        assert m is not None and m == pytest.approx(BENCH_TOOK[c], abs=0.005)
        assert auto.predicted[c] == pytest.approx(m * (1 + err**2), rel=1e-5)
    # by time alone (error_cost 0) thc4 wins; a faster thc8 still wins with its error
    blind = AutoCodec(link_bps=200e6, warmup_codec="fp32", warmup=2, error_cost=0.0)
    blind.calibration = calibration()
    measure_all(blind, BENCH_TOOK)
    assert decide([blind]) == ["thc4"]
    fast8 = AutoCodec(link_bps=200e6, warmup_codec="fp32", warmup=2)
    fast8.calibration = calibration()
    measure_all(fast8, {**BENCH_TOOK, "thc8": 0.3})
    assert decide([fast8]) == ["thc8"]


def first_decision(link: float, **kw: Any) -> AutoCodec:
    """An auto (fp16 warm-up, 3 steps) after its first decision."""
    auto = AutoCodec(link_bps=link, every=1000, **kw)
    auto.calibration = calibration()
    run_auto(auto, BENCH_TOOK, auto.warmup)
    assert auto.decisions == 1
    return auto


@pytest.mark.parametrize("link", [20e6, 200e6])
def test_an_untried_codec_is_tried_once_its_trial_pays_back(link: float) -> None:
    # after the warm-up the corrected model predicts thc8 faster than fp16's
    # measured steps; the trial's 3 steps would cost 3 steps if it fails, so it
    # waits until the steps run x the predicted gain reach 3, checked at the
    # reviews (3, 6, 12, 24, ... steps); thc4 is never tried (its error).
    # (No budget here: its test follows.)
    first = first_decision(link, explore_budget=None)
    gain = 1.0 - first.predicted["thc8"] / first.predicted["fp16"]
    assert 0.0 < gain < 1.0
    due = (first.probe + 1) / gain
    assert first.deferred["thc8"] == pytest.approx(due)
    assert math.isinf(first.deferred["thc4"])  # no gain: its error outweighs its speed
    start = next(3 * 2**j for j in range(10) if 3 * 2**j >= due)
    assert start > first.warmup  # deferred: without payback it would start at the warm-up
    auto = AutoCodec(link_bps=link, every=1000, explore_budget=None)
    auto.calibration = calibration()
    ran = run_auto(auto, BENCH_TOOK, 60)
    assert ran[:start] == ["fp16"] * start
    assert ran[start : start + 3] == ["thc8"] * 3  # its first step is not counted
    assert "thc4" not in ran and ran[-1] == "fp16"
    assert auto.measured("thc8") == pytest.approx(BENCH_TOOK["thc8"], abs=0.005)
    # with payback 0 (no waiting) the same trial starts right after the warm-up
    eager = AutoCodec(link_bps=link, every=1000, payback=0.0, explore_budget=None)
    eager.calibration = calibration()
    ran = run_auto(eager, BENCH_TOOK, 10)
    assert ran[:6] == ["fp16"] * 3 + ["thc8"] * 3


def test_a_smaller_predicted_gain_waits_longer() -> None:
    near, far = (
        first_decision(20e6, explore_budget=None),
        first_decision(200e6, explore_budget=None),
    )
    # at 20 Mbit/s compression gains more than at 200
    assert near.predicted["thc8"] / near.predicted["fp16"] < (
        far.predicted["thc8"] / far.predicted["fp16"]
    )
    assert near.deferred["thc8"] < far.deferred["thc8"]
    # and twice the payback, twice the wait
    twice = AutoCodec(link_bps=200e6, every=1000, payback=2.0, explore_budget=None)
    twice.calibration = calibration()
    run_auto(twice, BENCH_TOOK, 3)
    assert twice.deferred["thc8"] == pytest.approx(2 * far.deferred["thc8"])


def test_reviews_at_doubling_step_counts_since_the_last_link_change() -> None:
    def decisions(**kw: Any) -> list[int]:
        auto = AutoCodec(link_bps=200e6, every=1000, **kw)
        out = []
        for _ in range(100):
            feed_step(auto)
            if auto.scheduled():
                out.append(auto.steps)
            if auto.steps == 40:
                auto.forget()  # (a link change, as every rank sees it)
        return out

    assert decisions() == [3, 6, 12, 24, 43, 46, 52, 64, 88]
    assert decisions(warmup=2) == [2, 4, 8, 16, 32, 42, 44, 48, 56, 72]
    assert decisions(payback=0.0) == decisions(explore_budget=None) == decisions()
    # without payback and budget (or without measuring) nothing is deferred: no reviews
    assert decisions(payback=0.0, explore_budget=None) == [3]
    assert decisions(measure=False) == [3]
    # a codec on trial is judged at its follow-up, not at a review on fewer steps
    auto = AutoCodec(link_bps=200e6, every=1000, probe=20, payback=1e-9, explore_budget=None)
    auto.calibration = calibration()
    ran = run_auto(auto, BENCH_TOOK, 23)
    assert ran == ["fp16"] * 3 + ["thc8"] * 20 and auto.decisions == 1


@pytest.mark.parametrize(("budget", "first"), [(0.05, 96), (0.1, 48)])
def test_failed_trials_stay_within_the_exploration_budget(budget: float, first: int) -> None:
    # the trial of thc8 has paid back by step 12 (the test above), but failed
    # trials may take only `budget` of the steps run: its 3 steps may start
    # once 3 / budget steps ran (60, 30), at the review after (96, 48); after
    # it failed, the next (fp32, predicted faster by the corrected model once
    # thc8 is measured) waits for 6 / budget (120, 60: the reviews 192, 96)
    at_first = first_decision(200e6, explore_budget=budget)
    assert at_first.deferred["thc8"] == pytest.approx(3 / budget)
    auto = AutoCodec(link_bps=200e6, every=1000, explore_budget=budget)
    auto.calibration = calibration()
    ran = run_auto(auto, BENCH_TOOK, 200)
    second = next(3 * 2**j for j in range(10) if 3 * 2**j >= 6 / budget)
    assert ran[:first] == ["fp16"] * first
    assert ran[first : first + 3] == ["thc8"] * 3
    assert ran[first + 3 : second] == ["fp16"] * (second - first - 3)
    assert "thc4" not in ran
    assert auto.explored_steps <= budget * len(ran)
    # with a budget of 0 nothing is tried once a codec was measured
    none = AutoCodec(link_bps=200e6, every=1000, explore_budget=0.0)
    none.calibration = calibration()
    assert run_auto(none, BENCH_TOOK, 200) == ["fp16"] * 200
    assert none.deferred["thc8"] == math.inf


def test_a_link_change_still_switches_at_once() -> None:
    # measured fp32 on a fast link; the link drops: the decision on the change
    # has nothing measured on the new link, so the model alone decides, at once
    auto = AutoCodec(link_bps=None, warmup_codec="fp32", warmup=2, every=1000)
    auto.calibration = calibration()
    auto.observe_link(10e9)
    assert run_auto(auto, {"fp32": 0.05}, 10) == ["fp32"] * 10
    assert auto.measured("fp32") is not None
    auto.observe_link(50e6)
    assert auto.link_changed()
    auto.forget()
    assert decide([auto]) == ["thc8"]  # (thc4's error outweighs its smaller bytes)
    assert auto.deferred == {} and auto.history[-1] == [10, "thc8"]


def test_ranks_with_different_views_agree_on_one_codec() -> None:
    # three hosts: other costs (slower / faster CPUs), link rates, backward times
    ranks = []
    for scale, link, slow in ((0.5, 150e6, 1.0), (1.0, 200e6, 1.5), (2.0, 10e9, 3.0)):
        auto = AutoCodec(link_bps=link, warmup=1, warmup_codec="fp32")
        auto.calibration = calibration(scale)
        feed_step(auto, [(n, r * slow) for n, r in BUCKETS])
        ranks.append(auto)
    alone = [decide([r])[0] for r in ranks]
    assert len(set(alone)) > 1  # on their own they would disagree
    for r in ranks:
        r.codec, r.decisions, r.switches, r.history = None, 0, 0, []
    together = decide(ranks)
    assert len(set(together)) == 1
    mean = [sum(col) / 3 for col in zip(*(r.local_times(3) for r in ranks), strict=True)]
    assert together[0] == pick(mean, ranks[0].candidates)


def test_a_rank_that_rounds_differently_still_follows_the_max() -> None:
    ranks = [ready_auto(200e6) for _ in range(3)]
    for r in ranks:
        feed_step(r)
    times = [1.0, 1.0, 1.0, 1.0]
    proposals = [r.proposal(times) for r in ranks]
    proposals[1] = 2  # as if its average had come out otherwise
    for r in ranks:
        r.adopt(max(proposals), times)
    assert {r.current for r in ranks} == {"thc8"}


def test_a_rank_without_costs_keeps_everyone_on_the_current_codec() -> None:
    ranks = [ready_auto(200e6) for _ in range(3)]
    ranks[2].calibration = None
    for r in ranks:
        feed_step(r)
    assert decide(ranks) == ["fp32"] * 3


# -- the state and the hook, without a daemon -----------------------------------------------


def test_state_accepts_auto_and_pickles_its_decisions() -> None:
    state = dlcp.DlcpState(codec="auto", link_bps="200mbit", auto_options={"every": 7})
    assert state.auto is not None and state.auto.every == 7
    assert state.auto.fixed_link_bps == 200e6
    assert state.auto_codec == "fp16"  # the warm-up codec
    state.auto.calibration = calibration()
    feed_step(state.auto)
    feed_step(state.auto)
    decide([state.auto])
    restored = pickle.loads(pickle.dumps(state))
    # (nothing measured: the model alone, where thc4's error outweighs its bytes)
    assert restored.auto is not None and restored.auto_codec == "thc8"
    assert restored.stats()["auto"]["chosen"] == "thc8"
    assert restored.stats()["codec"] == "auto"
    assert dlcp.DlcpState(codec="fp32").auto is None


def test_an_auto_pickled_with_its_measurements_in_its_own_fields_loads() -> None:
    # (as AutoCodec pickled before dlcp.shim.auto_measure.Measurements held them)
    auto = AutoCodec(link_bps=200e6)
    auto.calibration = calibration()
    feed_step(auto)
    feed_step(auto)
    old = {k: v for k, v in vars(auto).items() if k != "seen"}
    old.update({k: v for k, v in vars(auto.seen).items() if k != "window"})

    class Old:  # unpickles as such an AutoCodec
        def __reduce__(self) -> Any:
            return (copyreg._reconstructor, (AutoCodec, object, None), old)

    loaded = pickle.loads(pickle.dumps(Old()))
    assert isinstance(loaded, AutoCodec) and isinstance(loaded.seen, Measurements)
    assert loaded.profile() == auto.profile() and loaded.profile() is not None
    assert loaded.describe() == auto.describe()


def test_auto_settings_are_checked_when_the_state_is_made() -> None:
    with pytest.raises(LocalError):
        dlcp.DlcpState(codec="auto", auto_options={"candidates": ["zip"]})
    state = dlcp.DlcpState(codec="auto", auto_options={"candidates": ["sketch", "fp32"]})
    assert state.auto is not None and state.auto.candidates == ("fp32", "sketch")
    assert "sketch" not in dlcp.DlcpState(codec="auto").auto.candidates  # type: ignore[union-attr]
    with pytest.raises(LocalError):
        dlcp.DlcpState(codec="automatic")


def test_make_hook_takes_auto() -> None:
    assert dlcp.make_hook("auto").__name__ == "dlcp_auto_hook"
    with pytest.raises(LocalError):
        dlcp.make_hook("fft-sim")


def test_bench_train_takes_codec_auto() -> None:
    from dlcp.bench import cli as bench_cli
    from dlcp.cli import build_parser

    args = build_parser().parse_args(["bench", "train", "--codec", "auto", "--backends", "dlcp"])
    assert bench_cli.train_options(args).codec == "auto"
    with pytest.raises(SystemExit):  # the all-reduce bench has no steps to learn from
        build_parser().parse_args(["bench", "allreduce", "--codec", "auto"])


def test_host_calibration_uses_the_cache_and_fills_gaps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dlcp.costmodel.calibrate as calibrate_mod

    path = tmp_path / "cal.json"
    Calibration(codecs={k: v for k, v in calibration().codecs.items() if k != "thc4"}).save(path)
    asked: list[list[str]] = []

    def fake(specs: Sequence[str], hosts: int = 3, **_: Any) -> Calibration:
        asked.append(list(specs))
        return Calibration(codecs={s: calibration().codecs[s] for s in specs})

    monkeypatch.setattr(calibrate_mod, "calibrate", fake)
    cal = host_calibration(("fp32", "thc8", "thc4"), 3, path)
    assert asked == [["thc4"]] and set(cal.codecs) == {"fp32", "fp16", "thc8", "thc4"}
    assert "thc4" in Calibration.load(path).codecs  # cached for the next run
    host_calibration(("fp32", "thc4"), 3, path)
    assert asked == [["thc4"]]


# -- over real daemons ------------------------------------------------------------------------

DDP: dict[str, Any] = {"bucket_cap_mb": 0.01}
STEPS = 8
SLOW_FROM = 4  # the step before which rank 1's link drops (scenario "switch")


def _auto_worker(rank: int, world: int, sockets: list[str], cache: str) -> dict[str, Any]:
    import os

    os.environ["XDG_CACHE_HOME"] = cache  # the calibration the test wrote
    out: dict[str, Any] = {"ref": reference_grads(rank, STEPS, **DDP)}
    # 1: the link rate from the daemon's rate controller; then an all_reduce
    # (a trial longer than the run: the codecs follow the link, not measurements)
    options: dict[str, Any] = {
        "auto_options": {
            "max_rel_error": 0.5,
            "probe": 2 * STEPS,
            "warmup_codec": "fp32",
            "warmup": 2,
        },
        "round_timeout_s": 30.0,
    }
    state = dlcp.init(codec="auto", socket=sockets[rank], **options)
    model = nn.parallel.DistributedDataParallel(make_model(), **DDP)
    model.register_comm_hook(state, dlcp.hook)
    grads = train_steps(model, rank, STEPS)
    t = torch.arange(1000.0) * (rank + 1)
    dlcp.all_reduce(t)
    out["status"] = {"grads": grads, "mean": t, "stats": state.stats()}
    state.close()
    # 2: fixed link rates, and rank 1's link drops before step SLOW_FROM
    state = dlcp.init(codec="auto", socket=sockets[rank], link_bps=10e9, **options)
    model = nn.parallel.DistributedDataParallel(make_model(), **DDP)
    model.register_comm_hook(state, dlcp.make_hook("auto"))
    used: list[str | None] = []

    def between(step: int) -> None:
        auto = state.auto
        if auto is not None and rank == 1 and step == SLOW_FROM:
            auto.fixed_link_bps = auto.link_bps = 1e3
        used.append(state.auto_codec)

    grads = train_steps(model, rank, STEPS, between=between)
    out["switch"] = {"grads": grads, "used": used, "stats": state.stats()}
    state.close()
    return out


@pytest.fixture(scope="module")
def auto_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("auto")
    cache = tmp / "cache"
    cal = calibration()
    # compressing costs seconds of CPU per bucket: more than fp32's measured
    # iterations take on any busy machine, less than it saves at 1 kbit/s
    cal.codecs["fp16"] = cost("fp16", 2.0, 2.0, 1e-3, 1e-4)
    cal.codecs["thc8"] = cost("thc8", 1.0, 1.6, 1e-3, 0.12)
    target = default_cache(3)
    cal.save(cache / target.parent.name / target.name)
    with loopback_daemons(tmp, 3, extra={"timing": {"timeout": 2.0}}) as ds:
        sockets = [d.socket for d in ds]
        yield spawn(_auto_worker, 3, tmp, sockets=sockets, cache=str(cache))


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def test_auto_over_three_daemons_reads_the_link_and_averages(
    auto_runs: list[dict[str, Any]],
) -> None:
    for res in auto_runs:
        run = res["status"]
        stats = run["stats"]
        auto = stats["auto"]
        assert stats["attached"] and stats["fallbacks"] == 0
        assert auto["link_bps"] and auto["link_bps"] >= 2 * 20e6  # the daemon's peer rates
        assert auto["goodput_bps"]["fp32"] > 0  # and what it achieved
        assert auto["decisions"] >= 1 and auto["chosen"] == "fp32"
        torch.testing.assert_close(run["mean"], torch.arange(1000.0) * 2)
        for got, want in zip(run["grads"], res["ref"], strict=True):
            torch.testing.assert_close(_flat(got), _flat(want), rtol=1e-6, atol=1e-7)


def test_auto_over_three_daemons_switches_together_when_one_link_drops(
    auto_runs: list[dict[str, Any]],
) -> None:
    runs = [res["switch"] for res in auto_runs]
    # fp32 while warming up and on the fast link; thc8 on every rank from the step
    # after rank 1's link dropped (its flag rode on that step's agreement)
    want = ["fp32"] * (SLOW_FROM + 1) + ["thc8"] * (STEPS - SLOW_FROM - 1)
    for run in runs:
        assert run["used"] == want
        auto = run["stats"]["auto"]
        assert auto["history"] == [[2, "fp32"], [SLOW_FROM + 1, "thc8"]]
        assert auto["switches"] == 1 and run["stats"]["fallbacks"] == 0
    for res in auto_runs:
        for step, (got, want_g) in enumerate(zip(res["switch"]["grads"], res["ref"], strict=True)):
            g, w = _flat(got), _flat(want_g)
            tol = 1e-6 if step <= SLOW_FROM else 0.05
            assert float((g - w).norm() / w.norm()) < tol, step
    first = runs[0]["grads"]
    for run in runs[1:]:  # every replica applies the same update
        for a, b in zip(run["grads"], first, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
