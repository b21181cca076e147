"""The fp16 encode in C (`dlcp.codecs._fp16`) against torch's passes: the
same lanes and residuals bit for bit, the same overflow counts, the same
maxima (as values: an all-zero packet's max may be -0 in torch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlcp.codecs import fp
from dlcp.codecs.base import CodecState
from dlcp.codecs.fp import Fp16Codec

pytestmark = pytest.mark.skipif(
    fp._native_fp16 is None, reason="dlcp.codecs._fp16 is not built or the CPU has no F16C"
)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _pair() -> tuple[Fp16Codec, Fp16Codec]:
    native, plain = Fp16Codec(), Fp16Codec()
    plain.native = False
    return native, plain


def _bucket(numel: int, step: int, hostile: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(numel * 10 + step)
    x = (
        torch.randn(numel, generator=g)
        * torch.logspace(-9, 3, numel)[torch.randperm(numel, generator=g)]
    )
    if hostile and numel > 40:
        x[3] = 70000.0  # overflows to inf
        x[4] = -1e9
        x[5] = float("inf")
        x[7] = -0.0
        x[8] = 65519.0  # rounds to the largest half
        x[9] = 65520.0  # rounds to inf
        x[10] = 3e-8  # a subnormal half
        x[11:20] = 0.0
        if step == 2:
            x[12] = float("nan")
    return x


@pytest.mark.parametrize("numel", [4454 * 3 + 5, 704 * 8, 37, 8, 0])
@pytest.mark.parametrize("per_packet", [704, 4454, 3])
@pytest.mark.parametrize("hostile", [False, True])
def test_encode_in_c_is_torchs_encode(numel: int, per_packet: int, hostile: bool) -> None:
    native, plain = _pair()
    states = (CodecState(), CodecState())
    for step in range(3):  # the residual carried from round to round
        x = _bucket(numel, step, hostile)
        got = []
        for codec, state in zip((native, plain), states, strict=True):
            out = torch.full((2 * numel + 8,), 0xAB, dtype=torch.uint8)
            enc = codec.encode_into(x.clone(), out, per_packet=per_packet, state=state)
            got.append((enc, out))
        (a, out_a), (b, out_b) = got
        assert _bits(a.lanes) == _bits(b.lanes)
        assert _bits(out_a) == _bits(out_b)
        assert a.block_max.shape == b.block_max.shape
        assert torch.equal(a.block_max, b.block_max) or (
            torch.isnan(a.block_max).equal(torch.isnan(b.block_max))
            and torch.equal(a.block_max.nan_to_num(7.0), b.block_max.nan_to_num(7.0))
        )
        assert a.saturated == b.saturated
        ra, rb = states[0].residual, states[1].residual
        assert ra is not None and rb is not None
        assert _bits(ra) == _bits(rb)
        assert states[0].saturated == states[1].saturated
    if hostile and numel > 40:
        assert states[0].saturated > 0


def test_encode_without_state_or_out() -> None:
    native, plain = _pair()
    x = torch.randn(5000) * 100
    a = native.encode(x, per_packet=704)
    b = plain.encode(x, per_packet=704)
    assert _bits(a.lanes) == _bits(b.lanes) and torch.equal(a.block_max, b.block_max)


def test_the_cast_is_torchs_on_every_half() -> None:
    """Every float32 that rounds to each fp16 value, its neighbours and NaNs
    with payloads: the C cast gives torch's bits."""
    halves = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    wide = halves.float()
    bits = wide.view(torch.int32)
    x = torch.cat([wide, (bits + 1).view(torch.float32), (bits - 1).view(torch.float32)])
    x = x[torch.isfinite(x) | torch.isnan(x)].contiguous()
    wire = torch.empty(x.numel(), dtype=torch.float16)
    maxima = torch.empty(-(-x.numel() // 64), dtype=torch.float32)
    assert fp._native_fp16 is not None
    fp._native_fp16.encode(
        x.numpy(), None, wire.view(torch.int16).numpy(), None, 64, maxima.numpy()
    )
    assert _bits(wire) == _bits(x.to(torch.float16))


def test_bad_arguments_are_refused() -> None:
    c = fp._native_fp16
    assert c is not None
    x = np.zeros(10, np.float32)
    w = np.zeros(10, np.int16)
    with pytest.raises(ValueError):
        c.encode(x, None, np.zeros(9, np.int16), None, 4, np.zeros(3, np.float32))
    with pytest.raises(ValueError):
        c.encode(x, None, w, None, 4, np.zeros(2, np.float32))
    with pytest.raises(ValueError):
        c.encode(x, np.zeros(9, np.float32), w, None, 4, np.zeros(3, np.float32))
    with pytest.raises(ValueError):
        c.encode(x, None, w, None, 0, np.zeros(3, np.float32))
    with pytest.raises(TypeError):
        c.encode(x, None, b"read-only", None, 4, np.zeros(3, np.float32))


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp, "_native_fp16", None)
    codec = Fp16Codec()
    x = torch.randn(100)
    assert not codec._native_ok(x, None, None)
    assert codec.encode(x, per_packet=10).lanes.numel() == 200
