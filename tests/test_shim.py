"""dlcp.shim without a daemon: per-packet metadata, the out buffer and averaging by
contributor counts, rendezvous planning, pickling, and the fallback path with a
real 3-process gloo group on loopback (DLCP_SOCKET points nowhere).

The helpers at the top (`spawn`, `make_model`, `train_steps`) are shared with
tests/test_shim_loopback.py and tests/test_shim_netns.py.
"""

from __future__ import annotations

import fcntl
import inspect
import io
import os
import pickle
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import dlcp.shim as dlcp
from dlcp.codecs import CodecState, get_codec
from dlcp.codecs import lanes as lane_ops
from dlcp.core.layout import Layout
from dlcp.errors import LocalError
from dlcp.shim.arena import Arena, Region
from dlcp.shim.client import SealedSegment, Segment, memfd_supported
from dlcp.shim.exchange import RoundPlan, decode_round, round_seed
from dlcp.shim.layers import MAX_LAYER, LayerMap, packet_layers, param_offsets
from dlcp.shim.regions import meta_size, read_out, region_sizes, write_meta
from dlcp.shim.rendezvous import all_gather, first_failure, plan_membership
from dlcp.shim.staging import Staging
from dlcp.wire.header import Codec
from tests.daemons import free_tcp_port

# -- shared helpers (multi-process) ------------------------------------------------


def _entry(
    rank: int, world: int, port: int, fn: Callable[..., Any], out: str, kwargs: dict[str, Any]
) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        result = fn(rank, world, **kwargs)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
        # no rank tears its Gloo pairs down while a peer may still be reading
        # from them (a peer's early close can abort a rank inside Gloo)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    dlcp.exit_process(0)  # no interpreter finalization racing Gloo's threads: dlcp.shim.leave


def spawn(fn: Callable[..., Any], world: int, tmp: Path, **kwargs: Any) -> list[Any]:
    """Run fn(rank, world, **kwargs) in `world` processes of one gloo group on
    loopback; returns what each rank returned (torch.save-able)."""
    mp.spawn(_entry, args=(world, free_tcp_port(), fn, str(tmp), kwargs), nprocs=world, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)
    )


def train_steps(
    ddp: nn.Module,
    rank: int,
    steps: int,
    *,
    batch: int = 8,
    between: Callable[[int], None] | None = None,
) -> list[list[torch.Tensor]]:
    """`steps` backward passes on rank-specific data; the gradients after each."""
    gen = torch.Generator().manual_seed(1000 + rank)
    grads = []
    for step in range(steps):
        if between is not None:
            between(step)
        x = torch.randn(batch, 20, generator=gen)
        ddp(x).pow(2).mean().backward()
        grads.append([p.grad.detach().clone() for p in ddp.parameters()])  # type: ignore[union-attr]
        for p in ddp.parameters():
            p.grad = None
    return grads


def reference_grads(rank: int, steps: int, **ddp_kw: Any) -> list[list[torch.Tensor]]:
    """The same steps through PyTorch's default all-reduce hook."""
    ref = nn.parallel.DistributedDataParallel(make_model(), **ddp_kw)
    ref.register_comm_hook(None, allreduce_hook)
    return train_steps(ref, rank, steps)


# -- per-packet metadata -----------------------------------------------------------

# (spans as (offset, numel, layer), numel, per_packet, packets, expected layers)
LAYER_CASES = [
    ([(0, 10, 3)], 10, 4, 3, [3, 3, 3]),
    ([(0, 4, 2), (4, 4, 1)], 8, 4, 2, [2, 1]),
    # a packet holding two parameters takes the smaller (front) layer
    ([(0, 6, 5), (6, 6, 0)], 12, 4, 3, [5, 0, 0]),
    ([(0, 6, 0), (6, 6, 5)], 12, 4, 3, [0, 0, 5]),
    # THC padding: the last block holds elements beyond numel
    ([(0, 5, 7)], 5, 4, 2, [7, 7]),
    # elements no parameter covers: layer 0
    ([(4, 4, 9)], 12, 4, 3, [0, 9, 0]),
    # DDP order: back layers first in the buffer
    ([(0, 3, 4), (3, 21, 3), (24, 7, 2), (31, 35, 1)], 66, 32, 3, [1, 1, 1]),
    ([(0, 3, 4), (3, 21, 3), (24, 8, 2), (32, 34, 1)], 66, 32, 3, [2, 1, 1]),
    ([(0, 1, MAX_LAYER)], 1, 8, 1, [MAX_LAYER]),
]


