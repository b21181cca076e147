"""The rank's side without new tensors (encode_into, decode_into, fwht_, the
state's spare residual): bit for bit the plain formulas they replace."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from dlcp.codecs import CodecState, get_codec
from dlcp.codecs import hadamard as h
from dlcp.codecs.hadamard import fwht, fwht_, rotate, unrotate
from dlcp.codecs.thc import _uniform_
from dlcp.shim.arena import Region
from dlcp.shim.client import Segment
from dlcp.shim.exchange import RoundPlan, decode_round, encode_into
from dlcp.shim.regions import align, region_sizes
from dlcp.shim.staging import Staging


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("method", ["matmul", "butterfly"])
@pytest.mark.parametrize("k", [0, 1, 5, 10, 11, 13])
def test_fwht_in_place_is_fwht(method: str, k: int, monkeypatch: pytest.MonkeyPatch) -> None:

    monkeypatch.setattr(h, "_exact_matmul", lambda device: method == "matmul")
    x = torch.randn(9, 1 << k)
    a, work = x.clone(), torch.empty_like(x)
    assert _bits(fwht_(a, work)) == _bits(fwht(x, method=method))


def _fp16_reference(x: torch.Tensor, r: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    v = x if r is None else x + r
    wire = v.to(torch.float16)
    res = v - wire.to(torch.float32)
    return wire, torch.where(torch.isfinite(res), res, 0.0)


def test_fp16_encode_into_is_the_cast_and_keeps_the_last_residual() -> None:
    codec = get_codec("fp16")
    state = CodecState()
    r: torch.Tensor | None = None
    kept: list[tuple[torch.Tensor, bytes]] = []
    for rnd in range(5):
        x = torch.randn(3001) * (1e5 if rnd == 2 else 1.0)
        if rnd == 3:
            x[7] = float("nan")
        wire, want = _fp16_reference(x, r)
        out = torch.zeros(2 * 3001 + 64, dtype=torch.uint8)
        enc = (
            codec.encode_into(x, out, per_packet=704, state=state)
            if rnd % 2
            else codec.encode(x, per_packet=704, state=state)
        )
        assert _bits(enc.lanes) == _bits(wire)
        if rnd % 2:
            assert enc.lanes.data_ptr() == out.data_ptr()  # written in place
        assert state.residual is not None and _bits(state.residual) == _bits(want)
        # the residual an encode replaced is intact after it (a failed step restores it)
        for t, b in kept[-1:]:
            assert _bits(t) == b
        kept.append((state.residual, _bits(state.residual)))
        r = state.residual.clone()
    assert state.spare is not None  # the rounds reuse a buffer


def _thc_reference(
    codec: object,
    x: torch.Tensor,
    r: torch.Tensor | None,
    pp: int,
    seed: int,
    s: torch.Tensor,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """THC's encode as plain tensor ops (the form before its scratch tensors)."""
    levels = float(codec.levels)  # type: ignore[attr-defined]
    v = x if r is None else x + r
    numel = v.numel()
    pad = -numel % pp
    y = rotate(torch.nn.functional.pad(v, (0, pad)).view(-1, pp), seed)
    block_max = y.abs().amax(dim=1)
    t = torch.clamp(y, -s, s).add_(s).mul_(levels / (2 * s))
    q = t.add_(u.view(t.shape)).floor_().clamp_(0.0, levels)
    own = q.clone().mul_(2 * s / levels).sub_(s)
    residual = unrotate(y.sub_(own), seed).reshape(-1)[:numel]
    return q.to(torch.uint8).reshape(-1), block_max, residual


