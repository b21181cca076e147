"""What training code imports: a DDP communication hook and an all-reduce.

    import dlcp.shim as dlcp
    state = dlcp.init(codec="fp32", loss_bound=0.01)  # uses torch.distributed's store
    ddp_model.register_comm_hook(state, dlcp.hook)
    dlcp.all_reduce(tensor)                            # non-DDP code, averages
    opt = dlcp.overlap(ddp_model, state, torch.optim.SGD, lr=0.1)  # dlcp.shim.overlap

Every rank talks to the dlcp daemon on its host (`DLCP_SOCKET` or
`init(socket=...)`). If the daemon is unreachable or fails, all ranks fall
back together to the process group's all-reduce (warning once, counted in
`state.fallbacks`) and reattach later; `strict=True` raises instead. See
`dlcp.shim.state` for how the ranks agree on the path.
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook checks
# the hook's annotations against dist.GradBucket and Future[Tensor] objects.
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dlcp.codecs import CODEC_NAMES
from dlcp.errors import LocalError
from dlcp.shim import backend as _backend
from dlcp.shim.auto import AUTO
from dlcp.shim.client import DaemonClient, DaemonError, Segment, default_socket
from dlcp.shim.leave import exit_process
from dlcp.shim.overlap import OverlapOptimizer, overlap
from dlcp.shim.rendezvous import Store
from dlcp.shim.state import DlcpState, ShimError

__all__ = [
    "CODEC_NAMES",
    "DaemonClient",
    "DaemonError",
    "DlcpState",
    "OverlapOptimizer",
    "Segment",
    "ShimError",
    "all_reduce",
    "backend_options",
    "default_socket",
    "default_state",
    "exit_process",
    "hook",
    "init",
    "make_hook",
    "overlap",
]

_default: DlcpState | None = None
_backend.register()  # init_process_group("cpu:dlcp,cuda:dlcp"): dlcp.shim.backend
backend_options = _backend.set_options

Hook = Callable[[DlcpState, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def init(
    codec: str = "fp32",
    loss_bound: float = 0.0,
    *,
    socket: str | None = None,
    strict: bool = False,
    process_group: dist.ProcessGroup | None = None,
    store: Store | None = None,
    model: torch.nn.Module | None = None,
    **options: Any,
) -> DlcpState:
    """Attach every rank to its daemon (collective: call it on all ranks).

    codec: fp32, fp16, thc8, thc4, fft (`codec_options=` e.g. {"theta":
    "diminishing"}: `dlcp.codecs.fft_wire`), sketch, or auto: the codec the cost model predicts
    fastest for the measured bucket sizes and backward timing, this host's
    calibrated codec costs and the link rate, the same on every rank
    (`dlcp.shim.auto`; `link_bps=` or DLCP_LINK_BPS fixes the link rate, else
    it is read from the daemon's rate controller; `auto_options=` tunes it;
    `state.auto_codec` is the codec in use; sketch only when named in
    `auto_options={"candidates": [...]}`); sketch: lossless for sparse
    gradients, two daemon rounds a bucket (`dlcp.shim.sketch_round`;
    `codec_options={"keep": 0.05}` first keeps the top 5 % of values, error
    feedback carrying the rest). loss_bound: the fraction of a
    bucket that may be lost (0..0.5). socket: the daemon's Unix socket (default
    `DLCP_SOCKET`, else /run/dlcp/dlcpd.sock). store: the rendezvous store
    (default: the default process group's). model: gives exact layer indices
    for priorities (else learned from DDP's buckets). `options` are the other
    `DlcpState` settings (retry_steps, retry_s, round_timeout_s, ...).
    The returned state is also the default of `all_reduce`.
    """
    global _default
    if not dist.is_initialized():
        raise LocalError("dlcp.shim.init needs torch.distributed: call init_process_group first")
    state = DlcpState(
        codec=codec,
        loss_bound=loss_bound,
        socket=socket,
        strict=strict,
        process_group=process_group,
        store=store,
        model=model,
        **options,
    )
    state.attach()
    _default = state
    return state


def default_state() -> DlcpState:
    """The state of the last `init`."""
    if _default is None:
        raise LocalError("call dlcp.shim.init(...) first")
    return _default


def hook(state: DlcpState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket averaged over all ranks, through dlcp."""
    return state.run_bucket(bucket)


def make_hook(codec: str) -> Hook:
    """A hook like `hook` that uses `codec` (a wire codec or "auto") instead of the state's."""
    if codec not in CODEC_NAMES and codec != AUTO:
        raise LocalError(f"unknown codec {codec!r}; valid codecs: {', '.join(CODEC_NAMES)}, {AUTO}")

    def codec_hook(state: DlcpState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return state.run_bucket(bucket, codec=codec)

    codec_hook.__name__ = f"dlcp_{codec}_hook"
    return codec_hook


def all_reduce(
    tensor: torch.Tensor,
    *,
    state: DlcpState | None = None,
    codec: str | None = None,
    key: object | None = None,
) -> torch.Tensor:
    """Average `tensor` in place over all ranks (blocking; collective); returns it.

    `key` names a tensor that is reduced repeatedly, so THC can keep its error
    feedback and scale for it.
    """
    return (state or default_state()).all_reduce(tensor, codec=codec, key=key)
