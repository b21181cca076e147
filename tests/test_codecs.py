"""The worker-side codec API: registry, float codecs, and homomorphic sums through
the real aggregator lane code (dlcp.codecs.lanes over a dlcp.core.layout.Layout)."""

from __future__ import annotations

import io
import math
import pickle
import subprocess
import sys
from collections.abc import Collection

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlcp.codecs import (
    CODEC_NAMES,
    Codec,
    CodecState,
    block_norms,
    codec_for_wire,
    get_codec,
    lanes,
    next_scale,
)
from dlcp.codecs.base import per_packet_norms, per_packet_view
from dlcp.core.layout import Layout
from dlcp.errors import LocalError
from dlcp.wire.header import Codec as WireCodec
from dlcp.wire.header import lane_bytes

PAYLOAD = 512  # small packets so that small buckets span several of them


def aggregate(
    codec: Codec,
    encoded: list[bytes],
    n_lanes: int,
    *,
    payload: int = PAYLOAD,
    lost: Collection[tuple[int, int]] = (),
) -> tuple[np.ndarray, np.ndarray]:
    """What the aggregator and the result leg do: unpack each worker's packets,
    sum them in `lanes.sum_dtype`, send the sums as result lanes.

    `lost` holds (worker, packet) pairs that never arrive. Returns the received
    summed lanes and the contributors per packet.
    """
    layout = Layout(total=n_lanes, codec=codec.wire, shards=1, payload=payload)
    sdt = lanes.sum_dtype(codec.wire)
    sums = np.zeros(n_lanes, dtype=sdt)
    contributors = np.zeros(layout.packets, dtype=np.int64)
    for w, data in enumerate(encoded):
        assert len(data) == lane_bytes(codec.wire, n_lanes, summed=False)
        for i in range(layout.packets):
            if (w, i) in lost:
                continue
            off, count = layout.packet_range(i)
            start = lane_bytes(codec.wire, off, summed=False)
            part = data[start : start + lane_bytes(codec.wire, count, summed=False)]
            sums[off : off + count] += lanes.unpack(codec.wire, part, count, summed=False)
            contributors[i] += 1
    result = b"".join(
        lanes.pack(codec.wire, sums[o : o + c], summed=True)
        for i in range(layout.packets)
        for o, c in layout.result_ranges(i)
    )
    return lanes.unpack(codec.wire, result, n_lanes, summed=True).copy(), contributors


