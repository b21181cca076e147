"""One bucket of the sketch codec through the daemon: two rounds.

The sketch (`dlcp.codecs.sketch`, arXiv 2402.07529) needs every worker to
agree on the union U of their nonzero indices before it can sketch its values
over U, so a bucket takes two all-reduce rounds of the same (round, bucket):

1. the index union: this rank's nonzero bitmap as wire codec UNION (1-bit
   lanes, the OR comes back), under bucket id `bucket | UNION_BUCKET`, always
   with loss bound 0 (a lost bit would lose that index for every worker). The
   caller waits for it here: phase 2's size depends on |U|.
2. the cells: `cells_for(|U|)` fp32 lanes as wire codec SKETCH under the
   bucket's own id and the caller's loss bound (the drop policy marks the
   same packets of cells droppable on every rank, `cell_norms`; decode peels
   around the cells of those that are lost).

`submit_sketch` returns the phase-2 `Submitted`, whose plan carries U, so the
step's end decodes it like any other round (`exchange.decode_round`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dlcp.codecs import CodecState
from dlcp.codecs.base import per_packet_norms
from dlcp.codecs.sketch import SketchCodec, union_from_bitmap
from dlcp.core.layout import Layout
from dlcp.errors import LocalError
from dlcp.shim.arena import Region
from dlcp.shim.client import DaemonClient
from dlcp.shim.exchange import RoundPlan, Submitted
from dlcp.shim.regions import RegionSizes, read_out, region_sizes, write_meta
from dlcp.shim.staging import Staging
from dlcp.shim.timeline import BucketTimes
from dlcp.wire.header import Codec as WireCodec

__all__ = ["UNION_BUCKET", "cell_norms", "submit_sketch", "union_plan"]

UNION_BUCKET = 1 << 31  # bit of the bucket id that marks a bucket's union round


def union_plan(plan: RoundPlan) -> RoundPlan:
    """Phase 1 of a sketch round `plan`: a bit per value of the bucket."""
    if plan.bucket & UNION_BUCKET:
        raise LocalError(f"sketch bucket id {plan.bucket} uses bit 31 (the union round's)")
    lay = plan.layout
    layout = Layout(plan.numel, WireCodec.UNION, lay.shards, lay.payload)
    return dataclasses.replace(plan, layout=layout, bucket=plan.bucket | UNION_BUCKET)


def cell_norms(seed: int, packets: int) -> npt.NDArray[np.float32]:
    """The per-packet norms every rank gives its daemon for the cells: the same
    on every rank (drawn from the round's seed), so the drop policy marks the
    same packets droppable on every rank, and a round's erased cells stay
    within the bound's share (each rank choosing its own smallest packets
    would erase up to H times that). No cell matters more than another: decode
    peels around any erased one."""
    return (1.0 + np.random.default_rng(seed).random(packets)).astype(np.float32)


def _submit(
    client: DaemonClient,
    region: Region,
    plan: RoundPlan,
    lanes: torch.Tensor,
    meta: tuple[npt.ArrayLike, npt.ArrayLike, npt.ArrayLike],
    *,
    job: int,
    bound: float,
    staging: Staging,
) -> Future[dict[str, Any]]:
    direct = lanes.is_cuda and region.segment.pin_for_cuda()
    staging.write(region.data_view(), lanes, direct=direct)
    write_meta(region.meta_view(), *meta)
    return client.submit(
        job=job,
        round=plan.round,
        bucket=plan.bucket,
        codec=WireCodec(plan.layout.codec).name.lower(),
        total=plan.layout.total,
        bound=bound,
        scale=0.0,
        **region.submit_fields(),
    )


def submit_sketch(
    client: DaemonClient,
    take: Callable[[RegionSizes], Region],
    plan: RoundPlan,
    x: torch.Tensor,
    *,
    job: int,
    bound: float,
    layers: Callable[[RoundPlan], npt.NDArray[np.uint16]],
    state: CodecState | None,
    staging: Staging,
    timeout: float,
    times: BucketTimes | None = None,
    stand_in: str | None = None,
) -> Submitted:
    """Both rounds of the sketch bucket `x` (left unchanged): the union, waited
    for, then the cells, submitted. `take` gives a region of the segment;
    `layers(plan)` the per-packet layers of a plan over the bucket's values
    (the union's packets have them; every packet of cells gets the bucket's
    front layer, since cells mix the whole bucket). Raises on any failure
    (the caller records it for the step's agreement).

    A rank that cannot contribute (`x` not finite, or `stand_in`: why, e.g.
    an earlier bucket of the step failed) still takes part in both rounds
    with zeros, so that the other ranks, waiting for this bucket's union in
    their hooks, are not held until the daemons' round timeout; it waits for
    the cells' round to end too (its regions are free again) and raises
    `LocalError` with the reason."""
    codec = plan.codec
    if not isinstance(codec, SketchCodec):
        raise LocalError(f"submit_sketch needs the sketch codec, not {codec.name}")
    if stand_in is None:
        try:
            prep = codec.prepare(x, state)
        except LocalError as exc:  # non-finite values: nothing was sent or changed yet
            stand_in = str(exc)
    if stand_in is not None:
        prep = codec.prepare(torch.zeros(x.numel(), device=x.device))
    uplan = union_plan(plan)
    lay_u = layers(uplan)
    uregion = take(region_sizes(uplan.layout))
    norms = per_packet_norms(prep.values, uplan.per_packet).cpu().numpy()
    reply = _submit(
        client,
        uregion,
        uplan,
        prep.bitmap,
        (lay_u, norms, np.zeros(uplan.packets, np.float32)),
        job=job,
        bound=0.0,
        staging=staging,
    )
    reply.result(timeout)
    union = union_from_bitmap(read_out(uregion.out_view(), uplan.layout).sums, plan.numel)
    union = union.to(prep.values.device)
    lay = plan.layout
    cells = Layout(codec.cells_for(union.numel()), WireCodec.SKETCH, lay.shards, lay.payload)
    cplan = dataclasses.replace(plan, layout=cells, union=union)
    enc = codec.encode_prepared(prep, union, seed=plan.seed, per_packet=cplan.per_packet)
    if times is not None:
        times.encoded = time.perf_counter()
    region = take(region_sizes(cells))
    block_max = enc.block_max.detach().to("cpu", torch.float32)
    front = int(lay_u.min()) if lay_u.size else 0
    reply = _submit(
        client,
        region,
        cplan,
        enc.lanes,
        (
            np.full(cplan.packets, front, np.uint16),
            cell_norms(plan.seed, cplan.packets),
            block_max.numpy(),
        ),
        job=job,
        bound=bound,
        staging=staging,
    )
    if stand_in is not None:
        reply.exception(timeout)  # its outcome does not matter: only that it ended
        raise LocalError(f"took part with zeros: {stand_in}")
    if times is not None:
        times.written = times.submitted = time.perf_counter()
        reply.add_done_callback(lambda _: setattr(times, "replied", time.perf_counter()))
    return Submitted(cplan, region, reply, block_max, 0)