@pytest.mark.parametrize(("spans", "numel", "per_packet", "packets", "want"), LAYER_CASES)
def test_packet_layers(
    spans: list[tuple[int, int, int]], numel: int, per_packet: int, packets: int, want: list[int]
) -> None:
    got = packet_layers(spans, numel, per_packet, packets)
    assert got.dtype == np.uint16
    assert got.tolist() == want


def test_param_offsets_follow_views_into_the_bucket() -> None:
    buf = torch.zeros(100)
    views = [buf[0:10].view(2, 5), buf[12:30], buf[40:41]]
    assert param_offsets(buf, views) == [0, 12, 40]
    # gradients that are not views are laid out back to back
    assert param_offsets(buf, [torch.zeros(3), torch.zeros(4), torch.zeros(1)]) == [0, 3, 7]


def test_layer_map_from_the_model_is_parameter_order() -> None:
    model = make_model()
    params = list(model.parameters())
    lm = LayerMap(model)
    assert lm.layers_of(reversed(params)) == list(reversed(range(len(params))))
    assert lm.n_layers == len(params)
    lm.observe(params)
    lm.end_step()  # a model's map never changes
    assert lm.layers_of(params) == list(range(len(params)))


def test_layer_map_learns_the_reverse_of_ddp_order() -> None:
    params = list(make_model().parameters())
    lm = LayerMap()
    assert lm.layers_of(params) == [0] * len(params)  # nothing known yet
    # DDP hands back layers first, in two buckets
    lm.observe(list(reversed(params))[:3])
    lm.observe(list(reversed(params))[3:])
    lm.end_step()
    assert lm.layers_of(params) == list(range(len(params)))
    version = lm.version
    lm.observe(reversed(params))
    lm.end_step()
    assert lm.version == version  # the same order does not invalidate caches


def test_meta_region_layout() -> None:
    buf = bytearray(meta_size(3) + 5)
    write_meta(memoryview(buf), [1, 2, 65535], [0.5, 1.5, 2.5], [4.0, 5.0, 6.0])
    assert len(buf) - 5 == 30
    assert np.frombuffer(bytes(buf[0:6]), "<u2").tolist() == [1, 2, 65535]
    assert np.frombuffer(bytes(buf[6:18]), "<f4").tolist() == [0.5, 1.5, 2.5]
    assert np.frombuffer(bytes(buf[18:30]), "<f4").tolist() == [4.0, 5.0, 6.0]
    with pytest.raises(LocalError):
        write_meta(memoryview(buf), [1], [1.0, 2.0], [0.0])


@pytest.mark.parametrize(
    ("codec", "sums_bytes_per_lane"), [("fp32", 4), ("fp16", 2), ("thc8", 2), ("thc4", 2)]
)
def test_region_sizes_follow_the_protocol(codec: str, sums_bytes_per_lane: int) -> None:
    c = get_codec(codec)
    plan = RoundPlan.make(c, 5000, shards=3, payload=1408, round_=0, bucket=0)
    lay = plan.layout
    sizes = region_sizes(lay)
    assert sizes.data == c.lane_bytes(lay.total)
    assert sizes.meta == 10 * lay.packets
    assert sizes.sums == sums_bytes_per_lane * lay.total
    assert sizes.out == sizes.sums + 6 * lay.packets
    assert sizes.total % 64 == 0


def test_round_seed_is_shared_and_distinct() -> None:
    seeds = {round_seed(r, b) for r in range(50) for b in range(20)}
    assert len(seeds) == 1000
    assert all(0 <= s < 2**64 for s in seeds)
    assert round_seed(7, 3) == round_seed(7, 3)


# -- the out buffer and averaging by contributor counts -------------------------------


def _region(seg: Segment, layout: Layout) -> Region:
    sizes = region_sizes(layout)
    return Region(seg, data=0, meta=0, out=0, sizes=sizes)


def _write_out(
    region: Region, layout: Layout, sums: np.ndarray, counts: np.ndarray, maxima: np.ndarray
) -> None:
    body = (
        lane_ops.pack(layout.codec, sums, True)
        + counts.astype("<u2").tobytes()
        + maxima.astype("<f4").tobytes()
    )
    assert len(body) == region.sizes.out
    region.out_view()[:] = body