def wire_bytes(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().tobytes()


# -- registry ---------------------------------------------------------------


# the wire codecs whose codec object encodes and decodes by itself (fft's
# rounds come from `for_round(state)`: tests/test_fft_wire.py; the sketch's
# two exchanges, its loss and misuse: tests/test_sketch*.py)
DIRECT = ("fp32", "fp16", "thc8", "thc4")
WIRES = {"fp32": WireCodec.FP32, "fp16": WireCodec.FP16, "thc8": WireCodec.THC8,
         "thc4": WireCodec.THC4, "fft": WireCodec.FFT8}  # fmt: skip


def test_registry_names_and_wire_codes() -> None:
    assert CODEC_NAMES == ("fp32", "fp16", "thc8", "thc4", "fft", "sketch")
    for name, wire in WIRES.items():
        codec = get_codec(name)
        assert isinstance(codec, Codec)
        assert (codec.name, codec.wire) == (name, wire)
        assert codec_for_wire(wire).name == name
    # the sketch's two exchanges: the index union, then the cells
    assert get_codec("sketch").wire == WireCodec.SKETCH
    assert codec_for_wire(WireCodec.UNION).name == codec_for_wire(WireCodec.SKETCH).name


def test_unknown_codec_lists_the_valid_names() -> None:
    with pytest.raises(LocalError, match=r"unknown codec 'zip'.*fp32, fp16, thc8, thc4"):
        get_codec("zip")


@pytest.mark.parametrize(("name", "params"), [("fp32", {"rotate": False}), ("thc8", {"bits": 4})])
def test_unknown_options_are_local_errors(name: str, params: dict[str, object]) -> None:
    with pytest.raises(LocalError):
        get_codec(name, **params)


def test_importing_the_package_does_not_import_torch() -> None:
    code = "import sys, dlcp.codecs, dlcp.codecs.lanes; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_per_packet_matches_the_layout() -> None:
    for name in DIRECT:
        codec = get_codec(name)
        layout = Layout(total=codec.n_lanes(10_000, codec.per_packet()), codec=codec.wire, shards=2)
        assert codec.per_packet() == layout.per_packet


# -- round trips --------------------------------------------------------------

ROUND_TRIP = [
    # codec, relative L2 error allowed for one worker on Gaussian data
    ("fp32", 0.0),
    ("fp16", 1e-3),
    ("thc8", 0.03),
    ("thc4", 0.5),
]


@pytest.mark.parametrize(("name", "tolerance"), ROUND_TRIP)
@pytest.mark.parametrize("numel", [1, 1000, 4097])
def test_round_trip_one_worker(name: str, tolerance: float, numel: int) -> None:
    codec = get_codec(name)
    per_packet = codec.per_packet(PAYLOAD)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    enc = codec.encode(x, per_packet=per_packet, seed=7)
    sums, contributors = aggregate(codec, [wire_bytes(enc.lanes)], enc.n_lanes)
    out = codec.decode(
        torch.from_numpy(sums),
        torch.from_numpy(contributors),
        numel=numel,
        per_packet=per_packet,
        seed=7,
        scale=enc.scale,
    )
    assert out.dtype == torch.float32 and out.shape == (numel,)
    if tolerance == 0.0:
        assert torch.equal(out, x)
    else:
        assert (out - x).norm() <= tolerance * x.norm() + 1e-6


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(DIRECT),
    numel=st.integers(0, 3000),
    k=st.integers(0, 9),
)
def test_lane_bytes_and_counts(name: str, numel: int, k: int) -> None:
    codec = get_codec(name)
    per_packet = 1 << k
    x = torch.randn(numel)
    enc = codec.encode(x, per_packet=per_packet, seed=1)
    n = codec.n_lanes(numel, per_packet)
    assert enc.n_lanes == n >= numel
    assert enc.lanes.dtype == torch.uint8
    assert enc.lanes.numel() == lane_bytes(codec.wire, n, summed=False) == codec.lane_bytes(n)
    assert enc.block_max.shape == (-(-n // per_packet),)
    if name.startswith("thc"):
        assert n % per_packet == 0 and n - numel < per_packet


def test_fp16_lanes_are_little_endian_halves() -> None:
    x = torch.tensor([1.0, -2.5, 65504.0, 1e-3])
    enc = get_codec("fp16").encode(x, per_packet=4)
    assert wire_bytes(enc.lanes) == x.numpy().astype("<f2").tobytes()
    assert enc.saturated == 0


def test_fp16_overflow_is_inf_and_counted() -> None:
    x = torch.tensor([1.0, 1e6, -1e6, float("inf")])
    enc = get_codec("fp16").encode(x, per_packet=4)
    assert enc.saturated == 2  # the inf input was not finite to begin with
    assert np.isinf(np.frombuffer(wire_bytes(enc.lanes), "<f2")[1:]).all()


def test_fp16_error_feedback_carries_rounding_but_not_overflow() -> None:
    codec = get_codec("fp16")
    state = CodecState()
    half_step = 2.0**-11  # fp16 spacing at 1.0 is 2**-10; ties round to even (1.0)
    x = torch.tensor([1.0 + half_step, 1e6, float("nan")])
    first = codec.encode(x, per_packet=4, state=state)
    assert state.residual is not None
    assert state.residual.tolist() == [half_step, 0.0, 0.0]
    second = codec.encode(torch.tensor([1.0 + half_step, 0.0, 0.0]), per_packet=4, state=state)
    sent = [np.frombuffer(wire_bytes(e.lanes), "<f2")[0] for e in (first, second)]
    assert sent == [1.0, 1.0 + 2 * half_step]  # the two rounds add up exactly


def test_fp32_lanes_are_the_values() -> None:
    x = torch.randn(33, dtype=torch.float64)
    enc = get_codec("fp32").encode(x, per_packet=8)
    assert wire_bytes(enc.lanes) == x.numpy().astype("<f4").tobytes()
    # one per packet, and zeros: nothing reads an fp32 round's maxima
    assert torch.equal(enc.block_max, torch.zeros(5))


def test_fp16_block_maxima_are_each_packets_largest_magnitude() -> None:
    x = torch.randn(33)
    enc = get_codec("fp16").encode(x, per_packet=8)
    expected = torch.nn.functional.pad(x.abs(), (0, 7)).view(5, 8).amax(1)
    assert torch.equal(enc.block_max, expected)


def test_fp32_passes_non_finite_values() -> None:
    x = torch.tensor([1.0, float("nan"), float("inf")])
    codec = get_codec("fp32")
    enc = codec.encode(x, per_packet=2)
    sums = torch.from_numpy(np.frombuffer(wire_bytes(enc.lanes), "<f4").copy())
    out = codec.decode(sums, 1, numel=3, per_packet=2)
    assert out[0] == 1.0 and out[1].isnan() and out[2].isinf()


# -- homomorphism through the aggregator ------------------------------------------

HOMOMORPHIC = [
    # codec, tolerance of the decoded mean against the true mean (relative L2)
    ("fp32", 1e-6),
    ("fp16", 2e-3),  # fp16 data lanes and fp16 result lanes
    ("thc8", 0.02),
    ("thc4", 0.3),
]


@pytest.mark.parametrize(("name", "tolerance"), HOMOMORPHIC)
def test_mean_of_workers_through_lanes(name: str, tolerance: float) -> None:
    codec = get_codec(name)
    per_packet = codec.per_packet(PAYLOAD)
    workers, numel, seed = 5, 5000, 11
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(numel, generator=gen) for _ in range(workers)]
    mean = torch.stack(xs).mean(0)
    # a shared scale: the max over the workers (THC's exchange of maxima)
    scale = max(codec.encode(x, per_packet=per_packet, seed=seed).scale for x in xs)
    scale = next_scale(float(scale), 1.0)
    encs = [codec.encode(x, per_packet=per_packet, seed=seed, scale=scale) for x in xs]
    n_lanes = encs[0].n_lanes
    sums, contributors = aggregate(codec, [wire_bytes(e.lanes) for e in encs], n_lanes)
    assert (contributors == workers).all()
    out = codec.decode(
        torch.from_numpy(sums),
        torch.from_numpy(contributors),
        numel=numel,
        per_packet=per_packet,
        seed=seed,
        scale=scale,
    )
    assert (out - mean).norm() <= tolerance * mean.norm()
    if name.startswith("thc"):
        # exact homomorphism: the decoded sum is the mean of the own decodes
        own = [
            codec.decode(
                _own_lanes(codec, e), 1, numel=numel, per_packet=per_packet, seed=seed, scale=scale
            )
            for e in encs
        ]
        torch.testing.assert_close(out, torch.stack(own).mean(0), atol=1e-5, rtol=1e-5)


def _own_lanes(codec: Codec, enc: object) -> torch.Tensor:
    data = wire_bytes(enc.lanes)  # type: ignore[attr-defined]
    n = enc.n_lanes  # type: ignore[attr-defined]
    return torch.from_numpy(lanes.unpack(codec.wire, data, n, False).astype(np.int32))


@pytest.mark.parametrize("name", DIRECT)
def test_bounded_loss_divides_by_the_true_contributors(name: str) -> None:
    """Packets lost from some workers: each packet decodes to the mean of those
    that arrived; a packet nobody delivered decodes to zero."""
    codec = get_codec(name)
    per_packet = codec.per_packet(PAYLOAD)
    workers, seed, scale = 4, 3, 6.0
    numel = 3 * per_packet + per_packet // 2  # a short last packet
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(numel, generator=gen) for _ in range(workers)]
    encs = [codec.encode(x, per_packet=per_packet, seed=seed, scale=scale) for x in xs]
    n_lanes = encs[0].n_lanes
    lost = {(0, 0), (1, 0), (2, 1), (0, 2), (1, 2), (2, 2), (3, 2)}
    sums, contributors = aggregate(codec, [wire_bytes(e.lanes) for e in encs], n_lanes, lost=lost)
    assert contributors.tolist() == [2, 3, 0, 4]
    out = codec.decode(
        torch.from_numpy(sums),
        torch.from_numpy(contributors),
        numel=numel,
        per_packet=per_packet,
        seed=seed,
        scale=scale,
    )
    if name.startswith("thc"):
        ref = [
            codec.decode(
                _own_lanes(codec, e), 1, numel=numel, per_packet=per_packet, seed=seed, scale=scale
            )
            for e in encs
        ]
        atol = 1e-5
    else:
        ref = [x.half().float() if name == "fp16" else x for x in xs]
        atol = 2e-3
    for i in range(4):
        sl = slice(i * per_packet, min((i + 1) * per_packet, numel))
        got = [ref[w][sl] for w in range(workers) if (w, i) not in lost]
        want = torch.stack(got).mean(0) if got else torch.zeros(sl.stop - sl.start)
        torch.testing.assert_close(out[sl], want, atol=atol, rtol=1e-3)
    # per-lane contributors say the same thing
    per_lane = torch.from_numpy(contributors).repeat_interleave(per_packet)[:n_lanes]
    out2 = codec.decode(
        torch.from_numpy(sums), per_lane, numel=numel, per_packet=per_packet, seed=seed, scale=scale
    )
    torch.testing.assert_close(out, out2)


