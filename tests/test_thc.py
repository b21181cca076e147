"""THC: the randomized Hadamard rotation, unbiased stochastic quantisation, its
error at 8 and 4 bits on Gaussian data, clamping, and error feedback."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlcp.codecs import CodecState, next_scale
from dlcp.codecs.hadamard import fwht, rotate, signs, unrotate
from dlcp.codecs.thc import ThcCodec

# -- helpers ---------------------------------------------------------------


def lane_values(codec: ThcCodec, lanes: torch.Tensor) -> torch.Tensor:
    """The integer lanes of one contribution (unpacks thc4 nibbles, low first)."""
    q = lanes.to(torch.int32)
    if codec.bits == 4:
        q = torch.stack((q & 0x0F, q >> 4), dim=1).reshape(-1)
    return q


def mean_through_thc(
    codec: ThcCodec,
    xs: list[torch.Tensor],
    *,
    per_packet: int,
    seed: int,
    scale: float | torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Encode every worker with a shared seed and scale, add the integer lanes,
    decode the mean (the aggregator path itself is pinned in test_codecs)."""
    total: torch.Tensor | None = None
    for x in xs:
        enc = codec.encode(x, per_packet=per_packet, seed=seed, scale=scale, generator=generator)
        q = lane_values(codec, enc.lanes)[: enc.n_lanes]
        total = q if total is None else total + q
    assert total is not None
    return codec.decode(
        total, len(xs), numel=xs[0].numel(), per_packet=per_packet, seed=seed, scale=scale
    )


def hadamard_matrix(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out - want).norm() / want.norm())


