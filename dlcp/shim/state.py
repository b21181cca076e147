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

THC needs one scale per packet that every rank shares (`scale_mode`):
"exact" (default) agrees this round's per-packet maxima before encoding, with
one all-reduce (MAX) per bucket, so nothing saturates; "bucket" and "packet"
reuse the previous round's maxima (of the bucket, or of each packet) times
`scale_margin`, carried by the step's agreement all-reduce, and clamp what
exceeds them (error feedback resends it). A bucket's first round always
agrees exactly. The decision to run these collectives depends only on state
every rank shares, so every rank issues them, failed or not.

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
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import secrets
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from dlcp.codecs import CODEC_NAMES, Codec, CodecState, get_codec, next_scale
from dlcp.codecs.sketch import SketchCodec
from dlcp.errors import DlcpError, LocalError
from dlcp.shim import auto_steps, pg
from dlcp.shim.arena import MIN_SEGMENT, Arena, Region
from dlcp.shim.auto import AUTO, AutoCodec
from dlcp.shim.client import default_socket
from dlcp.shim.exchange import RoundPlan, Submitted, decode_round, submit_round
from dlcp.shim.layers import LayerMap, packet_layers, param_offsets
from dlcp.shim.link import AttachFailed, Link, attach
from dlcp.shim.regions import RegionSizes, region_sizes
from dlcp.shim.rendezvous import Store
from dlcp.shim.sketch_round import submit_sketch
from dlcp.shim.staging import Staging
from dlcp.shim.timeline import BucketTimes, Timeline

__all__ = ["DlcpState", "ShimError", "segment_for"]

log = logging.getLogger("dlcp.shim")

_INSTANCES = itertools.count()
_MODES = ("transpose", "ps")
# THC scale: this round's exact per-packet maxima, or the previous round's
# bucket max / per-packet maxima times the margin (see the module docstring).
_SCALE_MODES = ("exact", "bucket", "packet")

# Fields that survive pickling (the rest is rebuilt or reconnected lazily).
_CONFIG = (
    "codec",
    "codec_options",
    "loss_bound",
    "socket",
    "strict",
    "retry_steps",
    "retry_s",
    "round_timeout_s",
    "connect_timeout_s",
    "rendezvous_timeout_s",
    "scale_margin",
    "scale_mode",
    "mode",
    "segment_bytes",
    "link_bps",
    "auto_options",
)
_PERSISTENT = (
    "round",
    "fallbacks",
    "rounds",
    "attaches",
    "failures",
    "lost_lanes",
    "total_lanes",
    "saturated",
    "last_error",
    "_unreported",
    "_ef",
    "_scales",
    "_detached_round",
    "_auto",
)
_RUNTIME = (
    "_group",
    "_store",
    "_layers",
    "_link",
    "_finalizer",
    "_staging",
    "_generators",
    "_codecs",
    "_pending",
    "_layer_cache",
    "_attach_due",
    "_instance",
    "_attempts",
    "_last_attempt",
    "_warned",
    "_auto_used",
    "_status",
    "_timeline",
    "__weakref__",
)

Key = tuple[Any, ...]


def segment_for(model: torch.nn.Module) -> int:
    """Bytes of segment one step of `model`'s gradients takes in the largest
    codec (fp32): each value's lanes and sums (8 bytes), the packets' metadata
    and counts (16 bytes a packet of at least 64 values: 0.25 a value), and
    each bucket's alignment (1 MiB covers thousands of buckets)."""
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return int(numel * 8.5) + (1 << 20)


def with_headroom(size: int) -> int:
    """`size` and some room: DDP rebuilds its buckets after the first step, and
    the same gradients in other buckets take a little more (each bucket's
    metadata and alignment); a segment sized from one step fits the next."""
    return size + size // 32 + MIN_SEGMENT


class ShimError(DlcpError):
    """The daemon could not all-reduce and `strict=True` forbids the fallback."""