# -- helpers and errors -------------------------------------------------------------


@pytest.mark.parametrize("per_packet", [1, 7, 64, 5000])
def test_block_norms(per_packet: int) -> None:
    x = torch.randn(3, 1000)
    norms = block_norms(x, per_packet)
    flat = x.reshape(-1)
    want = [flat[i : i + per_packet].norm() for i in range(0, flat.numel(), per_packet)]
    torch.testing.assert_close(norms, torch.stack(want))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 3000), per_packet=st.integers(1, 700), seed=st.integers(0, 2**16))
def test_per_packet_norms_are_the_padded_views_norms(n: int, per_packet: int, seed: int) -> None:
    """Without the padded copy: each packet's max |value| exactly as before, its
    L2 norm to rounding (the short tail's is summed on its own)."""
    v = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 10
    view = per_packet_view(v, per_packet)
    got_max = per_packet_norms(v, per_packet, math.inf)
    assert torch.equal(got_max, view.abs().amax(dim=1))
    torch.testing.assert_close(
        per_packet_norms(v, per_packet), torch.linalg.vector_norm(view, dim=1)
    )


@pytest.mark.parametrize("numel", [1000, 1024, 63, 1])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_mean_into_the_bucket_with_counts_per_packet_is_the_general_one(
    numel: int, seed: int
) -> None:
    """Lanes lost within the bound give packets of different counts: their mean
    goes straight into the bucket (no lane-sized temporaries) with the bits of
    the general path, 0 where a packet had no contribution at all."""
    from dlcp.codecs.fp import mean_of_float_sums

    per_packet = 64
    g = torch.Generator().manual_seed(seed)
    packets = -(-numel // per_packet)
    counts = torch.randint(0, 4, (packets,), generator=g, dtype=torch.int32)
    counts[0] = 0
    sums = torch.randn(numel, generator=g) * 7
    want = mean_of_float_sums(sums, counts, numel=numel, per_packet=per_packet)
    into = torch.full((numel,), float("nan"))
    got = mean_of_float_sums(sums, counts, numel=numel, per_packet=per_packet, out=into)
    assert got is into
    assert torch.equal(got, want)
    assert not got[:per_packet].any()
    with pytest.raises(LocalError, match="one count per packet"):
        mean_of_float_sums(sums, counts[:-1], numel=numel, per_packet=per_packet, out=into)


@pytest.mark.parametrize("codec", ["fp32", "fp16"])
@pytest.mark.parametrize("count", [0, 1, 2, 3, 7])
def test_one_contributor_count_decodes_as_a_count_per_packet(codec: str, count: int) -> None:
    """The decode's shortcut for a round where every packet has the same count
    (an int) gives the bytes the per-packet counts give."""
    c = get_codec(codec)
    numel, per_packet = 1000, 64
    sums = torch.randn(numel).to(c.dtype if hasattr(c, "dtype") else torch.float32) * 5
    packets = -(-numel // per_packet)
    per_packet_counts = torch.full((packets,), count, dtype=torch.int32)
    want = c.decode(sums, per_packet_counts, numel=numel, per_packet=per_packet)
    got = c.decode(sums, count, numel=numel, per_packet=per_packet)
    assert got.dtype == want.dtype == torch.float32 and got.shape == (numel,)
    assert torch.equal(got, want)


def test_block_norm_survives_the_rotation() -> None:
    """What the priority policy relies on: a THC block keeps its pre-rotation norm."""
    from dlcp.codecs.hadamard import rotate

    x = torch.randn(4096)
    norms = block_norms(x, 1024)
    torch.testing.assert_close(rotate(x.view(4, 1024), 99).norm(dim=1), norms)


def test_next_scale() -> None:
    assert next_scale(2.0) == 2.5
    assert next_scale(0.1, 1.0) == float(np.float32(0.1))
    per_packet = next_scale(torch.tensor([1.0, 2.0]), 1.5)
    assert torch.equal(per_packet, torch.tensor([1.5, 3.0]))
    assert torch.equal(next_scale(np.array([4.0], dtype=np.float32)), torch.tensor([5.0]))
    for bad in (float("nan"), -1.0, float("inf")):
        with pytest.raises(LocalError):
            next_scale(bad)
    with pytest.raises(LocalError):
        next_scale(1.0, 0.5)


@pytest.mark.parametrize("name", DIRECT)
def test_decode_rejects_misuse(name: str) -> None:
    codec = get_codec(name)
    with pytest.raises(LocalError):
        codec.decode(torch.zeros(10), 1, numel=11, per_packet=16, scale=1.0)
    with pytest.raises(LocalError, match="contributors"):
        codec.decode(torch.zeros(64), torch.ones(3), numel=64, per_packet=16, scale=1.0)
    with pytest.raises(LocalError):
        codec.encode(torch.arange(4), per_packet=4)  # integer tensors are not gradients


@pytest.mark.parametrize("name", ["thc8", "thc4"])
def test_thc_misuse(name: str) -> None:
    codec = get_codec(name)
    with pytest.raises(LocalError, match="power of two"):
        codec.encode(torch.randn(10), per_packet=12)
    with pytest.raises(LocalError, match="scale"):
        codec.decode(torch.zeros(16), 1, numel=16, per_packet=16)
    with pytest.raises(LocalError, match="non-finite"):
        codec.encode(torch.tensor([1.0, float("nan")]), per_packet=2)
    with pytest.raises(LocalError, match="scale"):
        codec.encode(torch.randn(4), per_packet=2, scale=-1.0)
    with pytest.raises(LocalError, match="per-packet"):
        codec.encode(torch.randn(4), per_packet=2, scale=torch.ones(3))
    with pytest.raises(LocalError, match="per-packet"):
        codec.encode(torch.randn(4), per_packet=2, scale=torch.tensor([1.0, float("nan")]))


def test_codec_state_checkpoints() -> None:
    codec = get_codec("thc4")
    state = CodecState()
    codec.encode(torch.randn(100), per_packet=32, state=state)
    assert state.rounds == 1 and state.residual is not None
    clone = pickle.loads(pickle.dumps(state))
    assert torch.equal(clone.residual, state.residual) and clone.rounds == 1
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    buf.seek(0)
    fresh = CodecState()
    fresh.load_state_dict(torch.load(buf))
    assert fresh.residual is not None and torch.equal(fresh.residual, state.residual)
    with pytest.raises(LocalError, match="100 values"):
        codec.encode(torch.randn(50), per_packet=32, state=state)
    state.reset()
    assert state.residual is None and state.rounds == 0


def test_encode_does_not_modify_the_input() -> None:
    x = torch.randn(2048)
    before = x.clone()
    for name in DIRECT:
        for params in ({}, {"rotate": False}) if name.startswith("thc") else ({},):
            get_codec(name, **params).encode(x, per_packet=1024, state=CodecState())
    assert torch.equal(x, before)
