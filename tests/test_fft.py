"""FFT codec: the range-based float, block payloads, the aggregator's decoder,
error feedback, the theta schedule, and convergence on digits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlcp.codecs import CodecState, get_codec
from dlcp.codecs.fft import (
    FFT_HEADER,
    FftCodec,
    ThetaSchedule,
    _dequantize,
    _quantize,
    block_payload_bytes,
    fft_lanes_to_float,
    fft_payloads_to_float,
    keep_count,
    split_payloads,
)
from dlcp.core.layout import DEFAULT_PAYLOAD
from dlcp.costmodel.digits import train_simulated
from dlcp.costmodel.exchange import average
from dlcp.errors import LocalError, RemoteError


def payload_bytes(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().tobytes()


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out - want).norm() / want.norm())


# -- range-based float ---------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    exp_bits=st.integers(1, 6),
    man_bits=st.integers(0, 10),
    values=st.lists(st.floats(-1e6, 1e6, allow_subnormal=False, width=32), min_size=1, max_size=40),
)
def test_range_float_rounds_to_nearest_within_its_range(
    exp_bits: int, man_bits: int, values: list[float]
) -> None:
    a = torch.tensor([values], dtype=torch.float32)
    codes, emax, clamped = _quantize(a, exp_bits, man_bits)
    assert int(clamped) == 0 or float(a.abs().max()) > 0
    out = _dequantize(codes, emax, exp_bits, man_bits)[0]
    mag = a.double().abs()[0]
    top = float(mag.max())
    if top == 0:
        assert not codes.any()
        return
    emin = int(emax[0]) - ((1 << exp_bits) - 2)
    ulp_floor = 2.0 ** (emin - man_bits)  # spacing of the lowest binade
    for v, got in zip(mag.tolist(), out.abs().tolist(), strict=True):
        # nearest value in the format: half a spacing, relative in normal binades
        bound = max(v * 2.0 ** -(man_bits + 1), ulp_floor / 2) * (1 + 1e-9)
        if v <= top:
            assert abs(got - v) <= max(bound, 2.0 ** (int(emax[0]) - man_bits))
    assert (torch.sign(out) * torch.sign(a[0].double()) >= 0).all()
    assert int(codes.max()) < 1 << (1 + exp_bits + man_bits)


def test_range_float_zero_and_tiny_values() -> None:
    a = torch.tensor([[0.0, 1.0, -1e-6, 0.5]])
    codes, emax, _ = _quantize(a, 3, 4)
    assert int(emax[0]) == 0
    assert int(codes[0, 0]) == 0 and int(codes[0, 2]) == 0  # below the range: zero
    out = _dequantize(codes, emax, 3, 4)[0]
    assert out.tolist() == [0.0, 1.0, 0.0, 0.5]


# -- payloads --------------------------------------------------------------------


def test_keep_count_and_payload_size() -> None:
    assert keep_count(2048, 0.0) == 1025
    assert keep_count(2048, 0.9) == math.ceil(0.1 * 1025)
    assert keep_count(2048, 0.999999) == 1
    assert [keep_count(64, t / 10) for t in range(10)] == sorted(
        [keep_count(64, t / 10) for t in range(10)], reverse=True
    )
    assert block_payload_bytes(2048, 103, 3, 4) == FFT_HEADER.size + 129 + 206


def test_block_fits_a_packet_at_the_lowest_theta() -> None:
    codec = FftCodec()
    b = codec.per_packet()
    assert b & (b - 1) == 0
    assert codec.max_payload_bytes(b) <= DEFAULT_PAYLOAD < codec.max_payload_bytes(2 * b)
    assert FftCodec(block=256).per_packet() == 256


@pytest.mark.parametrize("numel", [1, 2, 7, 256, 1000, 4096 + 3])
def test_payloads_are_self_describing_and_decode_to_the_own_estimate(numel: int) -> None:
    codec = FftCodec(theta=0.7)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    state = CodecState()
    enc = codec.encode(x, per_packet=256, state=state)
    assert enc.n_lanes == numel
    assert enc.block_max.numel() == -(-numel // 256)
    payloads = split_payloads(payload_bytes(enc.lanes))
    assert len(payloads) == -(-numel // 256)
    sizes = [FFT_HEADER.unpack_from(p)[0] for p in payloads]
    assert sum(sizes) == numel and all(s == 256 for s in sizes[:-1])
    decoded = np.concatenate(
        [fft_lanes_to_float(p, count=s) for p, s in zip(payloads, sizes, strict=True)]
    )
    np.testing.assert_allclose(decoded, fft_payloads_to_float(payload_bytes(enc.lanes)))
    # what the worker thinks it sent (input - residual) is what the aggregator decodes
    assert state.residual is not None
    torch.testing.assert_close(torch.from_numpy(decoded), x - state.residual, atol=2e-6, rtol=1e-5)


def test_nearly_lossless_when_keeping_everything() -> None:
    codec = FftCodec(theta=0.0, exp_bits=5, man_bits=10)
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    out = codec.decode_lanes(codec.encode(x, per_packet=1024).lanes)
    assert rel_err(out, x) < 2e-3


def test_smooth_gradients_compress_well() -> None:
    x = torch.cumsum(torch.randn(20_000, generator=torch.Generator().manual_seed(2)), 0)
    codec = FftCodec(theta=0.9)
    enc = codec.encode(x, per_packet=2048)
    assert x.numel() * 4 / enc.lanes.numel() > 20
    assert rel_err(codec.decode_lanes(enc.lanes), x) < 0.05


def test_aggregated_decoded_floats_decode_to_the_mean() -> None:
    codec = FftCodec(theta=0.5)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(3000, generator=gen) for _ in range(3)]
    ex = average(codec, xs)
    own = torch.stack([codec.decode_lanes(codec.encode(x, per_packet=2048).lanes) for x in xs])
    torch.testing.assert_close(ex.mean, own.mean(dim=0), atol=1e-6, rtol=1e-5)
    assert ex.push_bytes < 3000 * 4 * 0.7
    assert ex.pull_bytes == 3000 * 4  # results are fp32 sums


def test_error_feedback_telescopes() -> None:
    codec = FftCodec(theta=0.9)
    state = CodecState()
    gen = torch.Generator().manual_seed(4)
    sent = torch.zeros(4096)
    total = torch.zeros(4096)
    for _ in range(5):
        g = torch.randn(4096, generator=gen)
        total += g
        sent += codec.decode_lanes(codec.encode(g, per_packet=1024, state=state).lanes)
    assert state.residual is not None and state.rounds == 5
    torch.testing.assert_close(sent + state.residual, total, atol=1e-4, rtol=1e-5)


def test_theta_schedule_diminishes_and_drives_encode() -> None:
    sched = ThetaSchedule(start=0.9, end=0.5, half_life=10)
    thetas = [sched(t) for t in range(0, 100, 10)]
    assert thetas[0] == pytest.approx(0.9) and thetas == sorted(thetas, reverse=True)
    assert sched(10) == pytest.approx(0.7) and sched(10_000) == pytest.approx(0.5)
    assert ThetaSchedule(0.8, 0.8, 0)(123) == 0.8
    codec = FftCodec(theta=sched, block=512)
    state = CodecState()
    x = torch.randn(512)
    first = codec.encode(x, per_packet=512, state=state).lanes.numel()
    state.rounds = 1000
    later = codec.encode(x, per_packet=512, state=state).lanes.numel()
    assert later > first
    with pytest.raises(LocalError):
        ThetaSchedule(start=0.5, end=0.9)


def test_bad_options_and_inputs_are_local_errors() -> None:
    with pytest.raises(LocalError):
        FftCodec(exp_bits=9)
    with pytest.raises(LocalError):
        FftCodec(block=1000)
    with pytest.raises(LocalError):
        FftCodec().encode(torch.tensor([1.0, float("nan")]), per_packet=2)
    assert isinstance(get_codec("fft-sim", theta=0.8), FftCodec)
    with pytest.raises(LocalError):
        get_codec("fft-sim", bits=4)


def test_malformed_payloads_are_remote_errors() -> None:
    codec = FftCodec(theta=0.5)
    good = payload_bytes(codec.encode(torch.randn(256), per_packet=256).lanes)
    fft_lanes_to_float(good, count=256)
    bad_cases = [
        good[:5],  # shorter than the header
        good[:-1],  # truncated codes
        good + b"\0",  # trailing bytes
        good[:4] + bytes([9]) + good[5:],  # exponent bits out of range
        good[:7] + b"\x01" + good[7:],  # reserved flags
        FFT_HEADER.pack(256, 200, 3, 4, 0, 0) + good[8:],  # k beyond n//2 + 1
    ]
    for at in (FFT_HEADER.size, FFT_HEADER.size + 16):  # marks too many, or past n//2 + 1
        flipped = bytearray(good)
        flipped[at] = 0xFF
        bad_cases.append(bytes(flipped))
    for bad in bad_cases:
        with pytest.raises(RemoteError):
            fft_lanes_to_float(bad)
    with pytest.raises(RemoteError):
        fft_lanes_to_float(good, count=128)
    with pytest.raises(RemoteError):
        split_payloads(good + good[:20])


# -- convergence ------------------------------------------------------------------


def test_digits_converges_close_to_fp32() -> None:
    torch.set_num_threads(1)
    base = train_simulated(None, epochs=6).accuracy
    fft = train_simulated("fft-sim", epochs=6).accuracy
    aggressive = train_simulated(FftCodec(theta=ThetaSchedule(0.95, 0.8, 50)), epochs=6).accuracy
    assert base > 0.9
    assert fft >= base - 0.025
    assert aggressive >= base - 0.03
