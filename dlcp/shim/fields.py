"""The parts of a `dlcp.shim.state.DlcpState` (`Parts`, built by `assemble`)
and what it pickles, grouped as PowerSGDState groups its own: settings and
persistent state survive pickling (checkpoints, under the names below,
whichever part owns them: `saved`); the rest is rebuilt or reconnected on
next use."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from dlcp.shim import pg
from dlcp.shim.attachment import Attachment
from dlcp.shim.auto_steps import AutoDriver
from dlcp.shim.launch import BucketLauncher
from dlcp.shim.layers import LayerMap
from dlcp.shim.rendezvous import Store
from dlcp.shim.scales import Scales
from dlcp.shim.settings import ShimSettings
from dlcp.shim.staging import Staging
from dlcp.shim.stepend import StepFinisher
from dlcp.shim.stepstate import StepBuckets
from dlcp.shim.timeline import Timeline

__all__ = ["CONFIG", "PERSISTENT", "SLOTS", "Parts", "assemble", "saved"]

# settings, pickled
CONFIG = (
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
    "switch_socket",
    "placement",
    "segment_bytes",
    "link_bps",
    "auto_options",
)
# counters and what a step carries over (error feedback, scales, auto), pickled
PERSISTENT = (
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
SLOTS = ("_settings", "_parts", "_overlap", "__weakref__")  # DlcpState's


class Parts(NamedTuple):
    """The objects a `DlcpState` is made of, each owning what it changes."""

    scales: Scales
    attachment: Attachment
    step: StepBuckets
    launcher: BucketLauncher
    auto: AutoDriver
    timeline: Timeline
    finisher: StepFinisher


def assemble(
    settings: ShimSettings,
    saved: dict[str, Any],
    group: pg.Group,
    store: Store | None,
    model: torch.nn.Module | None,
    *,
    auto_now: bool = False,
) -> Parts:
    """The parts of a state, with what a checkpoint carried (`saved`: names of
    CONFIG and PERSISTENT; missing ones take their defaults)."""
    scales = Scales(
        saved.get("scale_mode", "packet"), saved.get("scale_margin", 1.25), saved.get("_scales")
    )
    attachment = Attachment(
        settings,
        group,
        store,
        segment_bytes=saved.get("segment_bytes"),
        attaches=saved.get("attaches", 0),
        failures=saved.get("failures", 0),
        last_error=saved.get("last_error"),
        fallbacks=saved.get("fallbacks", 0),
        unreported=saved.get("_unreported", 0),
        detached_round=saved.get("_detached_round"),
    )
    step = StepBuckets()
    staging = Staging()
    launcher = BucketLauncher(
        settings, attachment, step, scales, staging, LayerMap(model), saved.get("_ef")
    )
    auto = AutoDriver(settings.link_bps, settings.auto_options, saved.get("_auto"), now=auto_now)
    timeline = Timeline()
    finisher = StepFinisher(
        settings,
        attachment,
        step,
        launcher,
        scales,
        staging,
        auto,
        timeline,
        round_=saved.get("round", 0),
        rounds=saved.get("rounds", 0),
        lost_lanes=saved.get("lost_lanes", 0),
        total_lanes=saved.get("total_lanes", 0),
        saturated=saved.get("saturated", 0),
    )
    return Parts(scales, attachment, step, launcher, auto, timeline, finisher)


def saved(settings: ShimSettings, parts: Parts) -> dict[str, Any]:
    """What a state pickles: CONFIG and PERSISTENT, by name."""
    a, f = parts.attachment, parts.finisher
    owned = {
        "scale_margin": parts.scales.margin,
        "scale_mode": parts.scales.mode,
        "segment_bytes": a.segment_bytes,
        "round": f.round,
        "fallbacks": a.fallbacks,
        "rounds": f.rounds,
        "attaches": a.attaches,
        "failures": a.failures,
        "lost_lanes": f.lost_lanes,
        "total_lanes": f.total_lanes,
        "saturated": f.saturated,
        "last_error": a.last_error,
        "_unreported": a.unreported,
        "_ef": parts.launcher.ef,
        "_scales": parts.scales.by_key,
        "_detached_round": a.detached_round,
        "_auto": parts.auto.codec,
    }
    state = {**{n: getattr(settings, n) for n in CONFIG if n not in owned}, **owned}
    assert set(state) == set(CONFIG + PERSISTENT)
    return state
