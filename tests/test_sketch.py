"""Sketch codec: the index union, homomorphism of the count sketch, peeling, the
median fallback counter, top-k sparsification, and convergence on digits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlcp.codecs import CodecState, get_codec
from dlcp.codecs.sketch import (
    HASHES,
    TOTALS,
    SketchCodec,
    bitmap_to_counts,
    cells_for,
    counts_to_bitmap,
    nonzero_bitmap,
    peel,
    sketch_cells,
    sketch_hashes,
    union_from_bitmap,
)
from dlcp.costmodel.digits import train_simulated
from dlcp.costmodel.exchange import average
from dlcp.errors import LocalError, RemoteError


def embedding_grad(numel: int, rows: list[int], dim: int, seed: int) -> torch.Tensor:
    """A gradient that is nonzero only in the embedding rows a batch touched."""
    g = torch.zeros(numel)
    gen = torch.Generator().manual_seed(seed)
    for r in rows:
        g[r * dim : (r + 1) * dim] = torch.randn(dim, generator=gen)
    return g


# -- the union ---------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(masks=st.lists(st.lists(st.booleans(), min_size=37, max_size=37), min_size=1, max_size=4))
def test_union_of_bitmaps_summed_as_counts(masks: list[list[bool]]) -> None:
    counts = np.zeros(37, dtype=np.uint16)
    for m in masks:
        x = torch.tensor(m, dtype=torch.float32) * 2.5
        packed = nonzero_bitmap(x)
        assert packed.numel() == 5
        counts += bitmap_to_counts(packed.numpy().tobytes(), 37)
    np.testing.assert_array_equal(counts, np.array(masks).sum(axis=0))
    union = union_from_bitmap(counts_to_bitmap(counts), 37)
    np.testing.assert_array_equal(union.numpy(), np.flatnonzero(np.array(masks).any(axis=0)))


def test_bitmap_of_the_wrong_length_is_a_remote_error() -> None:
    with pytest.raises(RemoteError):
        bitmap_to_counts(b"\0\0", 17)


# -- the count sketch ----------------------------------------------------------------


def test_hashes_are_shared_by_seed_and_stay_in_their_tables() -> None:
    union = torch.arange(0, 5000, 3)
    n = cells_for(union.numel())
    a, b = sketch_hashes(union, n, 7), sketch_hashes(union.numpy(), n, 7)
    np.testing.assert_array_equal(a.cells, b.cells)
    np.testing.assert_array_equal(a.signs, b.signs)
    assert not np.array_equal(a.cells, sketch_hashes(union, n, 8).cells)
    for j in range(HASHES):
        assert (a.cells[j] // a.table == j).all()
    assert set(np.unique(a.signs)) == {-1, 1}
    with pytest.raises(LocalError):
        sketch_hashes(union, n + 1, 7)


@settings(max_examples=40, deadline=None)
@given(
    u=st.integers(1, 300),
    seed=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_sketch_is_homomorphic(u: int, seed: int, data: st.DataObject) -> None:
    hashes = sketch_hashes(np.arange(u) * 5, cells_for(u), seed)
    ints = st.lists(st.integers(-(2**20), 2**20), min_size=u, max_size=u)
    a = torch.tensor(data.draw(ints), dtype=torch.int64)
    b = torch.tensor(data.draw(ints), dtype=torch.int64)
    # integer lanes: exact
    assert torch.equal(
        sketch_cells(a, hashes) + sketch_cells(b, hashes), sketch_cells(a + b, hashes)
    )
    # float lanes of integer values below 2**24: exact too
    fa, fb = a.float(), b.float()
    assert torch.equal(
        sketch_cells(fa, hashes) + sketch_cells(fb, hashes), sketch_cells(fa + fb, hashes)
    )


def test_peeling_is_exact_on_integers() -> None:
    u = 20_000
    hashes = sketch_hashes(np.arange(u), cells_for(u), 11)
    v = torch.randint(-1000, 1000, (u,), generator=torch.Generator().manual_seed(0))
    result = peel(sketch_cells(v, hashes), hashes)
    assert result.fallback == 0
    np.testing.assert_array_equal(result.values, v.numpy())


def test_peeling_stalls_into_the_counted_median_fallback() -> None:
    codec = SketchCodec(load=1.0)  # below the 3-hash peeling threshold of ~1.22
    x = torch.randn(30_000, generator=torch.Generator().manual_seed(5))
    before = TOTALS.median_fallback
    ex = average(codec, [x, x.roll(1)])
    assert codec.stats.decodes == 1
    assert codec.stats.stalled == 1
    assert codec.stats.median_fallback > 1000
    assert codec.stats.peeled + codec.stats.median_fallback == codec.stats.values == 30_000
    assert TOTALS.median_fallback - before == codec.stats.median_fallback
    assert float((ex.mean - (x + x.roll(1)) / 2).norm()) > 0  # not lossless any more


# -- the codec ----------------------------------------------------------------------


def test_sparse_gradients_are_averaged_losslessly() -> None:
    dim, rows = 16, 1000
    numel = dim * rows
    grads = [embedding_grad(numel, list(range(w * 40, w * 40 + 60)), dim, w) for w in range(3)]
    codec = get_codec("sketch")
    assert isinstance(codec, SketchCodec)
    ex = average(codec, grads, seed=99)
    torch.testing.assert_close(ex.mean, torch.stack(grads).mean(dim=0), atol=1e-6, rtol=1e-5)
    assert codec.stats.median_fallback == 0
    union = 140 * dim  # rows 0..139
    assert ex.phases == 2
    assert ex.push_bytes == numel // 8 + cells_for(union) * 4
    assert ex.push_bytes < numel * 4 / 4


def test_top_k_sparsification_with_error_feedback() -> None:
    codec = SketchCodec(keep=0.1)
    state = CodecState()
    x = torch.randn(1000, generator=torch.Generator().manual_seed(6))
    prep = codec.prepare(x, state)
    assert int((prep.values != 0).sum()) == 100
    assert state.residual is not None
    torch.testing.assert_close(prep.values + state.residual, x)
    kept = prep.values.abs()[prep.values != 0]
    dropped = state.residual.abs()[state.residual != 0]
    assert float(kept.min()) >= float(dropped.max())
    enc = codec.encode_prepared(prep, union_from_bitmap(prep.bitmap, 1000), seed=1, per_packet=352)
    assert enc.n_lanes == cells_for(100)


def test_decode_needs_the_union_and_one_contributor_count() -> None:
    codec = SketchCodec()
    enc = codec.encode(torch.tensor([0.0, 1.0, 0.0, 2.0]), per_packet=352)
    union = torch.tensor([1, 3])
    sums = torch.frombuffer(bytearray(enc.lanes.numpy().tobytes()), dtype=torch.float32)
    out = codec.decode(sums, 1, numel=4, per_packet=352, union=union)
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0, 0.0, 2.0]))
    with pytest.raises(LocalError):
        codec.decode(sums, 1, numel=4, per_packet=352)
    with pytest.raises(LocalError):
        codec.decode(sums, torch.tensor([1, 2]), numel=4, per_packet=352, union=union)
    with pytest.raises(LocalError):
        SketchCodec(keep=0.0)


def test_dense_gradients_cost_more_than_fp32() -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(7))
    ex = average(SketchCodec(), [x, -x * 0.5])
    assert ex.push_bytes > 4096 * 4
    torch.testing.assert_close(ex.mean, x * 0.25, atol=1e-5, rtol=1e-4)


# -- convergence ------------------------------------------------------------------------


def test_digits_converges_close_to_fp32() -> None:
    torch.set_num_threads(1)
    base = train_simulated(None, epochs=6).accuracy
    top5 = train_simulated(SketchCodec(keep=0.05), epochs=6).accuracy
    assert base > 0.9
    assert top5 >= base - 0.025


# -- loss on the wire: cell packets dropped within the bound ----------------------


def _summed_cells(
    grads: list[torch.Tensor], codec: SketchCodec, seed: int, per_packet: int
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    preps = [codec.prepare(g) for g in grads]
    counts = sum(
        bitmap_to_counts(p.bitmap.numpy().tobytes(), g.numel())
        for p, g in zip(preps, grads, strict=True)
    )
    union = union_from_bitmap(counts_to_bitmap(counts), grads[0].numel())
    cells = [
        torch.from_numpy(
            np.frombuffer(
                codec.encode_prepared(p, union, seed=seed, per_packet=per_packet)
                .lanes.numpy()
                .tobytes(),
                np.float32,
            ).copy()
        )
        for p in preps
    ]
    return union, torch.stack(cells).sum(dim=0), cells


def test_a_dropped_packet_of_cells_is_peeled_around() -> None:
    dim, rows, per = 16, 1000, 352
    numel = dim * rows
    grads = [embedding_grad(numel, list(range(w * 40, w * 40 + 60)), dim, w) for w in range(3)]
    codec = SketchCodec()
    union, sums, cells = _summed_cells(grads, codec, seed=5, per_packet=per)
    packets = -(-sums.numel() // per)
    counts = torch.full((packets,), 3)
    lost = slice(2 * per, 3 * per)  # worker 1's packet 2 never came (droppable)
    sums[lost] -= cells[1][lost]
    counts[2] = 2
    want = torch.stack(grads).mean(dim=0)
    got = codec.decode(sums, counts, numel=numel, per_packet=per, seed=5, union=union)
    exact = (got - want).abs()[union] < 1e-5
    assert float(exact.float().mean()) > 0.99  # peeled around the erased cells
    # read as if intact, the partial cells spoil the values peeled through them
    naive = codec.decode(sums, 3, numel=numel, per_packet=per, seed=5, union=union)
    assert float(((naive - want).abs()[union] < 1e-5).float().mean()) < float(exact.float().mean())


def test_an_index_with_every_cell_erased_decodes_to_zero_and_is_counted() -> None:
    union = torch.arange(50)
    hashes = sketch_hashes(union, cells_for(50), seed=3)
    values = torch.arange(1.0, 51.0)
    cells = sketch_cells(values, hashes).numpy()
    erased = np.zeros(hashes.n_cells, bool)
    erased[hashes.cells[:, 7]] = True  # index 7's three cells
    res = peel(cells, hashes, erased=erased)
    assert res.values[7] == 0.0 and res.unreached >= 1 and res.fallback >= res.unreached
    others = np.delete(np.arange(50), 7)
    assert (np.abs(res.values[others] - values.numpy()[others]) < 1e-4).mean() > 0.9
    with pytest.raises(LocalError):
        peel(cells, hashes, erased=erased[:-1])
    with pytest.raises(LocalError, match="contributor counts"):
        SketchCodec().decode(
            torch.from_numpy(cells), torch.ones(5), numel=50, per_packet=4, union=union
        )
