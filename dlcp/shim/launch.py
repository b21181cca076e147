"""A bucket's launch in the shim: its codec for this round, its plan (layout,
seed, the THC scale every rank shares: exact, or from the last round's
maxima), its region of the rank's segment (grown once between steps when
outgrown), its packets' layers, and its submission to the daemon (the
sketch's two rounds through `dlcp.shim.sketch_round`).

`BucketLauncher` owns the error feedback of every bucket (pickled with the
state) and the caches a launch needs (codecs, generators, packet layers).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from dlcp.codecs import Codec, CodecState, get_codec
from dlcp.codecs.sketch import SketchCodec
from dlcp.shim import pg
from dlcp.shim.arena import Region
from dlcp.shim.attachment import Attachment
from dlcp.shim.exchange import RoundPlan, submit_round
from dlcp.shim.layers import LayerMap, packet_layers, param_offsets
from dlcp.shim.regions import RegionSizes, region_sizes
from dlcp.shim.scales import Scales
from dlcp.shim.settings import ShimSettings
from dlcp.shim.sketch_round import submit_sketch
from dlcp.shim.staging import Staging
from dlcp.shim.stepstate import Key, StepBuckets, _Pending, with_headroom
from dlcp.shim.timeline import BucketTimes

__all__ = ["BucketLauncher"]


class BucketLauncher:
    """Planning, encoding and submitting one bucket's round into the step."""

    def __init__(
        self,
        settings: ShimSettings,
        attachment: Attachment,
        step: StepBuckets,
        scales: Scales,
        staging: Staging,
        layers: LayerMap,
        ef: dict[Key, CodecState] | None = None,
    ) -> None:
        self._settings = settings
        self._attachment = attachment
        self._step = step
        self._scales = scales
        self._staging = staging
        self.layers = layers
        self.ef: dict[Key, CodecState] = {} if ef is None else ef  # error feedback, per bucket
        self._codecs: dict[str, Codec] = {}
        self._generators: dict[torch.device, torch.Generator] = {}
        self._layer_cache: dict[Key, npt.NDArray[np.uint16]] = {}

    def set_layers(self, layers: LayerMap) -> None:
        """Take layer indices from `layers` from now on."""
        self.layers = layers
        self._layer_cache.clear()

    def drop_codec(self, codec: str) -> None:
        """Forget the error feedback of `codec`'s buckets (auto left it)."""
        for k in [k for k in self.ef if len(k) > 2 and k[1] == codec]:
            del self.ef[k]

    # -- one bucket -------------------------------------------------------------
    def launch(
        self,
        flat: torch.Tensor,
        bucket: int,
        name: str,
        key: Key | None,
        layers: Callable[[RoundPlan], npt.NDArray[np.uint16]],
        times: BucketTimes | None = None,
        *,
        round_: int,
        kind: str = "allreduce",
    ) -> _Pending:
        """Plan, encode and submit one bucket of step `round_` (it joins the
        step's buckets); failures are recorded, not raised.

        `key` names the bucket across steps (error feedback, THC scale); None
        for a one-off tensor. `kind`: what the round moves (the submit's, in
        docs/shim-protocol.md).
        """
        link = self._attachment.link
        assert link is not None
        numel = flat.numel()
        state_key: Key = (*(key or ("once", name, bucket)), numel)
        m = link.membership
        ef = self.ef.get(state_key) if key is not None else None
        if ef is None and key is not None and name != "fp32":
            ef = self.ef.setdefault(state_key, CodecState())
        # fft: this round's codec from what every rank learnt from the last result
        codec = self._codec(name).for_round(ef)
        # the same inputs on every rank: an error here is raised on every rank
        plan = RoundPlan.make(
            codec, numel, shards=m.shards, payload=m.payload, round_=round_, bucket=bucket
        )
        p = _Pending(bucket=bucket, buffer=flat, key=state_key, keep=key is not None, times=times)
        earlier = self._step.first_error()
        self._step.add(p)
        p.ef = ef
        if plan.scaled:
            scale = self._scales.known(state_key, plan.packets) if key is not None else None
            if scale is None:
                # first round of this bucket (or exact mode): agree a scale (collective)
                scale = self._first_scale(codec, flat, plan, p)
            plan = dataclasses.replace(plan, scale=scale)
        p.plan = plan
        if earlier is not None or p.error is not None or not link.alive:
            p.error = p.error or "skipped after an earlier failure in this step"
            if not link.alive:
                p.error = f"lost the daemon: {link.client.error}"
            elif isinstance(codec, SketchCodec):  # the others wait for its union now
                self._submit_sketch(p, plan, flat, None, layers, times, stand_in=p.error)
            return p
        s = self._settings
        try:
            if ef is not None:
                p.snapshot = (ef.residual, ef.rounds, ef.saturated)
            if isinstance(codec, SketchCodec):  # two rounds: the union, then the cells
                self._submit_sketch(p, plan, flat, ef, layers, times)
                return p
            region = self._take_region(region_sizes(plan.layout))
            p.sub = submit_round(
                link.client,
                region,
                plan,
                flat,
                job=m.job,
                bound=s.loss_bound,
                layers=layers(plan),
                state=ef,
                generator=self._generator(flat.device),
                staging=self._staging,
                times=times,
                n_layers=self.layers.n_layers,
                kind=kind,
            )
        except Exception as exc:
            p.error = f"submit: {type(exc).__name__}: {exc}"
        return p

    def _submit_sketch(
        self,
        p: _Pending,
        plan: RoundPlan,
        flat: torch.Tensor,
        ef: CodecState | None,
        layers: Callable[[RoundPlan], npt.NDArray[np.uint16]],
        times: BucketTimes | None,
        stand_in: str | None = None,
    ) -> None:
        """The sketch's two rounds (`sketch_round.submit_sketch`); a failure,
        or taking part with zeros (`stand_in`), is recorded in `p.error`."""
        link = self._attachment.link
        assert link is not None
        try:
            p.sub = submit_sketch(
                link.client,
                self._take_region,
                plan,
                flat,
                job=link.membership.job,
                bound=self._settings.loss_bound,
                layers=layers,
                state=ef,
                staging=self._staging,
                timeout=self._settings.round_timeout_s,
                times=times,
                stand_in=stand_in,
            )
            p.plan = p.sub.plan
        except Exception as exc:
            p.error = stand_in or f"submit: {type(exc).__name__}: {exc}"

    def _take_region(self, sizes: RegionSizes) -> Region:
        """A region of the segment for one submit, growing the segment (after
        the step's buckets in flight are in) when it is full."""
        link = self._attachment.link
        assert link is not None
        if not link.arena.fits(sizes):
            timeout = self._settings.round_timeout_s
            self._step.wait(time.monotonic() + timeout, timeout)
            link.arena.grow(with_headroom(sizes.total))
        return link.arena.take(sizes)

    def _first_scale(
        self, codec: Codec, flat: torch.Tensor, plan: RoundPlan, p: _Pending
    ) -> torch.Tensor:
        """Per-packet scales from every rank's encoded maxima (one all-reduce).

        A rank whose probe fails (non-finite gradients) still takes part in the
        all-reduce, with zeros, and records the failure for the step's agreement.
        """
        try:
            probe = codec.encode(
                p.ef.take(flat) if p.ef is not None else flat,
                per_packet=plan.per_packet,
                seed=plan.seed,
                scale=None,
            )
            local = probe.block_max.detach().to("cpu", torch.float32)
        except Exception as exc:
            p.error = f"encode: {type(exc).__name__}: {exc}"
            local = torch.zeros(plan.packets)
        local = torch.nan_to_num(local, nan=0.0, posinf=0.0)
        return self._scales.from_maxima(pg.global_max(local, self._attachment.group))

    def _codec(self, name: str) -> Codec:
        codec = self._codecs.get(name)
        if codec is None:
            codec = self._codecs[name] = get_codec(name, **self._settings.codec_options)
        return codec

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(secrets.randbits(63))
            self._generators[device] = gen
        return gen

    def packet_layers(
        self, bucket: dist.GradBucket, buf: torch.Tensor, plan: RoundPlan
    ) -> npt.NDArray[np.uint16]:
        """The layer of each of the round's packets (for the daemon's priorities)."""
        params = bucket.parameters()
        span = plan.codec.packet_span(plan.per_packet)  # bucket values a packet stands for
        key: Key = (
            bucket.index(),
            buf.numel(),
            plan.per_packet,
            span,
            self.layers.version,
            tuple(id(p) for p in params),
        )
        cached = self._layer_cache.get(key)
        if cached is None:
            grads = bucket.gradients()
            offsets = param_offsets(buf, grads)
            layers = self.layers.layers_of(params)
            spans = [(o, g.numel(), lay) for o, g, lay in zip(offsets, grads, layers, strict=True)]
            cached = packet_layers(spans, buf.numel(), span, plan.packets)
            if len(self._layer_cache) > 1024:
                self._layer_cache.clear()
            self._layer_cache[key] = cached
        return cached
