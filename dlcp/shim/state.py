"""`DlcpState`: the shim's per-job state, and how a step goes through the daemon.

How all ranks stay on the same path (the process group's collectives hang if
one rank takes the fallback and another does not):

* Attaching is collective through the store (`dlcp.shim.link.attach`): every
  rank publishes its hello and join outcome and reads everyone's, so either
  all ranks are attached or none is.
* While attached, a step submits every bucket to the daemon without waiting
  (communication overlaps the backward pass). In the hook of the step's last
  bucket each rank waits for its replies, then all ranks run ONE small
  all-reduce (MAX) over the process group of [this rank failed, ...]. If no
  rank failed every rank decodes its results; if any rank failed, every rank
  restores its error-feedback state, detaches and all-reduces the step's
  untouched buckets over the process group. `all_reduce` does the same per
  call.
* While detached, buckets go over the process group (as PyTorch's default
  hook does). Reattaching is tried at step ends that all ranks agree on:
  every `retry_steps` steps (a step count every rank shares), or, with
  `retry_s`, when any rank's clock says so (one more tiny all-reduce per
  step while detached).

THC's scales, the same on every rank, are `dlcp.shim.scales`'s.

The sketch codec takes two daemon rounds a bucket (`dlcp.shim.sketch_round`):
its index union, waited for in the hook (the cells' count depends on it),
then its cells, which end with the step like any bucket.

`codec="auto"` (`dlcp.shim.auto`): the first steps run in fp16 while the
state learns bucket sizes, backward timing, the goodput of its exchanges and
its iteration times; then, at decisions on a schedule every rank shares or
when some rank's link rate moved (a flag in the step's agreement), all ranks
average their time per codec (measured where the codec has run, else the
model's prediction corrected by the measured ones) and switch together at
the step boundary.

`DlcpState` is a facade over small objects that each own what they change,
in the style of PyTorch's comm-hook state classes: `ShimSettings` (the
hyperparameters, `dlcp.shim.settings`), an `Attachment` (the link to the
daemon, failing over and reattaching, `dlcp.shim.attachment`), the step's
`StepBuckets` (`dlcp.shim.stepstate`), `Scales` (THC's, `dlcp.shim.scales`),
a `BucketLauncher` (plans and submits a bucket's round, and owns its error
feedback, `dlcp.shim.launch`), a `StepFinisher` (replies, the agreement,
decode or fallback, `dlcp.shim.stepend`) and an `AutoDriver` (codec="auto",
`dlcp.shim.auto_steps`). This module builds them, pickles their state and
holds the hook's entry (`run_bucket`, `all_reduce`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dlcp.codecs import CodecState
from dlcp.errors import LocalError
from dlcp.shim import pg
from dlcp.shim.attachment import Attachment
from dlcp.shim.auto import AUTO, AutoCodec
from dlcp.shim.fields import SLOTS as _SLOTS
from dlcp.shim.fields import assemble, saved
from dlcp.shim.layers import LayerMap
from dlcp.shim.link import Link
from dlcp.shim.placement import Placement
from dlcp.shim.rendezvous import Store
from dlcp.shim.scales import Scales
from dlcp.shim.settings import Owned, Setting, ShimSettings
from dlcp.shim.stepend import StepFinisher
from dlcp.shim.stepstate import Key, ShimError, StepBuckets, segment_for
from dlcp.shim.timeline import Timeline

__all__ = ["DlcpState", "ShimError", "segment_for"]

log = logging.getLogger("dlcp.shim")


class DlcpState:
    """The state a DDP communication hook gets (`register_comm_hook(state, hook)`).

    Hyperparameters: codec, codec_options, loss_bound, socket, strict,
    retry_steps, retry_s, round_timeout_s, connect_timeout_s,
    rendezvous_timeout_s, scale_margin, scale_mode, mode (transpose: host to
    host; switch: summed by the aggregator in the switch, whose socket is
    switch_socket, default DLCP_SWITCH_SOCKET; ps: summed by parameter servers,
    `servers=` sockets and/or `colocate=`, `dlcp.shim.placement`), segment_bytes,
    link_bps and auto_options (for codec="auto": `dlcp.shim.auto.AutoCodec`).
    Stats: round (all-reduce steps so far), rounds (bucket rounds the daemon
    completed), fallbacks (buckets sent over the process group), attaches,
    failures, lost_lanes / total_lanes, saturated (THC values clamped),
    last_error; `auto_codec` and `auto` (what codec="auto" chose, its
    decisions and switches). Pickles without sockets, segments or the process
    group (like `PowerSGDState`); a restored state reattaches on its next use.
    """

    __slots__ = _SLOTS

    codec = Setting[str]()
    codec_options = Setting[dict[str, Any]]()
    loss_bound = Setting[float]()
    socket = Setting[str | None]()
    strict = Setting[bool]()
    retry_steps = Setting[int | None]()
    retry_s = Setting[float | None]()
    round_timeout_s = Setting[float]()
    connect_timeout_s = Setting[float]()
    rendezvous_timeout_s = Setting[float]()
    mode = Setting[str]()
    switch_socket = Setting[str | None]()
    placement = Setting[Placement | None]()
    link_bps = Setting[float | str | None]()
    auto_options = Setting[dict[str, Any]]()

    def __init__(
        self,
        *,
        codec: str = "fp32",
        loss_bound: float = 0.0,
        socket: str | None = None,
        strict: bool = False,
        process_group: pg.Group = None,
        store: Store | None = None,
        model: torch.nn.Module | None = None,
        retry_steps: int | None = 50,
        retry_s: float | None = None,
        round_timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        rendezvous_timeout_s: float = 300.0,
        scale_margin: float = 1.25,
        scale_mode: str = "packet",
        mode: str = "transpose",
        switch_socket: str | None = None,
        servers: Sequence[str] | str | None = None,
        colocate: bool | None = None,
        segment_bytes: int | None = None,
        codec_options: dict[str, Any] | None = None,
        link_bps: float | str | None = None,
        auto_options: dict[str, Any] | None = None,
    ) -> None:
        settings = ShimSettings.checked(
            codec=codec,
            loss_bound=loss_bound,
            socket=socket,
            strict=strict,
            retry_steps=retry_steps,
            retry_s=retry_s,
            round_timeout_s=round_timeout_s,
            connect_timeout_s=connect_timeout_s,
            rendezvous_timeout_s=rendezvous_timeout_s,
            mode=mode,
            switch_socket=switch_socket,
            servers=servers,
            colocate=colocate,
            codec_options=codec_options,
            link_bps=link_bps,
            auto_options=auto_options,
        )
        if segment_bytes is None and model is not None:
            segment_bytes = segment_for(model)
        kept = {
            "scale_margin": scale_margin,
            "scale_mode": scale_mode,
            "segment_bytes": segment_bytes,
        }
        self._settings = settings
        self._parts = assemble(settings, kept, process_group, store, model, auto_now=codec == AUTO)
        self._overlap: Any = None  # dlcp.shim.overlap.OverlapOptimizer, when one runs

    # -- pickling (checkpoints) -------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        if self._parts.step:
            raise LocalError("cannot pickle a DlcpState in the middle of a step")
        return saved(self._settings, self._parts)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # settings newer than a checkpoint take their defaults
        names = {f for f in ShimSettings.__dataclass_fields__ if f in state}
        self._settings = ShimSettings(**{name: state[name] for name in names})
        self._parts = assemble(self._settings, state, None, None, None)
        self._overlap = None

    # -- public -----------------------------------------------------------------
    @property
    def attached(self) -> bool:
        return self._parts.attachment.link is not None

    @property
    def world_size(self) -> int:
        return pg.group_size(self._parts.attachment.group)

    @property
    def auto(self) -> AutoCodec | None:
        """The decision state of `codec="auto"` (None until auto is first used)."""
        return self._parts.auto.codec

    @property
    def auto_codec(self) -> str | None:
        """The codec auto runs now (None when auto is not in use)."""
        auto = self._parts.auto.codec
        return None if auto is None else auto.current

    # stats, and what the parts own
    round = Owned[int]("finisher")
    rounds = Owned[int]("finisher")
    lost_lanes = Owned[int]("finisher")
    total_lanes = Owned[int]("finisher")
    saturated = Owned[int]("finisher")
    fallbacks = Owned[int]("attachment")
    attaches = Owned[int]("attachment")
    failures = Owned[int]("attachment")
    last_error = Owned[str | None]("attachment")
    segment_bytes = Owned[int | None]("attachment")
    scale_mode = Owned[str]("scales", "mode")
    scale_margin = Owned[float]("scales", "margin")

    def set_model(self, model: torch.nn.Module) -> None:
        """Take layer indices from `model`'s parameter order (e.g. after unpickling),
        and size the segment for its gradients now (not collective), so that
        the next step does not grow it (`init(model=...)` does both at once)."""
        self._parts.launcher.set_layers(LayerMap(model))
        if self._parts.step:
            self._parts.attachment.segment_bytes = max(self.segment_bytes or 0, segment_for(model))
        else:
            self._parts.attachment.reserve(segment_for(model))

    def stats(self) -> dict[str, Any]:
        """Counters, for logs and tests."""
        link = self._parts.attachment.link
        return {
            "attached": self.attached,
            "round": self.round,
            "rounds": self.rounds,
            "fallbacks": self.fallbacks,
            "attaches": self.attaches,
            "failures": self.failures,
            "lost_lanes": self.lost_lanes,
            "total_lanes": self.total_lanes,
            "saturated": self.saturated,
            "last_error": self.last_error,
            # the segment page-locked for CUDA: GPU buckets move in one DMA
            "segment_pinned": link is not None and link.arena.segment.pinned,
            # the segment's size, and how often it grew since attaching (a step
            # that grows it first waits for its buckets in flight)
            "segment_bytes": None if link is None else link.arena.segment.size,
            "segment_grows": 0 if link is None else link.arena.grows,
            "codec": self.codec,
            "auto": None if self.auto is None else self.auto.describe(),
            # the ranks' agreements: count, seconds, stalls, hedge wins (dlcp.shim.hedge)
            "agreements": self._parts.attachment.agreement_stats(),
        }

    @property
    def timeline(self) -> Timeline:
        """Per-bucket stamps of the last steps through the daemon (`dlcp.shim.timeline`)."""
        return self._parts.timeline

    def timeline_summary(self, last: int | None = None) -> dict[str, Any]:
        """Medians per phase of the last `last` steps' buckets, in seconds
        (`dlcp.shim.timeline.Timeline.summary`)."""
        return self._parts.timeline.summary(last)

    def daemon_counters(self, timeout: float = 5.0) -> dict[str, int]:
        """The local daemon's counters (`status`: datagrams, NACKs, retransmissions,
        ...; the whole host's, every job's), or {} when not attached."""
        link = self._parts.attachment.link
        if link is None:
            return {}
        status = link.client.call("status", timeout=timeout)["status"]
        return {str(k): int(v) for k, v in status.get("counters", {}).items()}

    def attach(self) -> bool:
        """Collective: (re)attach every rank to its daemon. Returns whether attached.

        On failure: raises `ShimError` when strict, else warns and stays on the
        fallback.
        """
        if self._parts.step:
            raise LocalError("cannot attach in the middle of a step")
        if not self._parts.attachment.attach(self._parts.finisher.round):
            return False
        self._parts.auto.prepare(self._parts.attachment.link)
        return True

    def close(self) -> None:
        """Leave the job and drop the connection (not collective)."""
        self._parts.attachment.close()
        self._parts.attachment.due = False

    # -- what overlap mode works with (`dlcp.shim.overlap`) ----------------------------
    @property
    def overlap_optimizer(self) -> Any:
        """The `dlcp.shim.overlap.OverlapOptimizer` running on this state, if any."""
        return self._overlap

    @overlap_optimizer.setter
    def overlap_optimizer(self, opt: Any) -> None:
        self._overlap = opt

    @property
    def step_buckets(self) -> StepBuckets:
        """The buckets of the step under way."""
        return self._parts.step

    @property
    def finisher(self) -> StepFinisher:
        """What ends steps and agrees buckets."""
        return self._parts.finisher

    @property
    def attachment(self) -> Attachment:
        """The link to the daemon and its lifecycle."""
        return self._parts.attachment

    @property
    def error_feedback(self) -> dict[Key, CodecState]:
        """Error feedback per bucket key (pickled; `dlcp.shim.launch`)."""
        return self._parts.launcher.ef

    @property
    def scales(self) -> Scales:
        """THC's scales per bucket key (pickled; `dlcp.shim.scales`)."""
        return self._parts.scales

    @property
    def link(self) -> Link | None:
        """The link to the daemon (None while detached)."""
        return self._parts.attachment.link

    # -- the hook and all_reduce ---------------------------------------------------
    def run_bucket(
        self, bucket: dist.GradBucket, codec: str | None = None
    ) -> torch.futures.Future[torch.Tensor]:
        """What `dlcp.shim.hook` does with one DDP bucket."""
        handed = time.perf_counter()
        ov = self._overlap  # overlap mode: the last step's buckets resolved first
        if ov is not None:
            ov.bucket_entered()
        a, finisher = self._parts.attachment, self._parts.finisher
        if a.due and not self._parts.step:
            self.attach()
        buf = bucket.buffer()
        last = bucket.is_last()
        if a.link is None:
            a.require_fallback()
            fut = pg.fallback_all_reduce(buf, a.group, async_op=True)
            assert fut is not None
            a.count_fallbacks(1)
            if ov is not None:
                ov.plain_bucket(bucket)
            if last:
                finisher.end_step()
                if ov is not None:
                    ov.backward_done()
            return fut
        name = codec or self.codec
        auto = self._parts.auto.for_name(name, a.link)
        if auto is not None:
            auto.bucket_entered(buf.numel(), time.perf_counter())
            name = auto.current
        launcher = self._parts.launcher
        launcher.layers.observe(bucket.parameters())
        flat = buf.reshape(-1)
        times = self._parts.timeline.bucket(
            bucket.index(), flat.numel() * flat.element_size(), handed
        )
        p = launcher.launch(
            flat,
            bucket.index(),
            name,
            ("ddp", name, bucket.index()),
            lambda plan: launcher.packet_layers(bucket, flat, plan),
            times,
            round_=finisher.round,
        )
        if ov is not None and ov.active:
            return ov.handed(p, bucket, last)
        if ov is not None:
            ov.plain_bucket(bucket)
        p.future = torch.futures.Future()
        if auto is not None:
            self._parts.auto.handed(p)
        times.left = time.perf_counter()
        if last:
            finisher.finish()
            if ov is not None:
                ov.backward_done()
        return p.future

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        codec: str | None = None,
        key: object | None = None,
        average: bool = True,
        kind: str = "allreduce",
        deliver: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Average `tensor` over the ranks in place (blocking); returns it.

        `key` names the tensor across calls, so THC keeps its error feedback and
        scale for it; without a key every call agrees a fresh scale.
        `average` False: the sum instead (fp32 and fp16 only; exact in fp32
        with loss bound 0, the fallback's sum too). `kind` "reduce_scatter" or
        "all_gather" (the backend's, `dlcp.shim.backend`): one leg of a round,
        where only the rank's own shard of the sum, or every rank's own
        shard, is the result (the fallback's sum is the whole tensor's).
        `deliver` (one leg of fp32, not strict): called with the round's sums
        (or the fallback's) as soon as this rank's round is in, before the
        ranks' agreement answers (`StepFinisher.finish_early`); `tensor` is
        then left as it was. Where it is not called `tensor` has the result.
        """
        name = codec or self.codec
        if not average and name not in ("fp32", "fp16"):
            raise LocalError(f"a sum through dlcp needs codec fp32 or fp16, not {name!r}")
        if self._parts.step:
            raise LocalError("dlcp all_reduce called while a DDP step is in flight")
        if not tensor.is_floating_point():
            raise LocalError(f"dlcp all_reduce averages floating tensors, not {tensor.dtype}")
        a, finisher = self._parts.attachment, self._parts.finisher
        if a.due:
            self.attach()
        if tensor.numel() == 0:
            return tensor
        if a.link is None:
            a.require_fallback()
            finisher.fallback(tensor, average=average)
            finisher.end_step()
            return tensor
        auto = self._parts.auto.for_name(name, a.link)
        if auto is not None:
            auto.bucket_entered(tensor.numel(), time.perf_counter())
            name = auto.current
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        ef_key: Key | None = ("all_reduce", name, key) if key is not None else None
        p = self._parts.launcher.launch(
            flat,
            0,
            name,
            ef_key,
            lambda plan: np.zeros(plan.packets, np.uint16),
            round_=finisher.round,
            kind=kind,
        )
        p.average = average
        if deliver is not None and kind != "allreduce" and name == "fp32" and not self.strict:
            finisher.finish_early(deliver)
            return tensor
        if auto is not None:
            self._parts.auto.handed(p)
        finisher.finish()
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return tensor