@pytest.fixture
def segment() -> Any:
    seg = Segment(f"dlcp-test-{os.getpid()}-{threading.get_ident()}", 4 << 20)
    yield seg
    seg.close()


def test_read_out_parses_sums_counts_and_maxima(segment: Segment) -> None:
    layout = Layout(1000, Codec.FP32, 2, 1408)  # 352 lanes per packet: 3 packets
    region = _region(segment, layout)
    sums = np.arange(1000, dtype=np.float32)
    _write_out(region, layout, sums, np.array([3, 2, 0]), np.array([1.0, 2.0, 3.0]))
    out = read_out(region.out_view(), layout)
    np.testing.assert_array_equal(out.sums, sums)
    assert out.counts.tolist() == [3, 2, 0]
    assert out.maxima.tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("codec", ["fp32", "fp16"])
def test_float_average_divides_each_packet_by_its_contributors(
    segment: Segment, codec: str
) -> None:
    c = get_codec(codec)
    plan = RoundPlan.make(c, 2000, shards=3, payload=1408, round_=4, bucket=1)
    layout = plan.layout
    pp = layout.per_packet
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(2000).astype(np.float32) for _ in range(3)]
    counts = np.array([3, 2, 0, 1, 3, 3][: layout.packets], dtype=np.uint16)
    sums = np.zeros(2000, np.float32)
    for i, cnt in enumerate(counts):
        sl = slice(i * pp, (i + 1) * pp)
        for x in xs[:cnt]:  # the first `cnt` contributions reached this packet
            sums[sl] += x[sl].astype(np.float16 if codec == "fp16" else np.float32)
    region = _region(segment, layout)
    _write_out(region, layout, sums, counts, np.zeros(layout.packets))
    mean = decode_round(plan, region, torch.device("cpu"), Staging()).mean
    for i, cnt in enumerate(counts):
        sl = slice(i * pp, (i + 1) * pp)
        want = sum(x[sl] for x in xs[:cnt]) / cnt if cnt else np.zeros_like(xs[0][sl])
        tol = 2e-3 if codec == "fp16" else 1e-6
        np.testing.assert_allclose(mean[sl].numpy(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("codec", ["fp32", "fp16", "thc8"])
@pytest.mark.parametrize("lossy", [False, True])
def test_decode_into_the_bucket_is_the_same_mean(segment: Segment, codec: str, lossy: bool) -> None:
    """`into`: a float codec's round is divided straight into the bucket (no
    tensor of its size made), whether every packet has the same count or one
    is short of contributions (lanes lost within the bound), and THC rotates
    back into it whatever the counts. Either way the mean is the same, to
    the bit."""
    c = get_codec(codec)
    plan = RoundPlan.make(c, 2000, shards=3, payload=1408, round_=4, bucket=1)
    if plan.scaled:
        scale = torch.ones(plan.packets)
        plan = RoundPlan.make(c, 2000, shards=3, payload=1408, round_=4, bucket=1, scale=scale)
    layout = plan.layout
    rng = np.random.default_rng(2)
    if plan.scaled:  # THC: integer sums of three contributions
        sums = rng.integers(0, 3 * 255, layout.total).astype(np.uint16)
    else:
        sums = (rng.standard_normal(layout.total) * 4).astype(np.float32)
    counts = np.full(layout.packets, 3, np.uint16)
    if lossy:
        counts[1] = 2
    region = _region(segment, layout)
    _write_out(region, layout, sums, counts, np.ones(layout.packets))
    want = decode_round(plan, region, torch.device("cpu"), Staging()).mean.clone()
    bucket = torch.full((2000,), -1.0)
    got = decode_round(plan, region, torch.device("cpu"), Staging(), bucket)
    direct = True  # every codec here decodes into the bucket
    assert (got.mean is bucket) is direct
    assert torch.equal(got.mean, want)
    assert torch.equal(bucket, want) if direct else bool((bucket == -1.0).all())
    # a bucket of another dtype or size is never written
    half = torch.zeros(2000, dtype=torch.float16)
    assert decode_round(plan, region, torch.device("cpu"), Staging(), half).mean is not half
    assert not half.any()


@pytest.mark.parametrize("codec", ["thc8", "thc4"])
def test_thc_average_from_integer_sums(segment: Segment, codec: str) -> None:
    c = get_codec(codec)
    n = 3000
    rng = np.random.default_rng(1)
    xs = [torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for _ in range(3)]
    plan0 = RoundPlan.make(c, n, shards=2, payload=1408, round_=2, bucket=0)
    encs0 = [c.encode(x, per_packet=plan0.per_packet, seed=plan0.seed) for x in xs]
    scale = torch.stack([e.block_max for e in encs0]).amax(0)
    plan = RoundPlan.make(c, n, shards=2, payload=1408, round_=2, bucket=0, scale=scale)
    layout = plan.layout
    total = None
    for x in xs:
        enc = c.encode(x, per_packet=plan.per_packet, seed=plan.seed, scale=scale)
        lanes = lane_ops.unpack(layout.codec, enc.lanes.numpy().tobytes(), layout.total, False)
        v = lanes.astype(np.uint16)
        total = v if total is None else total + v
    assert total is not None
    counts = np.full(layout.packets, 3, dtype=np.uint16)
    counts[-1] = 0  # the last packet was lost altogether
    total[-layout.per_packet :] = 0
    region = _region(segment, layout)
    _write_out(region, layout, total, counts, np.zeros(layout.packets))
    mean = decode_round(plan, region, torch.device("cpu"), Staging()).mean
    want = (xs[0] + xs[1] + xs[2]) / 3
    kept = (layout.packets - 1) * layout.per_packet
    assert torch.all(mean[kept:] == 0)
    err = float((mean[:kept] - want[:kept]).norm() / want[:kept].norm())
    assert err < (0.05 if codec == "thc8" else 0.5)


# -- the arena ------------------------------------------------------------------


class _StubClient:
    def __init__(self) -> None:
        self.segments: list[str] = []

    def segment(self, seg: Segment | SealedSegment) -> None:
        if isinstance(seg, Segment):
            assert os.path.exists(seg.path)
        self.segments.append(seg.name)


def test_arena_makes_sealed_segments_where_the_kernel_has_them() -> None:
    client = _StubClient()
    arena = Arena(client, f"dlcp-arena-s{os.getpid()}", 1)  # type: ignore[arg-type]
    try:
        assert isinstance(arena.segment, SealedSegment if memfd_supported() else Segment)
        if memfd_supported():  # the daemon may map it: it cannot shrink
            seals = fcntl.fcntl(arena.segment.fd, fcntl.F_GET_SEALS)
            assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_SEAL
            with pytest.raises(PermissionError):
                os.ftruncate(arena.segment.fd, 0)
            assert not os.path.exists(f"/dev/shm/{arena.segment.name}")
    finally:
        arena.close()


@pytest.mark.parametrize("kind", [Segment, SealedSegment])
def test_a_segment_is_page_locked_for_cuda_only_where_cuda_is(kind: type) -> None:
    """`pin_for_cuda` (GPU buckets: one DMA each way, dlcp.shim.pinning) is
    tried once, is False without a CUDA device, and `close` releases either
    way; tests/test_shim_cuda.py covers the page-locked case."""
    seg = kind(f"dlcp-pin-{os.getpid()}", 1 << 16)
    try:
        assert seg.pin_for_cuda() is torch.cuda.is_available()
        assert seg.pinned is torch.cuda.is_available()
        assert seg.pin_for_cuda() is seg.pinned
    finally:
        seg.close()
    assert not seg.pinned


def test_staging_ignores_direct_for_cpu_tensors(segment: Segment) -> None:
    """`direct` concerns CUDA tensors; CPU bytes are copied and read in place."""
    staging = Staging()
    src = torch.arange(256, dtype=torch.uint8).repeat(4)
    staging.write(segment.buf[64 : 64 + src.numel()], src, direct=True)
    host = np.frombuffer(segment.buf, np.uint8, src.numel(), 64)
    assert bytes(host) == src.numpy().tobytes()
    back = staging.to_device(host, torch.device("cpu"), direct=True)
    assert torch.equal(back, src) and back.data_ptr() == host.ctypes.data
    del host, back


def test_arena_cuts_aligned_regions_grows_and_unlinks() -> None:
    client = _StubClient()
    prefix = f"dlcp-arena-{os.getpid()}"
    arena = Arena(client, prefix, 1, sealed=False)  # type: ignore[arg-type]
    try:
        assert not os.path.exists(f"/dev/shm/{prefix}-0")  # unlinked once mapped
        sizes = region_sizes(Layout(1000, Codec.FP32, 1, 1408))
        a = arena.take(sizes)
        b = arena.take(sizes)
        assert a.data % 64 == a.meta % 64 == a.out % 64 == b.data % 64 == 0
        assert a.meta >= a.data + sizes.data and a.out >= a.meta + sizes.meta
        assert b.data >= a.out + sizes.out
        a.out_view()[:4] = b"abcd"
        big = region_sizes(Layout(1 << 20, Codec.FP32, 1, 1408))
        assert not arena.fits(big)
        arena.grow(big.total)
        c = arena.take(big)
        assert c.segment is not a.segment and client.segments == [f"{prefix}-0", f"{prefix}-1"]
        assert bytes(a.out_view()[:4]) == b"abcd"  # the old segment stays readable
        arena.reset()
        assert arena.used == 0
    finally:
        arena.close()


# -- rendezvous ---------------------------------------------------------------------


def _daemon(did: str, addr: str, payload: int = 1408) -> dict[str, Any]:
    return {"id": did, "addresses": [addr], "udp_port": 7400, "payload": payload}


def test_plan_membership_groups_ranks_by_daemon_and_orders_hosts_by_lowest_rank() -> None:
    daemons = [
        _daemon("b", "10.0.0.2"),
        _daemon("a", "10.0.0.1", payload=1200),
        _daemon("b", "10.0.0.2"),
        _daemon("c", "10.0.0.3"),
        _daemon("a", "10.0.0.1", payload=1200),
    ]
    secret = {"job": 17, "key": "ab" * 32}
    plans = [plan_membership(daemons, r, secret) for r in range(5)]
    hosts = [h["addresses"][0] for h in plans[0].hosts]
    assert hosts == ["10.0.0.2", "10.0.0.1", "10.0.0.3"]
    assert [p.me for p in plans] == [0, 1, 0, 2, 1]
    assert [p.local_ranks for p in plans] == [2, 2, 2, 1, 2]
    assert all(p.hosts == plans[0].hosts and p.payload == 1200 for p in plans)
    assert plans[3].host_of_rank == [0, 1, 0, 2, 1]
    fields = plans[1].join_fields("transpose")
    assert fields["job"] == 17 and fields["me"] == 1 and fields["local_ranks"] == 2


def test_all_gather_through_a_store_and_first_failure() -> None:
    store = dist.HashStore()
    out: dict[int, list[dict[str, Any]]] = {}

    def rank(r: int) -> None:
        value = {"ok": r != 2, "error": "no daemon"} if r == 2 else {"ok": True, "r": r}
        out[r] = all_gather(store, "t/1", r, 4, value, timeout=10)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(out[r] == out[0] for r in range(4))
    assert [e.get("r") for e in out[0]] == [0, 1, None, 3]
    assert first_failure(out[0]) == "rank 2: no daemon"
    assert first_failure([{"ok": True}]) is None


# -- pickling -------------------------------------------------------------------


def test_state_pickles_without_sockets_and_restores_feedback() -> None:
    state = dlcp.DlcpState(codec="thc8", loss_bound=0.02, retry_steps=3, model=make_model())
    state.round = 12
    state.fallbacks = 5
    state.error_feedback[("ddp", "thc8", 0, 10)] = CodecState(residual=torch.arange(10.0), rounds=3)
    state.scales.by_key[("ddp", "thc8", 0, 10)] = torch.ones(1)
    for load in (
        lambda s: pickle.loads(pickle.dumps(s)),
        lambda s: torch.load(_saved(s), weights_only=False),
    ):
        copy = load(state)
        assert isinstance(copy, dlcp.DlcpState)
        assert (copy.codec, copy.loss_bound, copy.retry_steps) == ("thc8", 0.02, 3)
        assert (copy.round, copy.fallbacks) == (12, 5)
        ef = copy.error_feedback[("ddp", "thc8", 0, 10)]
        torch.testing.assert_close(ef.residual, torch.arange(10.0))
        assert ef.rounds == 3
        assert not copy.attached and copy.attachment.due  # reconnects on first use
        assert copy.link is None and copy.attachment.group is None and copy.attachment.store is None


def _saved(obj: object) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_hooks_carry_the_annotations_ddp_checks() -> None:
    for fn in (dlcp.hook, dlcp.make_hook("thc8")):
        sig = inspect.signature(fn)
        assert sig.parameters["bucket"].annotation is dist.GradBucket
        assert sig.return_annotation == torch.futures.Future[torch.Tensor]


def test_state_validates_its_settings() -> None:
    with pytest.raises(LocalError):
        dlcp.DlcpState(codec="zip")
    with pytest.raises(LocalError):
        dlcp.DlcpState(loss_bound=0.7)
    with pytest.raises(LocalError):
        dlcp.DlcpState(retry_steps=0)
    with pytest.raises(LocalError):
        dlcp.DlcpState(scale_mode="guess")
    with pytest.raises(LocalError):
        dlcp.make_hook("zip")


# -- fallback with a real gloo group and no daemon ----------------------------------

NO_DAEMON = "/nonexistent/dlcp-test.sock"


def _fallback_worker(rank: int, world: int, steps: int) -> dict[str, Any]:
    ddp_kw = {"bucket_cap_mb": 0.01}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = dlcp.init(codec="fp32", socket=NO_DAEMON, retry_steps=2, connect_timeout_s=1.0)
        model = nn.parallel.DistributedDataParallel(make_model(), **ddp_kw)
        model.register_comm_hook(state, dlcp.hook)
        grads = train_steps(model, rank, steps)
        t = torch.full((1000,), float(rank))
        dlcp.all_reduce(t)
    ref = reference_grads(rank, steps, **ddp_kw)
    ours = [w for w in caught if "dlcp" in str(w.message)]
    return {
        "grads": grads,
        "ref": ref,
        "mean": t,
        "stats": state.stats(),
        "warnings": len(ours),
    }


def test_fallback_hook_equals_the_default_hook_without_a_daemon(tmp_path: Path) -> None:
    steps = 5
    results = spawn(_fallback_worker, 3, tmp_path, steps=steps)
    for res in results:
        for got, want in zip(res["grads"], res["ref"], strict=True):
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
        torch.testing.assert_close(res["mean"], torch.full((1000,), 1.0))
        stats = res["stats"]
        assert not stats["attached"]
        assert stats["fallbacks"] >= steps + 1  # every bucket and the all_reduce
        # tried at init, then every 2 steps: before steps 3 and 5
        assert stats["failures"] == 3
        assert stats["attaches"] == 0
        assert "daemon unavailable" in stats["last_error"]
        assert res["warnings"] == 1  # warned once
    assert len({r["stats"]["fallbacks"] for r in results}) == 1


def _strict_worker(rank: int, world: int) -> dict[str, str]:
    out = {}
    try:
        dlcp.init(codec="fp32", socket=NO_DAEMON, strict=True, connect_timeout_s=1.0)
    except dlcp.ShimError as exc:
        out["init"] = str(exc)
    state = dlcp.DlcpState(socket=NO_DAEMON, strict=True, connect_timeout_s=1.0)
    model = nn.parallel.DistributedDataParallel(make_model())
    model.register_comm_hook(state, dlcp.hook)
    try:
        train_steps(model, rank, 1)
    except dlcp.ShimError as exc:
        out["hook"] = str(exc)
    return out


def test_strict_raises_on_every_rank_instead_of_falling_back(tmp_path: Path) -> None:
    results = spawn(_strict_worker, 2, tmp_path)
    for res in results:
        assert "dlcp is unavailable" in res.get("init", "") and "rank 0" in res["init"]
        assert "dlcp is unavailable" in res.get("hook", "")


def test_exit_process_flushes_what_was_written_and_keeps_the_code() -> None:
    prog = (
        "import logging, sys\n"
        "from dlcp.shim.leave import exit_process\n"
        "logging.basicConfig(stream=sys.stderr, format='%(message)s')\n"
        "sys.stdout.write('partial line, no newline')\n"
        "logging.getLogger('t').warning('logged')\n"
        "sys.stderr.write('err tail')\n"
        "exit_process(3)\n"
        "print('never')\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", prog], capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 3
    assert res.stdout == "partial line, no newline"
    assert res.stderr == "logged\nerr tail"
    none = subprocess.run(
        [sys.executable, "-c", "from dlcp.shim.leave import exit_process; exit_process(None)"],
        timeout=120,
        check=False,
    )
    assert none.returncode == 0
