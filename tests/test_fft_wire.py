"""fft on the wire (dlcp/codecs/fft_wire.py, rangefloat.py, wire codec FFT8):
the range-float table, lanes the owner adds, the agreed coefficient set, the
rounds' algebra without sockets, and DDP through three daemons on loopback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import dlcp.shim as dlcp
from dlcp import ipc
from dlcp.codecs import CODEC_NAMES, CodecState, codec_for_wire, get_codec
from dlcp.codecs import lanes as lane_ops
from dlcp.codecs.fft_wire import Agreement, FftDenseRound, FftSparseRound, FftWireCodec
from dlcp.codecs.rangefloat import MAX_UNIT, UNIT_VALUES, quantize_unit
from dlcp.core.layout import Layout
from dlcp.errors import LocalError
from dlcp.shim.auto import AutoCodec
from dlcp.wire.header import Codec, Header, PacketType, decode, encode
from tests.daemons import loopback_daemons
from tests.test_shim import make_model, reference_grads, spawn, train_steps

KEY = b"k" * 32


def smooth(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cumsum(torch.randn(n, generator=g), 0) / 30


def run_round(
    codec: FftWireCodec,
    states: list[CodecState],
    xs: list[torch.Tensor],
    drop: set[tuple[int, int]] = frozenset(),  # type: ignore[assignment]
    use_maxima: bool = True,
) -> tuple[torch.Tensor, Any]:
    """One round of every worker as the daemon sums it: lanes unpacked and
    added per packet; (worker, packet) in `drop` is lost. Returns the mean
    decoded by worker 0 (all learn the result)."""
    rcs = [codec.for_round(s) for s in states]
    rc = rcs[0]
    per = rc.per_packet()
    encs = [c.encode(x, per_packet=per, state=s) for c, x, s in zip(rcs, xs, states, strict=True)]
    n = encs[0].n_lanes
    packets = -(-n // per)
    sums = np.zeros(n, lane_ops.sum_dtype(rc.wire))
    counts = np.zeros(packets, np.uint16)
    maxima = np.zeros(packets, np.float32)  # what the owner carries back per packet
    width = 1 if rc.wire == Codec.FFT8 else 4  # bytes a data lane
    for w, e in enumerate(encs):
        raw = e.lanes.numpy().tobytes()
        for i in range(packets):
            if (w, i) in drop:
                continue
            lo, hi = i * per, min(n, (i + 1) * per)
            payload = raw[lo * width : hi * width]
            sums[lo:hi] += lane_ops.unpack(rc.wire, payload, hi - lo, False)
            counts[i] += 1
            maxima[i] = max(maxima[i], float(e.block_max[i]))
    contributors = torch.from_numpy(counts.astype(np.int32))
    mean = rc.decode(torch.from_numpy(sums), contributors, numel=xs[0].numel(), per_packet=per)
    for c, s in zip(rcs, states, strict=True):
        c.learn(s, sums, counts, per_packet=per, maxima=maxima if use_maxima else None)
    return mean, rc


# -- the range float -----------------------------------------------------------------


def test_unit_table_is_the_e3m4_range_float() -> None:
    assert UNIT_VALUES.dtype == np.float32 and UNIT_VALUES.size == 256
    assert UNIT_VALUES[0] == 0.0 and UNIT_VALUES[0x80] == 0.0  # +-0
    assert UNIT_VALUES[0x7F] == MAX_UNIT == 1.9375
    assert UNIT_VALUES[1] == 2.0**-10  # the smallest step (gradual underflow)
    assert UNIT_VALUES[0x10] == 2.0**-6  # the first normal binade
    np.testing.assert_array_equal(UNIT_VALUES[0x80:], -UNIT_VALUES[:0x80])
    # every value a multiple of 2**-10: sums of thousands stay exact in float32
    assert np.all(np.round(UNIT_VALUES * 1024) == UNIT_VALUES * 1024)
    # codes are monotonic in magnitude
    assert np.all(np.diff(UNIT_VALUES[:0x80]) > 0)


def test_quantize_rounds_to_the_nearest_code_and_clamps() -> None:
    codes, clamped = quantize_unit(UNIT_VALUES)
    np.testing.assert_array_equal(UNIT_VALUES[codes], UNIT_VALUES)
    assert clamped == 0
    rng = np.random.default_rng(0)
    y = rng.uniform(-1.9, 1.9, 5000)
    codes, _ = quantize_unit(y)
    got = UNIT_VALUES[codes].astype(np.float64)
    # nearest: no table value is closer
    best = np.abs(y[:, None] - UNIT_VALUES[None, :].astype(np.float64)).min(axis=1)
    np.testing.assert_allclose(np.abs(got - y), best, atol=1e-12)
    codes, clamped = quantize_unit(np.array([5.0, -3.0, 1.0]))
    assert clamped == 2 and list(UNIT_VALUES[codes]) == [MAX_UNIT, -MAX_UNIT, 1.0]
    with pytest.raises(ValueError):
        quantize_unit(np.array([np.nan]))


# -- the wire ------------------------------------------------------------------------


def test_fft8_lanes_are_codes_summed_as_floats() -> None:
    assert Codec.FFT8 == 6 and ipc.CODEC_BY_NAME["fft"] == 6
    assert lane_ops.sum_dtype(Codec.FFT8) == np.float32
    values = np.array([0.5, -1.9375, 2.0**-10, 0.0], np.float32)
    raw = lane_ops.pack(Codec.FFT8, values, False)
    assert len(raw) == 4
    np.testing.assert_array_equal(lane_ops.unpack(Codec.FFT8, raw, 4, False), values)
    summed = lane_ops.pack(Codec.FFT8, values * 3, True)
    assert len(summed) == 16  # fp32 sums on the result leg
    layout = Layout(total=10_000, codec=Codec.FFT8, shards=3)
    assert layout.per_packet == 1408 and layout.result_split == 4
    h = Header(PacketType.DATA, job=1, round=2, bucket=0, codec=Codec.FFT8, count=4, total=4)
    back, payload = decode(encode(h, raw, KEY), {1: KEY})
    assert back.codec == Codec.FFT8 and bytes(payload) == raw


def test_fft_is_a_wire_codec_everywhere() -> None:
    assert "fft" in CODEC_NAMES
    assert isinstance(get_codec("fft"), FftWireCodec)
    assert isinstance(codec_for_wire(Codec.FFT8), FftWireCodec)
    dlcp.make_hook("fft")  # the hook accepts it
    for bad in (
        {"theta": 1.0},
        {"theta": "fast"},
        {"block": 1000},
        {"explore": 0.95},
        {"headroom": 9},
        {"bits": 4},
    ):
        with pytest.raises(LocalError):
            get_codec("fft", **bad)
    with pytest.raises(LocalError, match="for_round"):
        get_codec("fft").encode(torch.zeros(4), per_packet=4)
    # auto takes it as a candidate when named; the defaults leave it out
    assert AutoCodec(candidates=["fft", "fp32"]).candidates == ("fp32", "fft")
    assert "fft" not in AutoCodec().candidates
    state = dlcp.DlcpState(codec="fft", codec_options={"theta": "diminishing", "block": 512})
    assert state.codec == "fft"
    with pytest.raises(LocalError):
        dlcp.DlcpState(codec="fft", codec_options={"block": 3})
    from dlcp.bench.common import CODECS
    from dlcp.costmodel.calibrate import DEFAULT_CODECS

    assert "fft" in CODECS and "fft" in DEFAULT_CODECS


# -- the agreement -------------------------------------------------------------------


def test_first_round_is_dense_then_the_agreed_set() -> None:
    codec = FftWireCodec(block=256)
    st = CodecState()
    assert isinstance(codec.for_round(st), FftDenseRound)
    assert codec.for_round(st).name == "fp32"  # what the daemon carries
    xs = [smooth(3000, s) for s in range(3)]
    states = [CodecState() for _ in xs]
    mean, _rc = run_round(codec, states, xs)
    torch.testing.assert_close(mean, sum(xs) / 3)  # dense: exact up to fp32
    a = states[0].shared
    assert isinstance(a, Agreement) and (a.blocks, a.k) == (12, codec.keep(1))
    for s in states[1:]:  # every worker derived the same set and ranges
        assert isinstance(s.shared, Agreement)
        np.testing.assert_array_equal(s.shared.index, a.index)
        np.testing.assert_array_equal(s.shared.exponent, a.exponent)
    assert isinstance(codec.for_round(states[0]), FftSparseRound)


def test_sparse_rounds_sum_the_agreed_coefficients_of_every_worker() -> None:
    """The homomorphism: the decoded mean is the irfft of the mean of the
    workers' quantised coefficients, and it approximates the true mean."""
    codec = FftWireCodec(block=256, theta=0.8)
    xs = [smooth(3000, s) for s in range(3)]
    states = [CodecState() for _ in xs]
    run_round(codec, states, xs)  # dense
    for s in states:
        s.residual = None  # compare one round without error feedback
    a = states[0].shared
    mean, _rc = run_round(codec, states, xs)
    exact = sum(xs) / 3
    assert float((mean - exact).norm() / exact.norm()) < 0.2
    # the same mean from the coefficients directly
    spec = [
        torch.fft.rfft(
            torch.nn.functional.pad(x, (0, a.blocks * a.block - 3000)).view(a.blocks, a.block),
            norm="ortho",
        )
        for x in xs
    ]
    idx = torch.from_numpy(a.index)
    kept = torch.stack([torch.gather(s, 1, idx) for s in spec]).mean(0)
    dense = torch.zeros_like(spec[0])
    dense.scatter_(1, idx, kept)
    want = torch.fft.irfft(dense, n=a.block, norm="ortho").reshape(-1)[:3000]
    assert float((mean - want).norm() / want.norm()) < 0.05  # the range float's rounding


