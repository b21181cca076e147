"""THC's passes in C (`dlcp.codecs._thc`) against torch's: the same lanes,
maxima, scale, saturation counts, residuals and decodes, bit for bit, where
torch runs the butterfly form of the transform (on a CPU its default is a
matmul, whose sums a BLAS orders)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlcp.codecs import hadamard, thc, thc_noise
from dlcp.codecs.base import CodecState
from dlcp.codecs.thc import ThcCodec
from dlcp.errors import LocalError

pytestmark = pytest.mark.skipif(thc._native_thc is None, reason="dlcp.codecs._thc is not built")


@pytest.fixture(autouse=True)
def _butterflies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hadamard, "_exact_matmul", lambda device: False)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _pair(bits: int) -> tuple[ThcCodec, ThcCodec]:
    native, plain = ThcCodec(bits), ThcCodec(bits)
    assert native.native
    plain.native = False
    return native, plain


def _scales(kind: str, x: torch.Tensor, blocks: int) -> object:
    if kind == "own":
        return None
    if kind == "scalar":
        return float(x.abs().max()) * 0.3  # small: many values clamp
    g = torch.Generator().manual_seed(5)
    per = torch.rand(blocks, generator=g) * float(x.abs().max())
    per[1] = 0.0  # a zero scale (raised to the smallest)
    return per


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("scale", ["own", "scalar", "packet"])
@pytest.mark.parametrize("numel", [4096, 5000, 37])
def test_encode_in_c_is_torchs_encode(bits: int, scale: str, numel: int) -> None:
    per_packet = 512 if numel > 64 else 8
    blocks = -(-numel // per_packet)
    native, plain = _pair(bits)
    g = torch.Generator().manual_seed(numel)
    states = (CodecState(), CodecState())
    for step in range(3):  # the residual carried from round to round
        x = torch.randn(numel, generator=g) * (10.0 if step == 1 else 1e-2)
        x[numel // 2] = 50.0  # an outlier
        sc = _scales(scale, x, blocks)
        got = []
        for codec, state in zip((native, plain), states, strict=True):
            gen = torch.Generator().manual_seed(99 + step)
            out = torch.full((blocks * per_packet + 16,), 0xAB, dtype=torch.uint8)
            enc = codec.encode_into(
                x.clone(),
                out,
                per_packet=per_packet,
                seed=7 + step,
                scale=sc,
                state=state,
                generator=gen,
            )
            got.append((enc, out))
        (a, out_a), (b, out_b) = got
        assert _bits(a.lanes) == _bits(b.lanes)
        assert _bits(out_a) == _bits(out_b)
        assert _bits(a.block_max) == _bits(b.block_max)
        assert a.saturated == b.saturated
        assert a.n_lanes == b.n_lanes
        if isinstance(a.scale, torch.Tensor):
            assert torch.equal(a.scale, b.scale)
        else:
            assert a.scale == b.scale
        assert states[0].residual is not None and states[1].residual is not None
        assert _bits(states[0].residual) == _bits(states[1].residual)
        assert states[0].saturated == states[1].saturated
    if scale == "scalar":
        assert states[0].saturated > 0  # the clamp was exercised


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [8192, 5000, 1])
def test_the_one_pass_encode_is_the_c_passes(bits: int, numel: int) -> None:
    """Given its scales the encode is one C pass a block at a time
    (`_thc.encode`): the lanes, maxima, saturations and residual of the C
    passes over the whole bucket, step after step."""
    fused, passes = ThcCodec(bits), ThcCodec(bits)
    passes.fused = False
    blocks = -(-numel // 1024)
    g = torch.Generator().manual_seed(numel)
    states = (CodecState(), CodecState())
    for step in range(3):
        x = torch.randn(numel, generator=g) * (step + 1)
        sc = (torch.rand(blocks, generator=g) * 2.0, 1.5, torch.rand(blocks, generator=g))[step]
        got = [
            codec.encode(
                x, per_packet=1024, seed=3, scale=sc, state=st,
                generator=torch.Generator().manual_seed(step),
            )
            for codec, st in zip((fused, passes), states, strict=True)
        ]  # fmt: skip
        assert _bits(got[0].lanes) == _bits(got[1].lanes)
        assert _bits(got[0].block_max) == _bits(got[1].block_max)
        assert got[0].saturated == got[1].saturated
        assert got[0].saturated > 0 or numel == 1  # the clamp exercised (not by one value)
        assert _bits(states[0].residual) == _bits(states[1].residual)  # type: ignore[arg-type]


def test_the_one_pass_encode_refuses_non_finite_values_and_keeps_the_residual() -> None:
    codec, state = ThcCodec(8), CodecState()
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    codec.encode(x, per_packet=1024, seed=1, scale=2.0, state=state)
    kept = state.residual.clone()  # type: ignore[union-attr]
    x[1000] = float("nan")
    with pytest.raises(LocalError, match="non-finite"):
        codec.encode(x, per_packet=1024, seed=1, scale=2.0, state=state)
    assert state.rounds == 1 and torch.equal(state.residual, kept)  # type: ignore[arg-type]
    with pytest.raises(LocalError, match="finite and >= 0"):
        codec.encode(x, per_packet=1024, seed=1, scale=torch.tensor([1.0, -1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="scales for"):
        thc._native_thc.encode(
            x.numpy(), None, np.ones(1024, np.float32), np.ones(3, np.float32), 1, 255, 8,
            np.empty(4096, np.uint8), None, np.empty(4, np.float32),
        )  # fmt: skip


@pytest.mark.parametrize("bits", [8, 4])
def test_encode_without_state_and_without_out(bits: int) -> None:
    native, plain = _pair(bits)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(1))
    a = native.encode(x, per_packet=256, seed=3, generator=torch.Generator().manual_seed(2))
    b = plain.encode(x, per_packet=256, seed=3, generator=torch.Generator().manual_seed(2))
    assert _bits(a.lanes) == _bits(b.lanes)
    assert a.scale == b.scale


@pytest.mark.parametrize("counts", ["one", "packet", "packet-with-none"])
@pytest.mark.parametrize("scale", ["scalar", "packet"])
def test_decode_in_c_is_torchs_decode(counts: str, scale: str) -> None:
    native, plain = _pair(8)
    per_packet, numel = 256, 2000
    blocks = -(-numel // per_packet)
    g = torch.Generator().manual_seed(11)
    sums = torch.randint(0, 3 * 255, (blocks * per_packet,), generator=g).to(torch.int32)
    c: torch.Tensor | int
    if counts == "one":
        c = 3
    else:
        c = torch.randint(1, 4, (blocks,), generator=g)
        if counts == "packet-with-none":
            c[2] = 0
    sc: object = 0.7 if scale == "scalar" else torch.rand(blocks, generator=g) + 0.1
    outs = []
    for codec in (native, plain):
        out = torch.full((numel,), float("nan"))
        codec.decode_into(sums, c, out, numel=numel, per_packet=per_packet, seed=5, scale=sc)
        outs.append(out)
    assert _bits(outs[0]) == _bits(outs[1])
    assert torch.isfinite(outs[0]).all()


def test_the_round_trip_stays_close() -> None:
    """An encode then a decode of one worker's lanes gives back its values
    (within THC's rounding), the C passes composed as the codec uses them."""
    native = ThcCodec(8)
    x = torch.randn(8192, generator=torch.Generator().manual_seed(4))
    enc = native.encode(x, per_packet=1024, seed=9, generator=torch.Generator().manual_seed(1))
    back = native.decode(
        enc.lanes.to(torch.int32), 1, numel=x.numel(), per_packet=1024, seed=9, scale=enc.scale
    )
    assert float((back - x).norm() / x.norm()) < 0.05


def test_bad_arguments_are_refused() -> None:
    c = thc._native_thc
    assert c is not None
    f = np.zeros(1000, np.float32)
    with pytest.raises(ValueError):
        c.rotate(f, np.ones(3, np.float32), np.zeros(1, np.float32))  # not a power of two
    with pytest.raises(ValueError):
        c.rotate(np.zeros(1024, np.float32), np.ones(256, np.float32), np.zeros(3, np.float32))
    y = np.zeros(1024, np.float32)
    with pytest.raises(ValueError):
        c.quantize(y, np.ones(3, np.float32), 1, 255, 8, np.zeros(1024, np.uint8), False)
    with pytest.raises(ValueError):
        c.quantize(y, np.ones(1, np.float32), 1, 255, 8, np.zeros(10, np.uint8), False)
    with pytest.raises(ValueError):
        c.quantize(y, np.ones(1, np.float32), 1, 15, 8, np.zeros(1024, np.uint8), False)
    with pytest.raises(ValueError):
        c.uniforms(np.zeros(5, np.uint8), 1)
    with pytest.raises(ValueError):
        c.unrotate(y, np.ones(256, np.float32), np.zeros(2000, np.float32))
    with pytest.raises(ValueError):
        c.dequantize(
            y,
            np.ones(3, np.float32),
            np.ones(1, np.float32),
            255,
            np.ones(256, np.float32),
            np.zeros(10, np.float32),
        )
    with pytest.raises(TypeError):
        c.rotate(b"read-only", np.ones(1, np.float32), np.zeros(1, np.float32))


@pytest.mark.parametrize("key", [0, 1, 2**62 - 1, 0x123456789ABCDEF])
def test_the_noise_in_c_is_numpys_hash(key: int) -> None:
    c = thc._native_thc
    assert c is not None
    got = np.empty(100_003, np.float32)
    c.uniforms(got, key)
    assert got.tobytes() == thc_noise.noise_of(key, got.size).tobytes()


def test_the_noise_is_uniform_and_private_to_its_key() -> None:
    a, b = thc_noise.noise_of(1, 400_000), thc_noise.noise_of(2, 400_000)
    assert float(a.min()) >= 0.0 and float(a.max()) < 1.0
    assert abs(float(a.mean()) - 0.5) < 0.003 and abs(float(a.var()) - 1 / 12) < 0.001
    assert abs(float(np.corrcoef(a, b)[0, 1])) < 0.01  # other keys, unrelated noise
    assert abs(float(np.corrcoef(a[:-1], a[1:])[0, 1])) < 0.01  # neighbours unrelated
    counts = np.bincount((a * 256).astype(np.int64), minlength=256)
    assert counts.min() > 0.9 * a.size / 256 and counts.max() < 1.1 * a.size / 256


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(thc, "_native_thc", None)
    assert not ThcCodec(8).native
    assert not ThcCodec(8, dither=True).native
    with pytest.raises(LocalError):
        ThcCodec(8).decode(torch.zeros(8), 1, numel=8, per_packet=8, seed=0, scale=None)