@pytest.mark.parametrize("numel", [5000, 4096, 3])
def test_thc8_encode_into_and_decode_into_are_the_plain_formulas(
    numel: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the reference's transform in butterflies, as the codec's C passes run it
    # (torch's CPU default is a matmul; tests/test_thc_native.py holds the two
    # forms of the codec to the same bits)
    monkeypatch.setattr(h, "_exact_matmul", lambda device: False)
    codec = get_codec("thc8")
    pp = 1024 if numel > 3 else 4
    blocks = -(-numel // pp)
    state = CodecState()
    gen = torch.Generator().manual_seed(9)
    r: torch.Tensor | None = None
    for rnd in range(3):
        x = torch.randn(numel) * (8.0 if rnd == 1 else 1.0)  # round 1 clamps
        scale = torch.full((blocks,), 2.0)
        twin = torch.Generator().manual_seed(0)
        twin.set_state(gen.get_state())
        u = _uniform_(torch.empty(blocks * pp), twin)
        lanes, bmax, residual = _thc_reference(codec, x, r, pp, rnd + 5, scale.view(-1, 1), u)
        out = torch.zeros(blocks * pp + 64, dtype=torch.uint8)
        enc = codec.encode_into(
            x, out, per_packet=pp, seed=rnd + 5, scale=scale, state=state, generator=gen
        )
        assert _bits(enc.lanes) == _bits(lanes) and enc.lanes.data_ptr() == out.data_ptr()
        assert _bits(enc.block_max) == _bits(bmax)
        assert state.residual is not None and _bits(state.residual) == _bits(residual)
        r = state.residual.clone()
        # decode: 3 contributions, one packet with none
        sums = enc.lanes.to(torch.int32) * 3
        counts = torch.full((blocks,), 3)
        counts[0] = 0
        into = torch.full((numel,), float("nan"))
        got = codec.decode_into(
            sums, counts, into, numel=numel, per_packet=pp, seed=rnd + 5, scale=scale
        )
        c = counts.view(-1, 1).float()
        mean = sums.view(blocks, pp).float().div_(c.clamp(min=1)).mul_(2 * scale.view(-1, 1) / 255)
        y = torch.where(c > 0, mean.sub_(scale.view(-1, 1)), 0.0)
        want = unrotate(y, rnd + 5).reshape(-1)[:numel]
        assert got is into and _bits(into) == _bits(want)
        assert _bits(
            codec.decode(sums, counts, numel=numel, per_packet=pp, seed=rnd + 5, scale=scale)
        ) == _bits(want)


def test_thc_uniforms_are_uniform_and_follow_the_generator() -> None:
    a = _uniform_(torch.empty(200_000), torch.Generator().manual_seed(1))
    b = _uniform_(torch.empty(200_000), torch.Generator().manual_seed(1))
    c = _uniform_(torch.empty(200_000), torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert float(a.min()) >= 0.0 and float(a.max()) < 1.0
    assert abs(float(a.mean()) - 0.5) < 0.005 and abs(float(a.var()) - 1 / 12) < 0.002


@pytest.mark.parametrize("name", ["fp32", "fp16", "thc8", "thc4"])
def test_the_shim_writes_the_lanes_encode_makes_and_decodes_into_the_bucket(name: str) -> None:
    codec = get_codec(name)
    numel = 20_000
    plan = RoundPlan.make(codec, numel, shards=2, payload=1408, round_=3, bucket=1)
    if plan.scaled:
        scale = torch.full((plan.packets,), 4.0)
        plan = dataclasses.replace(plan, scale=scale)
    sizes = region_sizes(plan.layout)
    seg = Segment(f"dlcp-rankside-test-{name}", align(sizes.total) + 4096)
    try:
        meta = align(sizes.data)
        region = Region(seg, 0, meta, meta + align(sizes.meta), sizes)
        x = torch.randn(numel)
        gens = [torch.Generator().manual_seed(4) for _ in range(2)]
        states = [CodecState(), CodecState()]
        encode_into(
            region,
            plan,
            x,
            layers=np.zeros(plan.packets, np.uint16),
            state=states[0],
            generator=gens[0],
            staging=Staging(),
        )
        enc = codec.encode(
            x,
            per_packet=plan.per_packet,
            seed=plan.seed,
            scale=plan.scale,
            state=states[1],
            generator=gens[1],
        )
        data = np.frombuffer(region.data_view(), np.uint8)
        assert data.tobytes() == _bits(enc.lanes)
        # an out region of 2 contributions of these lanes
        from dlcp.codecs import lanes as wire_lanes
        from dlcp.shim.regions import SUM_DTYPES

        one = wire_lanes.unpack(plan.layout.codec, region.data_view(), plan.layout.total, False)
        sums = (one.astype(np.float64) * 2).astype(SUM_DTYPES[plan.layout.codec]).view(np.uint8)
        out = np.frombuffer(region.out_view(), np.uint8)
        out[: sums.size] = sums
        out[sums.size : sums.size + 2 * plan.packets] = np.full(plan.packets, 2, "<u2").view(
            np.uint8
        )
        bucket = torch.zeros(numel)
        dec = decode_round(plan, region, bucket.device, Staging(), bucket)
        want = codec.decode(
            torch.from_numpy(sums.view(SUM_DTYPES[plan.layout.codec]).copy()),
            2,
            numel=numel,
            per_packet=plan.per_packet,
            seed=plan.seed,
            scale=plan.scale,
        )
        assert dec.mean is bucket and _bits(bucket) == _bits(want)
        if name != "thc4":
            assert math.isfinite(float(bucket.sum()))
    finally:
        seg.close()