def test_error_feedback_keeps_what_was_not_sent() -> None:
    """Over rounds, what went out plus the last residual is what came in."""
    codec = FftWireCodec(block=128)
    st = CodecState()
    sent = torch.zeros(2000)
    fed = torch.zeros(2000)
    for r in range(6):
        x = smooth(2000, r)
        mean, _ = run_round(codec, [st], [x])
        sent += mean
        fed += x
    assert st.residual is not None
    torch.testing.assert_close(sent + st.residual, fed, atol=2e-5, rtol=1e-4)


def test_the_sweep_reaches_every_coefficient_and_large_ones_stay() -> None:
    codec = FftWireCodec(block=64, theta=0.75, explore=0.5)
    c = 33
    k = codec.keep(1)
    prev = Agreement(64, 64, np.arange(k, dtype=np.int64).reshape(1, k), np.zeros(1, np.int64))
    seen: set[int] = set()
    for r in range(1, 40):
        values = np.zeros((1, prev.k), complex)
        values[0, prev.index[0] == 20] = 5.0  # a large coefficient, once swept in
        nxt = codec.agree_sparse(prev, values, r)
        assert nxt.k == k and len(set(nxt.index[0])) == k
        assert np.all(np.diff(nxt.index[0]) > 0)
        if 20 in prev.index[0]:
            assert 20 in nxt.index[0]  # the top coefficient stays
        seen |= set(nxt.index[0].tolist())
        prev = nxt
    assert seen == set(range(c))