# -- Hadamard rotation ---------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 12), rows=st.integers(1, 3), seed=st.integers(0, 2**64 - 1))
def test_rotation_is_orthonormal_and_invertible(k: int, rows: int, seed: int) -> None:
    block = 1 << k
    x = torch.randn(rows, block, generator=torch.Generator().manual_seed(k * 7 + rows))
    y = rotate(x, seed)
    torch.testing.assert_close(y.norm(dim=1), x.norm(dim=1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(unrotate(y, seed), x, rtol=1e-5, atol=1e-5)
    # both algorithms compute H x / sqrt(B) in Sylvester order
    want = (x.double() * signs(seed, block).double()) @ hadamard_matrix(block) / math.sqrt(block)
    for method in ("matmul", "butterfly"):
        got = fwht(x * signs(seed, block), method=method)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_signs_depend_on_the_seed_only() -> None:
    a = signs(123, 1024)
    assert torch.equal(a, signs(123, 1024))
    assert not torch.equal(a, signs(124, 1024))
    assert set(a.unique().tolist()) == {-1.0, 1.0}
    assert abs(float(a.mean())) < 0.15
    x = torch.randn(2, 1024)
    assert torch.equal(rotate(x, 5), rotate(x, 5))
    assert not torch.allclose(rotate(x, 5), rotate(x, 6))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rotation_is_the_same_on_cuda() -> None:
    assert torch.equal(signs(77, 2048, "cuda").cpu(), signs(77, 2048))
    x = torch.randn(8, 2048)
    torch.testing.assert_close(rotate(x.cuda(), 77).cpu(), rotate(x, 77), rtol=1e-5, atol=1e-5)
    codec = ThcCodec(8)
    enc = codec.encode(x.cuda(), per_packet=2048, seed=77, scale=5.0)
    assert enc.lanes.device.type == "cuda"
    out = codec.decode(
        lane_values(codec, enc.lanes), 1, numel=x.numel(), per_packet=2048, seed=77, scale=5.0
    )
    assert rel_err(out.cpu(), x.reshape(-1)) < 0.03


# -- unbiasedness ---------------------------------------------------------------

UNBIASED = [
    # bits, dither
    (8, False),
    (4, False),
    (4, True),
]


@pytest.mark.parametrize(("bits", "dither"), UNBIASED)
def test_thc_is_unbiased(bits: int, dither: bool) -> None:
    """The average of K decodes of the same 4 inputs converges to their mean."""
    codec = ThcCodec(bits, dither=dither)
    workers, numel, per_packet, repeats = 4, 96, 32, 400
    gen = torch.Generator().manual_seed(42)
    xs = [torch.randn(numel, generator=gen) for _ in range(workers)]
    mean = torch.stack(xs).mean(0)
    # a rotated value is at most its block's L2 norm: with this scale nothing clamps
    scale = 1.25 * max(float(x.view(-1, per_packet).norm(dim=1).max()) for x in xs)
    rounding = torch.Generator().manual_seed(1)
    outs = torch.stack(
        [
            mean_through_thc(
                codec,
                xs,
                per_packet=per_packet,
                # dither draws its noise from the seed, so vary the seed for it
                seed=1000 + k if dither else 1000,
                scale=scale,
                generator=rounding,
            )
            for k in range(repeats)
        ]
    )
    err = outs - mean
    avg = err.mean(0)
    se = err.std(0) / math.sqrt(repeats)
    assert (avg.abs() <= 5 * se + 1e-6).all(), float((avg.abs() / se).max())
    per_round = err.mean(1)  # overall mean error of each repeat
    z = float(per_round.mean() / (per_round.std() / math.sqrt(repeats)))
    assert abs(z) < 4
    # and the check has power: the spread is real, not zero
    assert float(se.min()) > 0


def test_clamping_is_biased_and_counted() -> None:
    """The same check fails once the scale is too small: what `saturated` flags."""
    codec = ThcCodec(8, rotate=False)
    x = torch.linspace(-2.0, 2.0, 64)
    enc = codec.encode(x, per_packet=64, scale=1.0)
    assert enc.saturated == int((x.abs() > 1.0).sum())
    rounding = torch.Generator().manual_seed(3)
    outs = torch.stack(
        [
            mean_through_thc(codec, [x], per_packet=64, seed=0, scale=1.0, generator=rounding)
            for _ in range(100)
        ]
    )
    torch.testing.assert_close(outs.mean(0), x.clamp(-1.0, 1.0), atol=0.01, rtol=0)


# -- error on Gaussian data ---------------------------------------------------------
#
# Measured relative L2 errors ||decode - mean|| / ||mean|| (THC, stochastic
# rounding, one scale for the bucket = the workers' shared max; 2**20 values):
#   thc8, one worker, iid N(0,1) values:                 ~1.6 %
#   thc8, mean of 8 workers x_i = g + 0.3 n_i (Gaussian): ~0.63 %
#   thc4, one worker / mean of 8 correlated workers:     ~28 % / ~11 %
# Theory: step 2s/L, error variance step^2/6 on average, s ~ 5 sigma for the max
# of 2**20 Gaussians, so 2 * 5 / 255 / sqrt(6) ~ 1.6 % for one worker, divided by
# sqrt(8) (independent rounding) for the mean of 8. Per-packet scales (max of
# 1024 values, ~3.4 sigma) and the shared dither lower these; see below.

NUMEL = 1 << 20
BLOCK = {8: 1024, 4: 2048}  # lanes_per_packet at the default 1408-byte payload


def gaussian_workers(n: int, correlated: bool, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if not correlated:
        return [torch.randn(NUMEL, generator=gen) for _ in range(n)]
    g = torch.randn(NUMEL, generator=gen)
    return [g + 0.3 * torch.randn(NUMEL, generator=gen) for _ in range(n)]


def shared_max(codec: ThcCodec, xs: list[torch.Tensor], seed: int) -> float:
    return max(float(codec.encode(x, per_packet=BLOCK[codec.bits], seed=seed).scale) for x in xs)


def measured_error(
    bits: int,
    workers: int,
    correlated: bool,
    *,
    per_packet_scale: bool = False,
    dither: bool = False,
) -> float:
    codec = ThcCodec(bits, dither=dither)
    xs = gaussian_workers(workers, correlated)
    seed = 9
    scale: float | torch.Tensor
    if per_packet_scale:
        scale = torch.stack(
            [codec.encode(x, per_packet=BLOCK[bits], seed=seed).block_max for x in xs]
        ).amax(0)
    else:
        scale = shared_max(codec, xs, seed)
    rounding = torch.Generator().manual_seed(4)
    out = mean_through_thc(
        codec, xs, per_packet=BLOCK[bits], seed=seed, scale=scale, generator=rounding
    )
    return rel_err(out, torch.stack(xs).mean(0))


def test_thc8_mean_of_8_correlated_gaussian_workers_is_below_1pct() -> None:
    """The issue's target (error at 8 bits below 1 % of the norm) holds for the
    aggregated mean of 8 workers whose gradients share a signal."""
    err = measured_error(8, 8, correlated=True)
    assert err < 0.01
    assert 0.005 < err < 0.0075  # ~0.63 %


def test_thc8_single_worker_iid_gaussian_is_above_1pct() -> None:
    """Honest figure: one worker's iid Gaussian bucket with one bucket-wide scale
    is quantised to ~1.6 % at 8 bits, above the 1 % target, as theory says."""
    err = measured_error(8, 1, correlated=False)
    theory = 2 * 5.0 / 255 / math.sqrt(6)  # the max of 2**20 normals is ~5 sigma
    assert 0.014 < err < 0.018
    assert abs(err - theory) < 0.15 * theory


def test_thc8_per_packet_scales_lower_the_error() -> None:
    """One scale per packet (max of 1024 rotated values ~3.4 sigma, not ~5)."""
    single = measured_error(8, 1, correlated=False, per_packet_scale=True)
    mean8 = measured_error(8, 8, correlated=True, per_packet_scale=True)
    assert 0.010 < single < 0.012  # ~1.1 %: still not below 1 % for one worker
    assert 0.004 < mean8 < 0.005  # ~0.44 %


def test_thc8_shared_dither_with_per_packet_scales_is_below_1pct_for_one_worker() -> None:
    err = measured_error(8, 1, correlated=False, per_packet_scale=True, dither=True)
    assert 0.007 < err < 0.0085  # ~0.78 %: step / sqrt(12) instead of step / sqrt(6)


def test_thc4_error_levels() -> None:
    assert 0.25 < measured_error(4, 1, correlated=False) < 0.31  # ~28 %
    assert 0.09 < measured_error(4, 8, correlated=True) < 0.125  # ~11 %


def test_previous_round_scale_with_margin() -> None:
    """The scale agreed from the previous round's global max (times 1.25) on
    gradients of the same distribution: no clamping, error grows by ~the margin."""
    codec = ThcCodec(8)
    prev = gaussian_workers(8, correlated=True, seed=1)
    cur = gaussian_workers(8, correlated=True, seed=2)
    scale = next_scale(shared_max(codec, prev, seed=3), 1.25)
    encs = [codec.encode(x, per_packet=1024, seed=4, scale=scale) for x in cur]
    assert sum(e.saturated for e in encs) == 0
    err = rel_err(
        mean_through_thc(codec, cur, per_packet=1024, seed=4, scale=scale),
        torch.stack(cur).mean(0),
    )
    assert err < 0.01


def test_zero_bucket_decodes_to_zero() -> None:
    for bits in (8, 4):
        codec = ThcCodec(bits)
        enc = codec.encode(torch.zeros(3000), per_packet=1024)
        assert enc.scale == 0.0
        out = codec.decode(
            lane_values(codec, enc.lanes), 1, numel=3000, per_packet=1024, scale=enc.scale
        )
        assert float(out.abs().max()) < 1e-20


def test_per_packet_scale_saturation_counts_per_block() -> None:
    codec = ThcCodec(8, rotate=False)
    x = torch.tensor([0.5, -0.5, 3.0, -4.0])
    enc = codec.encode(x, per_packet=2, scale=torch.tensor([1.0, 3.5]))
    assert enc.saturated == 1
    assert torch.equal(enc.block_max, torch.tensor([0.5, 4.0]))


# -- error feedback ------------------------------------------------------------------


@pytest.mark.parametrize(("bits", "dither"), [(8, False), (4, False), (4, True)])
def test_error_feedback_keeps_the_accumulated_error_bounded(bits: int, dither: bool) -> None:
    """Encoding the same gradient g every round: with error feedback the sum of
    the decoded rounds stays within one residual of t * g; without, it drifts."""
    codec = ThcCodec(bits, dither=dither)
    g = torch.randn(4096, generator=torch.Generator().manual_seed(8))
    rounding = torch.Generator().manual_seed(9)
    state = CodecState()
    with_ef = torch.zeros_like(g)
    without = torch.zeros_like(g)
    rounds = 200
    for t in range(rounds):
        for acc, st_ in ((with_ef, state), (without, None)):
            enc = codec.encode(g, per_packet=1024, seed=t, state=st_, generator=rounding)
            acc += codec.decode(
                lane_values(codec, enc.lanes),
                1,
                numel=g.numel(),
                per_packet=1024,
                seed=t,
                scale=enc.scale,
            )
    assert state.rounds == rounds and state.residual is not None
    drift_ef = float((with_ef - rounds * g).norm())
    drift = float((without - rounds * g).norm())
    # the sum telescopes: t * g - residual_t
    torch.testing.assert_close(with_ef, rounds * g - state.residual, atol=1e-3, rtol=1e-4)
    assert drift_ef < 0.1 * drift
    assert float(state.residual.norm()) < 0.5 * float(g.norm())


def test_error_feedback_carries_what_clamping_cut() -> None:
    codec = ThcCodec(8, rotate=False)
    state = CodecState()
    x = torch.tensor([3.0, -0.5])
    enc = codec.encode(x, per_packet=2, scale=1.0, state=state)
    assert enc.saturated == 1 and state.saturated == 1
    assert state.residual is not None and abs(float(state.residual[0]) - 2.0) < 1e-5
