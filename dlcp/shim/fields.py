"""The fields of `dlcp.shim.state.DlcpState` (its `__slots__`), grouped as
PowerSGDState groups its own: settings and persistent state survive pickling
(checkpoints); runtime fields are rebuilt or reconnected on next use."""

from __future__ import annotations

__all__ = ["CONFIG", "PERSISTENT", "RUNTIME"]

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
# rebuilt or reconnected lazily after unpickling
RUNTIME = (
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
    "_overlap",
    "__weakref__",
)