def test_agreement_is_deterministic_and_ties_go_to_the_lower_index() -> None:
    codec = FftWireCodec(block=64, theta=0.9, explore=0.0)
    prev = Agreement(64, 64, np.array([[3, 5, 7, 9]]), np.zeros(1, np.int64))
    values = np.array([[1.0, 2.0, 2.0, 1.0]], complex)
    nxt = codec.agree_sparse(prev, values, 1)
    assert nxt.k == codec.keep(1) == 4 and list(nxt.index[0]) == [3, 5, 7, 9]
    small = FftWireCodec(block=64, theta=0.95, explore=0.0)  # keeps 2
    assert list(small.agree_sparse(prev, values, 1).index[0]) == [5, 7]


def test_a_lost_packet_takes_its_coefficients_only() -> None:
    codec = FftWireCodec(block=64, theta=0.5)
    xs = [smooth(8000, s) for s in range(3)]
    states = [CodecState() for _ in xs]
    run_round(codec, states, xs)
    for s in states:
        s.residual = None
    full, _ = run_round(codec, [CodecState(shared=s.shared) for s in states], xs)
    lossy, rc = run_round(codec, states, xs, drop={(0, 1), (1, 1), (2, 1), (2, 0)})
    # packet 1 lost by everyone: its lanes' blocks lose those coefficients only
    per = rc.per_packet()
    a = rc.agreement
    first, last = per // (2 * a.k), -(-2 * per // (2 * a.k))
    diff = (lossy - full).view(-1)
    hit = slice(first * a.block, last * a.block)
    assert float(diff[hit].norm()) > 0
    assert float(diff[last * a.block :].norm()) == 0
    # the agreement learnt from the same lossy result is the same on every rank
    np.testing.assert_array_equal(states[0].shared.index, states[2].shared.index)


