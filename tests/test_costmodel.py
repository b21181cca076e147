"""Cost model: link and codec specs, DDP-style buckets, model specs, the timeline
prediction, the `auto` chooser, calibration, the Gloo exchanger and `dlcp plan`.
No timing thresholds: predictions are checked on hand-made costs."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dlcp.codecs import get_codec
from dlcp.costmodel.calibrate import (
    Calibration,
    CodecCost,
    Linear,
    calibrate,
    make_codec,
    parse_codec_spec,
)
from dlcp.costmodel.exchange import average
from dlcp.costmodel.model import (
    Network,
    choose_codec,
    cpu_share_for,
    expected_max_normal,
    format_rate,
    parse_link,
    predict,
)
from dlcp.costmodel.profile import (
    Bucket,
    ModelProfile,
    assign_buckets,
    load_profile,
    measure_profile,
)
from dlcp.errors import LocalError

# -- specs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("200mbit", 200e6),
        ("1gbit", 1e9),
        ("1Gbit", 1e9),
        ("10g", 10e9),
        ("2.5gbit", 2.5e9),
        ("500kbit", 500e3),
        ("5e8", 5e8),
        ("none", None),
    ],
)
def test_parse_link(text: str, bps: float | None) -> None:
    assert parse_link(text) == bps
    assert parse_link(format_rate(bps)) == bps


@pytest.mark.parametrize("bad", ["fast", "-1gbit", "0", "1 gbit/s/s"])
def test_bad_links_are_local_errors(bad: str) -> None:
    with pytest.raises(LocalError):
        parse_link(bad)


def test_codec_specs() -> None:
    assert parse_codec_spec("fp32") == ("fp32", {})
    assert parse_codec_spec("sketch:keep=0.05,load=1.5") == (
        "sketch",
        {"keep": 0.05, "load": 1.5},
    )
    assert parse_codec_spec("thc4:rotate=false") == ("thc4", {"rotate": False})
    assert make_codec("fft-sim:theta=0.8,man_bits=6").man_bits == 6
    assert make_codec("fft:theta=0.8,explore=0.5").explore == 0.5
    with pytest.raises(LocalError):
        parse_codec_spec("fft:theta")
    with pytest.raises(LocalError):
        make_codec("zip")


# -- buckets and model specs --------------------------------------------------------


def test_buckets_follow_ddp() -> None:
    mb = 2**20 // 4  # values in a MB
    numels = [mb // 2, 10, mb * 3, 10, mb // 4, 5]
    # reverse order; first bucket capped at 1 MB, the others at the cap
    assert assign_buckets(numels, cap_mb=2.0) == [[5, 4, 3], [2], [1, 0]]
    assert assign_buckets(numels, cap_mb=25.0, first_cap_mb=None) == [[5, 4, 3, 2, 1, 0]]
    with pytest.raises(LocalError):
        assign_buckets(numels, cap_mb=0)


def test_model_spec_from_params_and_from_buckets(tmp_path: Path) -> None:
    spec = {
        "name": "m",
        "forward_s": 0.01,
        "backward_s": 0.02,
        "params": [100, 300, 600],
        "bucket_mb": 25,
        "first_bucket_mb": None,
    }
    prof = load_profile(json.dumps(spec))
    assert [b.numel for b in prof.buckets] == [1000]
    assert prof.buckets[0].ready_s == pytest.approx(0.02)
    explicit = {
        "forward_s": 0.0,
        "backward_s": 1.0,
        "buckets": [{"numel": 10, "ready": 0.25}, {"numel": 30}],
    }
    path = tmp_path / "m.json"
    path.write_text(json.dumps(explicit))
    prof2 = load_profile(str(path))
    assert [(b.numel, b.ready_s) for b in prof2.buckets] == [(10, 0.25), (30, 1.0)]
    for bad in [
        '{"forward_s": 1}',
        "[1, 2]",
        "not json",
        str(tmp_path / "missing.json"),
        '{"forward_s": 0, "backward_s": 1, "buckets": []}',
    ]:
        with pytest.raises(LocalError):
            load_profile(bad)


def test_profile_from_what_a_comm_hook_sees() -> None:
    prof = ModelProfile.from_bucket_sizes([100, 300], backward_s=0.04, forward_s=0.01)
    assert [(b.numel, b.ready_s) for b in prof.buckets] == [(100, 0.01), (300, 0.04)]
    assert prof.compute_s == pytest.approx(0.05)
    with pytest.raises(LocalError):
        ModelProfile.from_bucket_sizes([], backward_s=0.1)


def test_measure_profile_of_a_small_model() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    prof = measure_profile(
        "tiny",
        model,
        lambda: (x, y),
        torch.nn.CrossEntropyLoss(),
        cap_mb=0.0001,
        first_cap_mb=None,
        iters=3,
        warmup=1,
    )
    assert prof.numel == sum(p.numel() for p in model.parameters())
    assert len(prof.buckets) > 1
    assert all(0 <= b.ready_s <= prof.backward_s for b in prof.buckets)
    assert all(p.grad is not None for p in model.parameters())


# -- the model ------------------------------------------------------------------------

ZERO = Linear(0.0, 0.0)


def cost(
    spec: str, push: float, pull: float, per_value_s: float = 0.0, err: float = 0.0, phases: int = 1
) -> CodecCost:
    return CodecCost(
        spec=spec,
        push=(push / phases,) * phases,
        pull=(pull / phases,) * phases,
        encode=Linear(0.0, per_value_s),
        aggregate=ZERO,
        decode=ZERO,
        rel_error=err,
        hosts=3,
    )


PROFILE = ModelProfile(
    name="m",
    buckets=(Bucket(1_000_000, 0.05), Bucket(1_000_000, 0.1)),
    forward_s=0.05,
    backward_s=0.1,
    step_s=0.01,
)
FP32 = cost("fp32", 4, 4)
SMALL = cost("small", 0.5, 0.5, per_value_s=2e-9, err=0.1)  # 8x fewer bytes, 2 ns a value
CAL = Calibration(codecs={"fp32": FP32, "small": SMALL})
FREE = Network(push_bytes_s=math.inf, pull_bytes_s=math.inf, push_s=0.0, pull_s=0.0)


def test_one_host_or_a_free_network_costs_only_compute() -> None:
    assert predict(PROFILE, FP32, Network.from_rate(1e6), 1).iteration_s == pytest.approx(0.16)
    assert predict(PROFILE, FP32, FREE, 4).iteration_s == pytest.approx(0.16)


def test_the_timeline_by_hand() -> None:
    net = Network(push_bytes_s=1e8, pull_bytes_s=1e8, push_s=0.001, pull_s=0.002)
    # bucket 0 ready at 0.05 (t=0.10); push 4 MB * 2/3 at 100 MB/s = 26.7 ms + 1 ms,
    # pull 28.7 ms: it ends at 0.15733 while backward goes on to t=0.15 beside it;
    # bucket 1 starts at 0.15733 and ends at 0.21467; + step
    pred = predict(PROFILE, FP32, net, 3)
    one = 0.001 + 4e6 * 2 / 3 / 1e8 + 0.002 + 4e6 * 2 / 3 / 1e8
    assert pred.iteration_s == pytest.approx(0.10 + one + one + 0.01)
    assert pred.network_s == pytest.approx(2 * one)
    assert pred.wire_bytes == pytest.approx(2 * 8e6 * 2 / 3)
    # CPU work pauses backward: 2 ns a value on 3 shards of 1e6/3 = 2 ms a bucket
    free_enc = predict(PROFILE, SMALL, FREE, 3)
    assert free_enc.iteration_s == pytest.approx(0.16 + 0.004)
    half = predict(PROFILE, SMALL, FREE, 3, cpu_share=0.5)
    assert half.encode_s == pytest.approx(0.008)


def test_hosts_sharing_cores_stretch_the_codec_steps_to_the_makespan() -> None:
    assert cpu_share_for(1, 2) == 1.0 and cpu_share_for(2, 2) == 1.0
    assert cpu_share_for(3, 2) == pytest.approx(2 / 3)
    assert cpu_share_for(6, 2) == pytest.approx(1 / 3)
    assert 0 < cpu_share_for(64) <= 1.0  # this machine's cores
    for bad in ((0, 2), (3, 0)):
        with pytest.raises(LocalError):
            cpu_share_for(*bad)
    # 3 hosts on 2 cores: each codec step ends on the last host at 1.5x its time alone
    alone = predict(PROFILE, SMALL, FREE, 3)
    shared = predict(PROFILE, SMALL, FREE, 3, cpu_share=cpu_share_for(3, 2))
    assert shared.encode_s == pytest.approx(1.5 * alone.encode_s)
    assert shared.iteration_s == pytest.approx(0.16 + 1.5 * (alone.iteration_s - 0.16))


def test_stragglers_add_to_each_exchange() -> None:
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-4)
    assert expected_max_normal(3) == pytest.approx(0.8463, abs=1e-3)
    net = Network(push_bytes_s=1e8, pull_bytes_s=1e8, push_s=0.001, pull_s=0.002)
    base = predict(PROFILE, SMALL, net, 3)
    slow = predict(PROFILE, SMALL, net, 3, jitter_s=0.01)
    lag = expected_max_normal(3) * 0.01
    # two buckets, a push and a pull each: four waits for the slowest host
    assert slow.network_s == pytest.approx(base.network_s + 4 * lag)
    assert slow.iteration_s > base.iteration_s
    assert predict(PROFILE, SMALL, net, 1, jitter_s=0.5).iteration_s == pytest.approx(0.16)
    with pytest.raises(LocalError):
        predict(PROFILE, SMALL, net, 3, jitter_s=-1)


def test_ranks_leaving_a_collective_out_of_step_add_to_each_exchange() -> None:
    net = Network(push_bytes_s=1e8, pull_bytes_s=1e8, push_s=0.001, pull_s=0.002)
    base = predict(PROFILE, SMALL, net, 3)
    skewed = predict(PROFILE, SMALL, net, 3, exit_skew_s=0.003)
    # two buckets, a push and a pull each: four waits for the last host out
    assert skewed.network_s == pytest.approx(base.network_s + 4 * 0.003)
    assert skewed.iteration_s > base.iteration_s
    # with compute jitter too, the two spreads add as standard deviations
    both = predict(PROFILE, SMALL, net, 3, jitter_s=0.004, exit_skew_s=0.003)
    lag = math.hypot(expected_max_normal(3) * 0.004, 0.003)
    assert both.network_s == pytest.approx(base.network_s + 4 * lag)
    assert predict(PROFILE, SMALL, net, 1, exit_skew_s=0.5).iteration_s == pytest.approx(0.16)
    with pytest.raises(LocalError):
        predict(PROFILE, SMALL, net, 3, exit_skew_s=-1)


def test_compression_pays_on_slow_links_only() -> None:
    slow, fast = Network.from_rate(100e6), Network.from_rate(100e9)
    assert (
        predict(PROFILE, SMALL, slow, 3).iteration_s < predict(PROFILE, FP32, slow, 3).iteration_s
    )
    assert (
        predict(PROFILE, SMALL, fast, 3).iteration_s > predict(PROFILE, FP32, fast, 3).iteration_s
    )
    times = [predict(PROFILE, FP32, Network.from_rate(r), 3).iteration_s for r in (1e8, 1e9, 1e10)]
    assert times == sorted(times, reverse=True)


def test_two_phase_codecs_pay_two_latencies() -> None:
    net = Network(push_bytes_s=math.inf, pull_bytes_s=math.inf, push_s=0.01, pull_s=0.01)
    one = predict(PROFILE, cost("a", 1, 1), net, 3).iteration_s
    two = predict(PROFILE, cost("b", 1, 1, phases=2), net, 3).iteration_s
    assert two > one


def test_choose_codec_follows_the_link() -> None:
    assert choose_codec(PROFILE, 100e6, hosts=3, calibration=CAL) == "small"
    assert choose_codec(PROFILE, 100e9, hosts=3, calibration=CAL) == "fp32"
    assert choose_codec(PROFILE, 100e6, hosts=1, calibration=CAL) == "fp32"  # nothing to save
    assert choose_codec(PROFILE, 100e6, hosts=3, calibration=CAL, max_rel_error=0.05) == "fp32"
    assert choose_codec(PROFILE, 100e6, hosts=3, calibration=CAL, min_gain=10.0) == "fp32"
    fitted = Network.fit(
        [
            {"bytes": 1e3, "push_s": 1.0, "pull_s": 1.0},
            {"bytes": 1e6, "push_s": 1.0, "pull_s": 1.0},
        ],
        3,
    )
    assert choose_codec(PROFILE, 100e6, hosts=3, calibration=CAL, network=fitted) == "fp32"
    with pytest.raises(LocalError):
        choose_codec(PROFILE, 1e6, calibration=CAL, candidates=["thc8"])


def test_network_fit_recovers_latency_and_rate() -> None:
    hosts = 3
    rows = [
        {"bytes": b, "push_s": 0.001 + b * 2 / 3 / 5e7, "pull_s": 0.003 + b * 2 / 3 / 2e7}
        for b in (1e4, 1e6, 4e6)
    ]
    net = Network.fit(rows, hosts, bps=None)
    assert net.push_s == pytest.approx(0.001)
    assert net.pull_s == pytest.approx(0.003)
    assert net.push_bytes_s == pytest.approx(5e7)
    assert net.pull_bytes_s == pytest.approx(2e7)
    with pytest.raises(LocalError):
        Network.fit(rows[:1], hosts)


def test_linear_fit() -> None:
    f = Linear.fit(100, 0.002, 1100, 0.012)
    assert f.fixed_s == pytest.approx(0.001) and f.per_value_s == pytest.approx(1e-5)
    assert Linear.fit(100, 0.01, 1000, 0.005).per_value_s >= 0  # noise never goes negative


# -- calibration ----------------------------------------------------------------------


def test_calibration_measures_bytes_and_round_trips(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(1 << 14, generator=gen) for _ in range(3)]
    grads[0][::2] = 0
    cal = calibrate(
        ["fp32", "thc8", "fft-sim:theta=0.9", "fft", "sketch"],
        grads,
        hosts=3,
        small=2048,
        repeats=1,
    )
    assert cal.codecs["fp32"].push == (4.0,) and cal.codecs["fp32"].rel_error == 0.0
    thc = cal.codecs["thc8"]
    # three hosts' thc8 sums fit 10 bits: they come back in them (lanes.narrow_sums)
    assert thc.push[0] == pytest.approx(1.0, abs=0.01) and thc.pull[0] == pytest.approx(
        1.25, abs=0.01
    )
    fft = cal.codecs["fft-sim:theta=0.9"]
    assert fft.push[0] < 0.5 and fft.pull[0] == 4.0 and 0 < fft.rel_error < 1
    # on the wire both legs carry the agreed coefficients only (steady rounds)
    wire = cal.codecs["fft"]
    assert wire.push[0] < 0.15 and wire.pull[0] < 0.5 and 0 < wire.rel_error < 1
    assert cal.codecs["sketch"].phases == 2 and cal.codecs["sketch"].rel_error < 1e-5
    for c in cal.codecs.values():
        for lin in (c.encode, c.aggregate, c.decode):
            assert lin.fixed_s >= 0 and lin.per_value_s >= 0
    path = cal.save(tmp_path / "cal.json")
    again = Calibration.load(path)
    assert again.codecs == cal.codecs
    with pytest.raises(LocalError):
        Calibration.load(tmp_path / "nope.json")
    with pytest.raises(LocalError):
        cal["thc4"]


def test_calibrating_in_step_costs_each_step_its_slowest_ranks_time() -> None:
    """With `sync`, every step's time is what sync reports (the slowest rank's),
    not this process's own: a sync that says each step took 10 ms gives costs of
    exactly those steps, whatever this process measured."""
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(4096, generator=gen) for _ in range(3)]
    calls: list[str] = []

    def sync(step: Callable[[], None]) -> float:
        step()
        calls.append("step")
        return 0.010

    cal = calibrate(
        ["fp32", "sketch"], grads, hosts=3, small=1024, repeats=2, sync=sync, together=3
    )
    fp32, sketch = cal["fp32"], cal["sketch"]
    # fp32, per worker of 3: (begin + encode) / 3; aggregate 1 step; decode 1 step
    assert fp32.encode(4096) == pytest.approx(0.020 / 3)
    assert fp32.aggregate(4096) == pytest.approx(0.010)
    assert fp32.decode(1024) == pytest.approx(0.010)
    # sketch, two phases: begin, 2 encodes and 1 absorb per worker; 2 aggregates
    assert sketch.encode(4096) == pytest.approx(0.040 / 3)
    assert sketch.aggregate(4096) == pytest.approx(0.020)
    assert fp32.together == 3 and sketch.together == 3
    assert len(calls) == 2 * 3 * 4 + 2 * 3 * 7  # sizes x rounds (1 warm-up) x steps, per codec
    again = CodecCost.from_json(fp32.to_json())
    assert again == fp32
    old = fp32.to_json()
    del old["together"]  # a calibration saved before `together` existed: timed alone
    assert CodecCost.from_json(old).together == 1
    assert calibrate(["fp32"], grads, hosts=3, small=1024, repeats=1)["fp32"].together == 1
    with pytest.raises(LocalError):
        calibrate(["fp32"], grads, hosts=3, together=3)  # `together` without a sync


def test_emulated_ranks_sync_a_step_to_the_slowest(tmp_path: Path) -> None:
    import time

    import torch.distributed as dist

    from dlcp.costmodel.emulate import _EXIT_SKEWS, _together

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        ran: list[int] = []

        def step() -> None:
            ran.append(1)
            time.sleep(0.02)

        _EXIT_SKEWS.clear()
        took = _together(step)
        assert ran == [1] and took >= 0.02
        assert _EXIT_SKEWS == [0.0]  # one rank: the last one out is the median one
    finally:
        dist.destroy_process_group()


def test_in_step_compute_times_the_slowest_rank(tmp_path: Path) -> None:
    """`run_in_step`: iterations every rank starts at once, each bucket's ready time
    as the last rank reaches it (one rank here: its own, within its backward)."""
    import torch.distributed as dist

    from dlcp.costmodel.emulate import _Trainer

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        args = argparse.Namespace(rank=0, world=1, hidden=(2048, 256), bucket_mb=1.0, batch=8)
        trainer = _Trainer(args)
        runs = trainer.run_in_step(3, 1)
        trainer.close()
        assert len(runs) == 3
        for r in runs:
            assert len(r["ready_s"]) == len(trainer.groups) >= 2
            assert all(0 <= t <= r["backward_s"] + 1e-9 for t in r["ready_s"])
            assert r["iteration_s"] >= r["forward_s"] + r["backward_s"] > 0
    finally:
        dist.destroy_process_group()


def test_simulated_average_of_lane_codecs() -> None:
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(5000, generator=gen) for _ in range(3)]
    want = torch.stack(grads).mean(dim=0)
    torch.testing.assert_close(average(get_codec("fp32"), grads).mean, want)
    for name, tol in (("fp16", 1e-3), ("thc8", 0.05), ("thc4", 0.6)):
        out = average(get_codec(name), grads, seed=3).mean
        assert float((out - want).norm() / want.norm()) < tol, name


# -- the Gloo exchanger (one rank) --------------------------------------------------------


def test_bucket_exchanger_with_one_rank(tmp_path: Path) -> None:
    import torch.distributed as dist

    from dlcp.costmodel.emulate import BucketExchanger
    from dlcp.costmodel.pipeline import pipeline_for

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        x = torch.randn(3000, generator=torch.Generator().manual_seed(2))
        for spec in ("fp32", "thc8", "fft-sim:theta=0", "fft:theta=0", "sketch"):
            ex = BucketExchanger(pipeline_for(make_codec(spec)), 0, 1)
            for r in range(2):
                out = ex.exchange(0, x, seed=r)
                assert out.shape == x.shape
                assert float((out - x).norm() / x.norm()) < 0.05, spec
    finally:
        dist.destroy_process_group()


# -- dlcp plan -------------------------------------------------------------------------------


def test_plan_cli_prints_every_codec_and_auto(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dlcp import plan_cli

    path = tmp_path / "cal.json"
    CAL.save(path)
    parser = argparse.ArgumentParser()
    plan_cli.register(parser.add_subparsers())
    model = json.dumps(
        {
            "name": "m",
            "forward_s": 0.05,
            "backward_s": 0.1,
            "step_s": 0.01,
            "buckets": [{"numel": 1000000}, {"numel": 1000000}],
        }
    )
    args = parser.parse_args(
        [
            "plan",
            "--model",
            model,
            "--link",
            "100mbit",
            "--link",
            "none",
            "--hosts",
            "3",
            "--codecs",
            "fp32;small",
            "--calibration",
            str(path),
        ]
    )
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "link 100mbit  (auto -> small)" in text and "fp32" in text
    args = parser.parse_args(
        [
            "plan",
            "--model",
            model,
            "--link",
            "200mbit",
            "--codecs",
            "fp32;small",
            "--calibration",
            str(path),
            "--json",
        ]
    )
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[0]["auto"] == "small"
    assert {c["codec"] for c in out[0]["codecs"]} == {"fp32", "small"}
    # --sharing: N processes run their codec steps at once on this machine's cores
    alone = {c["codec"]: c for c in out[0]["codecs"]}
    args.sharing = 64 * (os.cpu_count() or 1)
    assert args.func(args) == 0
    shared = {c["codec"]: c for c in json.loads(capsys.readouterr().out)[0]["codecs"]}
    assert shared["small"]["codec_cpu_s"] == pytest.approx(64 * alone["small"]["codec_cpu_s"])
    # --exit-skew-ms: every exchange waits that much longer for the last host
    args.sharing = None
    args.cpu_share = 1.0
    args.exit_skew_ms = 3.0
    assert args.func(args) == 0
    skewed = {c["codec"]: c for c in json.loads(capsys.readouterr().out)[0]["codecs"]}
    for codec, c in skewed.items():
        assert c["iteration_s"] > alone[codec]["iteration_s"], codec
    net = Network.from_rate(200e6)
    want = predict(load_profile(model), CAL["small"], net, 3, exit_skew_s=0.003)
    assert skewed["small"]["iteration_s"] == pytest.approx(want.iteration_s)
    for bad in (-1.0, float("nan")):
        args.exit_skew_ms = bad
        with pytest.raises(LocalError, match="--exit-skew-ms"):
            args.func(args)