@dataclass
class _Pending:
    """One bucket of the current step."""

    bucket: int
    buffer: torch.Tensor  # flat; left untouched until the step is agreed
    key: Key
    keep: bool  # key names the bucket across steps: keep its scale
    plan: RoundPlan | None = None
    future: torch.futures.Future[torch.Tensor] | None = None
    sub: Submitted | None = None
    error: str | None = None
    ef: CodecState | None = None
    snapshot: tuple[torch.Tensor | None, int, int] | None = None
    reply: dict[str, Any] | None = None
    sent_at: float | None = None  # when submitted, and when the reply came (auto)
    replied_at: float | None = None
    times: BucketTimes | None = None  # the bucket's timeline (DDP buckets)


def _check_fraction(name: str, value: float, hi: float) -> float:
    v = float(value)
    if not (math.isfinite(v) and 0.0 <= v <= hi):
        raise LocalError(f"{name} must be in 0..{hi}, got {value!r}")
    return v


class DlcpState:
    """The state a DDP communication hook gets (`register_comm_hook(state, hook)`).

    Hyperparameters: codec, codec_options, loss_bound, socket, strict,
    retry_steps, retry_s, round_timeout_s, connect_timeout_s,
    rendezvous_timeout_s, scale_margin, scale_mode, mode, segment_bytes,
    link_bps and auto_options (for codec="auto": `dlcp.shim.auto.AutoCodec`).
    Stats: round (all-reduce steps so far), rounds (bucket rounds the daemon
    completed), fallbacks (buckets sent over the process group), attaches,
    failures, lost_lanes / total_lanes, saturated (THC values clamped),
    last_error; `auto_codec` and `auto` (what codec="auto" chose, its
    decisions and switches). Pickles without sockets, segments or the process
    group (like `PowerSGDState`); a restored state reattaches on its next use.
    """

    __slots__ = _CONFIG + _PERSISTENT + _RUNTIME

    def __init__(
        self,
        *,
        codec: str = "fp32",
        loss_bound: float = 0.0,
        socket: str | None = None,
        strict: bool = False,
        process_group: dist.ProcessGroup | None = None,
        store: Store | None = None,
        model: torch.nn.Module | None = None,
        retry_steps: int | None = 50,
        retry_s: float | None = None,
        round_timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        rendezvous_timeout_s: float = 300.0,
        scale_margin: float = 1.25,
        scale_mode: str = "exact",
        mode: str = "transpose",
        segment_bytes: int | None = None,
        codec_options: dict[str, Any] | None = None,
        link_bps: float | str | None = None,
        auto_options: dict[str, Any] | None = None,
    ) -> None:
        if codec not in CODEC_NAMES and codec != AUTO:
            raise LocalError(
                f"unknown codec {codec!r}; valid codecs: {', '.join(CODEC_NAMES)}, {AUTO}"
            )
        if mode not in _MODES:
            raise LocalError(f"mode must be one of {', '.join(_MODES)}, not {mode!r}")
        if retry_steps is not None and (not isinstance(retry_steps, int) or retry_steps < 1):
            raise LocalError(f"retry_steps must be a positive int or None, got {retry_steps!r}")
        if retry_s is not None and not (math.isfinite(retry_s) and retry_s >= 0):
            raise LocalError(f"retry_s must be >= 0 or None, got {retry_s!r}")
        for name, value in (
            ("round_timeout_s", round_timeout_s),
            ("connect_timeout_s", connect_timeout_s),
            ("rendezvous_timeout_s", rendezvous_timeout_s),
        ):
            if not (math.isfinite(value) and value > 0):
                raise LocalError(f"{name} must be > 0, got {value!r}")
        if not (math.isfinite(scale_margin) and scale_margin >= 1.0):
            raise LocalError(f"scale_margin must be >= 1, got {scale_margin!r}")
        if scale_mode not in _SCALE_MODES:
            raise LocalError(
                f"scale_mode must be one of {', '.join(_SCALE_MODES)}, not {scale_mode!r}"
            )
        self.codec = codec
        self.codec_options = dict(codec_options or {})
        if codec != AUTO:
            get_codec(codec, **self.codec_options)  # fail early on bad options
        self.link_bps = link_bps
        self.auto_options = dict(auto_options or {})
        self.loss_bound = _check_fraction("loss_bound", loss_bound, 0.5)
        self.socket = socket
        self.strict = bool(strict)
        self.retry_steps = retry_steps
        self.retry_s = retry_s
        self.round_timeout_s = float(round_timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.rendezvous_timeout_s = float(rendezvous_timeout_s)
        self.scale_margin = float(scale_margin)
        self.scale_mode = scale_mode
        self.mode = mode
        self.segment_bytes = segment_bytes
        if segment_bytes is None and model is not None:
            self.segment_bytes = segment_for(model)

        self.round = 0
        self.fallbacks = 0
        self.rounds = 0
        self.attaches = 0
        self.failures = 0
        self.lost_lanes = 0
        self.total_lanes = 0
        self.saturated = 0
        self.last_error: str | None = None
        self._unreported = 0
        self._ef: dict[Key, CodecState] = {}
        self._scales: dict[Key, torch.Tensor] = {}
        self._detached_round: int | None = None
        self._auto: AutoCodec | None = None
        if codec == AUTO:
            self._auto = self._new_auto()  # fail early on bad settings
        self._init_runtime(process_group, store, model)

    def _init_runtime(
        self,
        group: dist.ProcessGroup | None,
        store: Store | None,
        model: torch.nn.Module | None,
    ) -> None:
        self._group = group
        self._store = store
        self._layers = LayerMap(model)
        self._link: Link | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._staging = Staging()
        self._generators: dict[torch.device, torch.Generator] = {}
        self._codecs: dict[str, Codec] = {}
        self._pending: list[_Pending] = []
        self._layer_cache: dict[Key, npt.NDArray[np.uint16]] = {}
        self._attach_due = True
        self._instance = next(_INSTANCES)
        self._attempts = 0
        self._last_attempt = -math.inf
        self._warned = False
        self._auto_used = False
        self._status: Future[dict[str, Any]] | None = None
        self._timeline = Timeline()

    # -- pickling (checkpoints) -------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        if self._pending:
            raise LocalError("cannot pickle a DlcpState in the middle of a step")
        return {name: getattr(self, name) for name in _CONFIG + _PERSISTENT}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # settings newer than a checkpoint take their defaults
        state = {"link_bps": None, "auto_options": {}, "_auto": None, **state}
        for name in _CONFIG + _PERSISTENT:
            setattr(self, name, state[name])
        self._init_runtime(None, None, None)

    # -- public -----------------------------------------------------------------
    @property
    def attached(self) -> bool:
        return self._link is not None

    @property
    def world_size(self) -> int:
        return pg.group_size(self._group)

    @property
    def auto(self) -> AutoCodec | None:
        """The decision state of `codec="auto"` (None until auto is first used)."""
        return self._auto

    @property
    def auto_codec(self) -> str | None:
        """The codec auto runs now (None when auto is not in use)."""
        return None if self._auto is None else self._auto.current

    def set_model(self, model: torch.nn.Module) -> None:
        """Take layer indices from `model`'s parameter order (e.g. after unpickling),
        and size the segment for its gradients now (not collective), so that
        the next step does not grow it (`init(model=...)` does both at once)."""
        self._layers = LayerMap(model)
        self._layer_cache.clear()
        self.segment_bytes = max(self.segment_bytes or 0, segment_for(model))
        if self._link is not None and not self._pending:
            self._link.arena.reserve(self.segment_bytes)

    def stats(self) -> dict[str, Any]:
        """Counters, for logs and tests."""
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
            "segment_pinned": self._link is not None and self._link.arena.segment.pinned,
            # the segment's size, and how often it grew since attaching (a step
            # that grows it first waits for its buckets in flight)
            "segment_bytes": None if self._link is None else self._link.arena.segment.size,
            "segment_grows": 0 if self._link is None else self._link.arena.grows,
            "codec": self.codec,
            "auto": None if self._auto is None else self._auto.describe(),
        }

    @property
    def timeline(self) -> Timeline:
        """Per-bucket stamps of the last steps through the daemon (`dlcp.shim.timeline`)."""
        return self._timeline

    def timeline_summary(self, last: int | None = None) -> dict[str, Any]:
        """Medians per phase of the last `last` steps' buckets, in seconds
        (`dlcp.shim.timeline.Timeline.summary`)."""
        return self._timeline.summary(last)

    def daemon_counters(self, timeout: float = 5.0) -> dict[str, int]:
        """The local daemon's counters (`status`: datagrams, NACKs, retransmissions,
        ...; the whole host's, every job's), or {} when not attached."""
        link = self._link
        if link is None:
            return {}
        status = link.client.call("status", timeout=timeout)["status"]
        return {str(k): int(v) for k, v in status.get("counters", {}).items()}

    def attach(self) -> bool:
        """Collective: (re)attach every rank to its daemon. Returns whether attached.

        On failure: raises `ShimError` when strict, else warns and stays on the
        fallback.
        """
        if self._pending:
            raise LocalError("cannot attach in the middle of a step")
        self._attach_due = False
        self._close_link()
        if not dist.is_initialized():
            raise LocalError("dlcp.shim needs torch.distributed: call init_process_group first")
        self._attempts += 1
        self._last_attempt = time.monotonic()
        rank, world = pg.group_rank(self._group), pg.group_size(self._group)
        prefix = f"dlcp/{self._instance}/{self._attempts}"
        result = attach(
            socket=self.socket or default_socket(),
            store=self._get_store(),
            rank=rank,
            world=world,
            prefix=prefix,
            segment_name=f"dlcp-{os.getpid()}-{self._instance}-{self._attempts}",
            segment_bytes=self.segment_bytes or 0,
            fallbacks=self._unreported,
            mode=self.mode,
            timeout=self.connect_timeout_s,
            store_timeout=self.rendezvous_timeout_s,
        )
        if isinstance(result, AttachFailed):
            self._fail(result.reason)
            return False
        self._unreported = 0
        self._link = result
        self._finalizer = weakref.finalize(self, result.close)
        self._detached_round = None
        self.attaches += 1
        log.info(
            "dlcp: attached job %d as host %d of %d (%d local ranks)",
            result.membership.job,
            result.membership.me,
            len(result.membership.hosts),
            result.membership.local_ranks,
        )
        if self._auto is not None:
            auto_steps.prepare(self)
        return True

    def close(self) -> None:
        """Leave the job and drop the connection (not collective)."""
        self._close_link()
        self._attach_due = False

    # -- the hook and all_reduce ---------------------------------------------------
    def run_bucket(
        self, bucket: dist.GradBucket, codec: str | None = None
    ) -> torch.futures.Future[torch.Tensor]:
        """What `dlcp.shim.hook` does with one DDP bucket."""
        handed = time.perf_counter()
        if self._attach_due and not self._pending:
            self.attach()
        buf = bucket.buffer()
        last = bucket.is_last()
        if self._link is None:
            self._require_fallback()
            fut = pg.fallback_all_reduce(buf, self._group, async_op=True)
            assert fut is not None
            self._count_fallbacks(1)
            if last:
                self._end_step()
            return fut
        name = codec or self.codec
        auto = self._auto_for(name)
        if auto is not None:
            auto.bucket_entered(buf.numel(), time.perf_counter())
            name = auto.current
        params = bucket.parameters()
        self._layers.observe(params)
        flat = buf.reshape(-1)
        times = self._timeline.bucket(bucket.index(), flat.numel() * flat.element_size(), handed)
        p = self._launch(
            flat,
            bucket.index(),
            name,
            ("ddp", name, bucket.index()),
            lambda plan: self._packet_layers(bucket, flat, plan),
            times,
        )
        p.future = torch.futures.Future()
        if auto is not None:
            auto_steps.time_exchange(p)
            auto.bucket_left(time.perf_counter())
        times.left = time.perf_counter()
        if last:
            self._finish_step()
        return p.future

    def all_reduce(
        self, tensor: torch.Tensor, *, codec: str | None = None, key: object | None = None
    ) -> torch.Tensor:
        """Average `tensor` over the ranks in place (blocking); returns it.

        `key` names the tensor across calls, so THC keeps its error feedback and
        scale for it; without a key every call agrees a fresh scale.
        """
        if self._pending:
            raise LocalError("dlcp all_reduce called while a DDP step is in flight")
        if not tensor.is_floating_point():
            raise LocalError(f"dlcp all_reduce averages floating tensors, not {tensor.dtype}")
        if self._attach_due:
            self.attach()
        if tensor.numel() == 0:
            return tensor
        if self._link is None:
            self._require_fallback()
            pg.fallback_all_reduce(tensor, self._group)
            self._count_fallbacks(1)
            self._end_step()
            return tensor
        name = codec or self.codec
        auto = self._auto_for(name)
        if auto is not None:
            auto.bucket_entered(tensor.numel(), time.perf_counter())
            name = auto.current
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        ef_key: Key | None = ("all_reduce", name, key) if key is not None else None
        p = self._launch(flat, 0, name, ef_key, lambda plan: np.zeros(plan.packets, np.uint16))
        if auto is not None:
            auto_steps.time_exchange(p)
            auto.bucket_left(time.perf_counter())
        self._finish_step()
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return tensor

    # -- one bucket -------------------------------------------------------------
    def _launch(
        self,
        flat: torch.Tensor,
        bucket: int,
        name: str,
        key: Key | None,
        layers: Callable[[RoundPlan], npt.NDArray[np.uint16]],
        times: BucketTimes | None = None,
    ) -> _Pending:
        """Plan, encode and submit one bucket; failures are recorded, not raised.

        `key` names the bucket across steps (error feedback, THC scale); None
        for a one-off tensor.
        """
        link = self._link
        assert link is not None
        numel = flat.numel()
        state_key: Key = (*(key or ("once", name, bucket)), numel)
        m = link.membership
        ef = self._ef.get(state_key) if key is not None else None
        if ef is None and key is not None and name != "fp32":
            ef = self._ef.setdefault(state_key, CodecState())
        # fft: this round's codec from what every rank learnt from the last result
        codec = self._codec(name).for_round(ef)
        # the same inputs on every rank: an error here is raised on every rank
        plan = RoundPlan.make(
            codec, numel, shards=len(m.hosts), payload=m.payload, round_=self.round, bucket=bucket
        )
        p = _Pending(bucket=bucket, buffer=flat, key=state_key, keep=key is not None, times=times)
        self._pending.append(p)
        p.ef = ef
        if plan.scaled:
            scale = self._scales.get(state_key) if key is not None else None
            if scale is None or scale.numel() != plan.packets or self.scale_mode == "exact":
                # first round of this bucket (or exact mode): agree a scale (collective)
                scale = self._first_scale(codec, flat, plan, p)
            plan = dataclasses.replace(plan, scale=scale)
        p.plan = plan
        if any(q.error for q in self._pending) or not link.alive:
            p.error = p.error or "skipped after an earlier failure in this step"
            if not link.alive:
                p.error = f"lost the daemon: {link.client.error}"
            elif isinstance(codec, SketchCodec):  # the others wait for its union now
                self._submit_sketch(p, plan, flat, None, layers, times, stand_in=p.error)
            return p
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
                bound=self.loss_bound,
                layers=layers(plan),
                state=ef,
                generator=self._generator(flat.device),
                staging=self._staging,
                times=times,
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
        link = self._link
        assert link is not None
        try:
            p.sub = submit_sketch(
                link.client,
                self._take_region,
                plan,
                flat,
                job=link.membership.job,
                bound=self.loss_bound,
                layers=layers,
                state=ef,
                staging=self._staging,
                timeout=self.round_timeout_s,
                times=times,
                stand_in=stand_in,
            )
            p.plan = p.sub.plan
        except Exception as exc:
            p.error = stand_in or f"submit: {type(exc).__name__}: {exc}"

    def _take_region(self, sizes: RegionSizes) -> Region:
        """A region of the segment for one submit, growing the segment (after
        the step's buckets in flight are in) when it is full."""
        link = self._link
        assert link is not None
        if not link.arena.fits(sizes):
            self._wait_replies(time.monotonic() + self.round_timeout_s)
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
        return self._scale_from(pg.global_max(local, self._group))

    def _scale_from(self, maxima: torch.Tensor) -> torch.Tensor:
        clean = torch.nan_to_num(maxima.to(torch.float32), nan=0.0, posinf=0.0, neginf=0.0)
        clean = clean.clamp(min=0.0)
        if self.scale_mode == "bucket" and clean.numel():
            clean = clean.max().expand(clean.numel())
        margin = 1.0 if self.scale_mode == "exact" else self.scale_margin
        return next_scale(clean, margin)

    # -- the end of a step -----------------------------------------------------------
    def _wait_replies(self, deadline: float) -> None:
        for p in self._pending:
            if p.sub is None or p.error is not None or p.reply is not None:
                continue
            try:
                p.reply = p.sub.reply.result(timeout=max(0.0, deadline - time.monotonic()))
                if p.times is not None:
                    p.times.seen = time.perf_counter()
                    p.times.daemon_s = float(p.reply.get("elapsed_s", math.nan))
                if p.sent_at is not None and p.replied_at is None:  # (callbacks run late)
                    p.replied_at = time.perf_counter()
            except TimeoutError:
                p.error = f"no reply within {self.round_timeout_s:g} s"
            except Exception as exc:
                p.error = f"{type(exc).__name__}: {exc}"

    def _finish_step(self) -> None:
        pending = self._pending
        auto = self._auto if self._auto_used else None
        learned = False
        began = time.perf_counter()
        try:
            self._wait_replies(time.monotonic() + self.round_timeout_s)
            local = next((p.error for p in pending if p.error), None)
            maxima = self._maxima(pending)
            if auto is not None:  # this rank's wish for an auto decision rides along
                wish = torch.tensor([1.0 if auto.link_changed() else 0.0])
                maxima = wish if maxima is None else torch.cat([maxima.reshape(-1), wish])
            failed, maxima = pg.agree(local is not None, maxima, self._group)
            if auto is not None:
                maxima, wished = maxima[:-1], bool(maxima[-1] > 0.0)
            if failed:
                self._step_failed(local or "another rank could not use dlcp in this step")
            else:
                self._step_done(maxima)
            if auto is not None and self._link is not None:
                learned = True
                auto_steps.step(self, auto, wished, pending)
        finally:
            if auto is not None and not learned:
                auto.discard_step()  # a failed step teaches nothing
            self._pending = []
            self._auto_used = False
            if self._link is not None:
                self._reserve_for_next_step(self._link.arena)
            self._timeline.end_step(time.perf_counter() - began)
            self._end_step()

    def _reserve_for_next_step(self, arena: Arena) -> None:
        """Free the step's regions; if the step outgrew the segment, size it for
        the whole step now, between steps, so the next one does not grow it
        bucket by bucket (each growth waits for the buckets in flight)."""
        taken = arena.step_bytes
        arena.reset()
        try:
            if taken > arena.segment.size and arena.reserve(with_headroom(taken)):
                self.segment_bytes = max(self.segment_bytes or 0, arena.segment.size)
        except Exception as exc:  # the next step grows it, or fails over
            log.debug("dlcp: could not grow the segment between steps: %s", exc)

    def _maxima(self, pending: list[_Pending]) -> torch.Tensor | None:
        """What the agreement carries for the next THC scales: per bucket its max
        ("bucket") or its per-packet maxima ("packet"); nothing for "exact".
        Zeros where this rank has none: the length is the same on every rank."""
        if self.scale_mode == "exact":
            return None
        parts = []
        for p in pending:
            if p.plan is None or not p.plan.scaled:
                continue
            n = p.plan.packets if self.scale_mode == "packet" else 1
            if p.sub is None:
                parts.append(torch.zeros(n))
            elif n == 1:
                parts.append(p.sub.block_max.max().reshape(1))
            else:
                parts.append(p.sub.block_max)
        return torch.cat(parts) if parts else None

    def _step_done(self, maxima: torch.Tensor) -> None:
        at = 0
        for p in self._pending:
            assert p.sub is not None and p.reply is not None
            plan = p.sub.plan
            if p.times is not None:
                p.times.decoding = time.perf_counter()
            dec = decode_round(plan, p.sub.region, p.buffer.device, self._staging, p.buffer)
            if p.ef is not None and dec.sums is not None:  # fft: the next coefficient set
                plan.codec.learn(
                    p.ef, dec.sums, dec.counts, per_packet=plan.per_packet, maxima=dec.maxima
                )
            if dec.mean is not p.buffer:
                p.buffer.copy_(dec.mean.to(p.buffer.dtype))
            if p.times is not None:
                p.times.decoded = time.perf_counter()
            self.rounds += 1
            self.lost_lanes += int(p.reply.get("lost_lanes", 0))
            self.total_lanes += int(p.reply.get("total_lanes", 0))
            self.saturated += p.sub.saturated
            if plan.scaled and self.scale_mode != "exact":
                n = plan.packets if self.scale_mode == "packet" else 1
                if p.keep:
                    seen = maxima[at : at + n].expand(plan.packets)
                    self._scales[p.key] = self._scale_from(seen)
                at += n
            if p.future is not None:
                p.future.set_result(p.buffer)
            if p.times is not None:
                p.times.completed = time.perf_counter()

    def _step_failed(self, reason: str) -> None:
        for p in self._pending:
            if p.ef is not None and p.snapshot is not None:
                p.ef.residual, p.ef.rounds, p.ef.saturated = p.snapshot
        self._fail(reason)
        if self.strict:
            err = ShimError(f"dlcp all-reduce failed: {reason}")
            for p in self._pending:
                if p.future is not None:
                    p.future.set_exception(err)  # type: ignore[arg-type]
            if not any(p.future is not None for p in self._pending):
                raise err
            return
        for p in self._pending:
            pg.fallback_all_reduce(p.buffer, self._group)
            self._count_fallbacks(1)
            if p.future is not None:
                p.future.set_result(p.buffer)

    def _end_step(self) -> None:
        self.round += 1
        self._layers.end_step()
        if self._link is not None or self._detached_round is None:
            return
        since = self.round - self._detached_round
        due = self.retry_steps is not None and since % self.retry_steps == 0
        if self.retry_s is not None:
            mine = time.monotonic() - self._last_attempt >= self.retry_s
            any_due, _ = pg.agree(mine, None, self._group)
            due = due or any_due
        if due:
            self._attach_due = True

    # -- codec="auto" ------------------------------------------------------------------
    def _new_auto(self) -> AutoCodec:
        return AutoCodec(link_bps=self.link_bps, **self.auto_options)

    def _auto_for(self, name: str) -> AutoCodec | None:
        """The auto state when `name` is auto (made on first use); marks the step."""
        if name != AUTO:
            return None
        if self._auto is None:
            self._auto = self._new_auto()
            auto_steps.prepare(self)
        self._auto_used = True
        return self._auto

    # -- helpers ----------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        """Every rank decided to leave the daemon: detach, warn once, or raise."""
        self._close_link()
        self.failures += 1
        self.last_error = reason
        self._detached_round = self.round
        if self.strict:
            self._attach_due = True
            raise_now = not self._pending
            if raise_now:
                raise ShimError(f"dlcp is unavailable: {reason}")
            return
        message = f"dlcp: {reason}; using the process group's all-reduce until it is back"
        if not self._warned:  # warn once; later failures (e.g. reattach attempts) only log
            self._warned = True
            warnings.warn(message, RuntimeWarning, stacklevel=4)
        else:
            log.info(message)

    def _require_fallback(self) -> None:
        if self.strict:
            raise ShimError(f"dlcp is unavailable: {self.last_error or 'not attached'}")

    def _count_fallbacks(self, n: int) -> None:
        self.fallbacks += n
        self._unreported += n

    def _close_link(self) -> None:
        link, self._link = self._link, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if link is not None:
            link.close()

    def _get_store(self) -> Store:
        if self._store is None:
            self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def _codec(self, name: str) -> Codec:
        codec = self._codecs.get(name)
        if codec is None:
            codec = self._codecs[name] = get_codec(name, **self.codec_options)
        return codec

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(secrets.randbits(63))
            self._generators[device] = gen
        return gen

    def _packet_layers(
        self, bucket: dist.GradBucket, buf: torch.Tensor, plan: RoundPlan
    ) -> npt.NDArray[np.uint16]:
        params = bucket.parameters()
        span = plan.codec.packet_span(plan.per_packet)  # bucket values a packet stands for
        key: Key = (
            bucket.index(),
            buf.numel(),
            plan.per_packet,
            span,
            self._layers.version,
            tuple(id(p) for p in params),
        )
        cached = self._layer_cache.get(key)
        if cached is None:
            grads = bucket.gradients()
            offsets = param_offsets(buf, grads)
            layers = self._layers.layers_of(params)
            spans = [(o, g.numel(), lay) for o, g, lay in zip(offsets, grads, layers, strict=True)]
            cached = packet_layers(spans, buf.numel(), span, plan.packets)
            if len(self._layer_cache) > 1024:
                self._layer_cache.clear()
            self._layer_cache[key] = cached
        return cached