def test_ranges_come_from_the_largest_part_any_worker_sent() -> None:
    """The block exponents of the next round: the top exponent of the result's
    per-packet maxima over the block's packets plus `headroom`; without
    maxima, of the mean's largest part plus headroom + 1."""
    xs = [smooth(6000, s) * (1 + 3 * s) for s in range(3)]  # worker 2 the largest
    for headroom in (0, 1, 2):
        codec = FftWireCodec(block=256, headroom=headroom)
        states = [CodecState() for _ in xs]
        run_round(codec, states, xs)
        rcs = [codec.for_round(s) for s in states]
        per = rcs[0].per_packet()
        encs = [c.encode(x, per_packet=per) for c, x in zip(rcs, xs, strict=True)]
        worst = torch.stack([e.block_max for e in encs]).amax(0).numpy()
        a = rcs[0].agreement
        lane_max = np.repeat(worst, per)[: a.n_lanes].reshape(a.blocks, 2 * a.k).max(axis=1)
        st = CodecState(shared=a)
        sums = np.ones(a.n_lanes, np.float32)
        counts = np.full(worst.size, 3)
        rcs[0].learn(st, sums, counts, per_packet=per, maxima=worst)
        want = np.frexp(lane_max)[1] - 1 + headroom
        np.testing.assert_array_equal(st.shared.exponent, want)
        blind = CodecState(shared=a)
        rcs[0].learn(blind, sums, counts, per_packet=per)  # no maxima: the mean's
        mean_top = np.abs(np.ldexp(1.0 / 3, a.exponent))
        _, mean_exp = np.frexp(mean_top)
        assert (blind.shared.exponent == mean_exp - 1 + headroom + 1).all()


def test_theta_schedule_grows_the_set() -> None:
    codec = FftWireCodec(theta="diminishing", block=256)
    assert codec.keep(0) < codec.keep(2000)
    st = CodecState()
    run_round(codec, [st], [smooth(1000, 1)])
    st.rounds = 2000
    run_round(codec, [st], [smooth(1000, 2)])
    assert st.shared.k == codec.keep(2001)


# -- through the daemons -------------------------------------------------------------

DDP = {"bucket_cap_mb": 0.01}


def _fft_worker(rank: int, world: int, sockets: list[str], steps: int) -> dict[str, Any]:
    ref = reference_grads(rank, steps, **DDP)
    state = dlcp.init(codec="fft", socket=sockets[rank], round_timeout_s=30.0)
    model = nn.parallel.DistributedDataParallel(make_model(), **DDP)
    model.register_comm_hook(state, dlcp.hook)
    grads = train_steps(model, rank, steps)
    kinds = sorted({type(s.shared).__name__ for s in state.error_feedback.values()})
    counters = state.daemon_counters()
    stats = state.stats()
    state.close()
    return {"grads": grads, "ref": ref, "stats": stats, "kinds": kinds, "counters": counters}


@pytest.mark.parametrize("ranks_per_host", [1, 2])
def test_fft_ddp_over_daemons(tmp_path: Path, ranks_per_host: int) -> None:
    """Three hosts of one rank, or two hosts of two ranks (their daemon sums
    their range-float lanes into float32 before the network)."""
    hosts = 3 if ranks_per_host == 1 else 2
    with loopback_daemons(tmp_path, hosts, extra={"timing": {"timeout": 2.0}}) as ds:
        sockets = [d.socket for d in ds] * ranks_per_host
        results = spawn(_fft_worker, len(sockets), tmp_path, sockets=sockets, steps=4)
    for res in results:
        assert res["stats"]["fallbacks"] == 0 and res["stats"]["failures"] == 0
        assert res["kinds"] == ["Agreement"]
        # the first step is dense: PyTorch's mean
        for g, w in zip(res["grads"][0], res["ref"][0], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        for got, want in zip(res["grads"][1:], res["ref"][1:], strict=True):
            g = torch.cat([t.reshape(-1) for t in got])
            w = torch.cat([t.reshape(-1) for t in want])
            err = float((g - w).norm() / w.norm())
            assert 0 < err < 1.0
    # every replica applies the same update
    for res in results[1:]:
        for a, b in zip(res["grads"], results[0]["grads"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
