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
"packet" (default) and "bucket" reuse the previous round's maxima (of each
packet, or of the bucket) times `scale_margin`, carried by the step's
agreement all-reduce, and clamp what exceeds them (error feedback resends
it); "exact" agrees this round's per-packet maxima before encoding, so
nothing saturates, at the price of a probe encode (THC's rotation) and one
blocking all-reduce (MAX) per bucket inside DDP's backward. A bucket's
first round always agrees exactly. The decision to run these collectives depends only on state
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

`DlcpState` is made of parts: this module holds the state, attaching,
pickling and the hook's entry (`run_bucket`, `all_reduce`);
`dlcp.shim.launch` plans and submits a bucket's round, `dlcp.shim.stepend`
ends a step (replies, the agreement, decode or fallback), and
`dlcp.shim.stepstate` holds what a step keeps of its buckets.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from dlcp.codecs import CODEC_NAMES, Codec, CodecState, get_codec
from dlcp.errors import LocalError
from dlcp.shim import auto_steps, pg
from dlcp.shim.auto import AUTO, AutoCodec
from dlcp.shim.client import default_socket
from dlcp.shim.fields import CONFIG as _CONFIG
from dlcp.shim.fields import PERSISTENT as _PERSISTENT
from dlcp.shim.fields import RUNTIME as _RUNTIME
from dlcp.shim.launch import BucketLaunch
from dlcp.shim.layers import LayerMap
from dlcp.shim.link import AttachFailed, Link, attach
from dlcp.shim.placement import placement
from dlcp.shim.rendezvous import Store
from dlcp.shim.staging import Staging
from dlcp.shim.stepend import StepEnd
from dlcp.shim.stepstate import Key, ShimError, _Pending, segment_for
from dlcp.shim.timeline import Timeline

__all__ = ["DlcpState", "ShimError", "segment_for"]

log = logging.getLogger("dlcp.shim")

_INSTANCES = itertools.count()
_MODES = ("transpose", "ps", "switch")
# THC scale: this round's exact per-packet maxima, or the previous round's
# bucket max / per-packet maxima times the margin (see the module docstring).
_SCALE_MODES = ("exact", "bucket", "packet")


def _check_fraction(name: str, value: float, hi: float) -> float:
    v = float(value)
    if not (math.isfinite(v) and 0.0 <= v <= hi):
        raise LocalError(f"{name} must be in 0..{hi}, got {value!r}")
    return v


class DlcpState(BucketLaunch, StepEnd):
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

    __slots__ = _CONFIG + _PERSISTENT + _RUNTIME

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
        # mode "switch": the switch aggregator's socket (rank 0 puts the job there)
        self.switch_socket = switch_socket or os.environ.get("DLCP_SWITCH_SOCKET")
        self.placement = placement(mode, servers, colocate)  # mode "ps": its aggregators
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
        group: pg.Group,
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
        self._overlap: Any = None  # dlcp.shim.overlap.OverlapOptimizer, when one runs

    # -- pickling (checkpoints) -------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        if self._pending:
            raise LocalError("cannot pickle a DlcpState in the middle of a step")
        return {name: getattr(self, name) for name in _CONFIG + _PERSISTENT}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # settings newer than a checkpoint take their defaults
        state = {
            "link_bps": None,
            "auto_options": {},
            "_auto": None,
            "switch_socket": None,
            "placement": None,
            **state,
        }
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
            switch_socket=self.switch_socket,
            placement=self.placement,
            timeout=self.connect_timeout_s,
            store_timeout=self.rendezvous_timeout_s,
        )
        if isinstance(result, AttachFailed):
            if result.fatal:  # the same on every rank: settings that cannot work
                raise LocalError(result.reason)
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
        ov = self._overlap  # overlap mode: the last step's buckets resolved first
        if ov is not None:
            ov.bucket_entered()
        if self._attach_due and not self._pending:
            self.attach()
        buf = bucket.buffer()
        last = bucket.is_last()
        if self._link is None:
            self._require_fallback()
            fut = pg.fallback_all_reduce(buf, self._group, async_op=True)
            assert fut is not None
            self._count_fallbacks(1)
            if ov is not None:
                ov.plain_bucket(bucket)
            if last:
                self._end_step()
                if ov is not None:
                    ov.backward_done()
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
        if ov is not None and ov.active:
            return ov.handed(p, bucket, last)
        if ov is not None:
            ov.plain_bucket(bucket)
        p.future = torch.futures.Future()
        if auto is not None:
            auto_steps.time_exchange(p)
            auto.bucket_left(time.perf_counter())
        times.left = time.perf_counter()
        if last:
            self._finish_step()
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
    ) -> torch.Tensor:
        """Average `tensor` over the ranks in place (blocking); returns it.

        `key` names the tensor across calls, so THC keeps its error feedback and
        scale for it; without a key every call agrees a fresh scale.
        `average` False: the sum instead (fp32 and fp16 only; exact in fp32
        with loss bound 0, the fallback's sum too).
        """
        name = codec or self.codec
        if not average and name not in ("fp32", "fp16"):
            raise LocalError(f"a sum through dlcp needs codec fp32 or fp16, not {name!r}")
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
            pg.fallback_all_reduce(tensor, self._group, average=average)
            self._count_fallbacks(1)
            self._end_step()
            return tensor
        auto = self._auto_for(name)
        if auto is not None:
            auto.bucket_entered(tensor.numel(), time.perf_counter())
            name = auto.current
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        ef_key: Key | None = ("all_reduce", name, key) if key is not None else None
        p = self._launch(flat, 0, name, ef_key, lambda plan: np.zeros(plan.packets, np.uint16))
        p.average = average
        if auto is not None:
            auto_steps.time_exchange(p)
            auto.bucket_left(time.perf_counter())
        self._finish_step()
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return tensor

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

    def _get_store(self) -> Store:
        if self._store is None:
            self._store = dist.distributed_c10d._get_default_store()
        return self._store
