"""What the shim asks of the process group: agreement, a shared max, the fallback.

These are collectives, so every rank must call them in the same order; the
shim calls them only at points all ranks reach in the same state (see
`dlcp.shim.state` for the agreement rule). `agree` may go through a `Hedge`
(`dlcp.shim.hedge`): the same all-reduce on several Gloo groups at once,
the first to complete taken.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = [
    "DirectGroup",
    "Group",
    "agree",
    "agree_start",
    "all_reduce_async",
    "average",
    "fallback_all_reduce",
    "global_max",
    "global_max_start",
    "group_rank",
    "group_size",
    "on_cpu",
]


class DirectGroup:
    """A process group object that torch.distributed's registry does not know
    (dlcp's torch.distributed backend keeps its own Gloo groups inside it),
    called directly instead of through `dist.*(group=...)`."""

    __slots__ = ("pg", "rank", "size")

    def __init__(self, pg: Any, rank: int, size: int) -> None:
        self.pg, self.rank, self.size = pg, rank, size

    def all_reduce(self, t: torch.Tensor, op: Any, *, async_op: bool = False) -> Any:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        work = self.pg.allreduce([t], opts)
        if async_op:
            return work
        work.wait()
        return None


Group = dist.ProcessGroup | DirectGroup | None


def group_size(group: Group) -> int:
    if isinstance(group, DirectGroup):
        return group.size
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    if isinstance(group, DirectGroup):
        return group.rank
    return dist.get_rank(group)


def _all_reduce(
    t: torch.Tensor, group: Group, op: Any = dist.ReduceOp.SUM, *, async_op: bool = False
) -> Any:
    if isinstance(group, DirectGroup):
        return group.all_reduce(t, op, async_op=async_op)
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def _device(group: Group) -> torch.device:
    """Where small control tensors live: CUDA for NCCL groups, the CPU otherwise."""
    if isinstance(group, DirectGroup):
        return torch.device("cpu")  # dlcp's own groups are Gloo's
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class MaxReducer(Protocol):
    """What `agree` can run its MAX on besides a group (`dlcp.shim.hedge.Hedge`)."""

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        """The element-wise max of CPU float32 `t` over all ranks (a new tensor
        or `t` itself); every rank gets the same bytes."""
        ...

    def start(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """`max_` begun; the function returned waits and gives its answer."""
        ...


def on_cpu(group: Group) -> bool:
    """Whether `group`'s collectives take CPU tensors (Gloo's do, NCCL's not)."""
    return _device(group).type == "cpu"


def all_reduce_async(t: torch.Tensor, group: Group, op: Any = dist.ReduceOp.SUM) -> Any:
    """Start an all-reduce of `t` in place over `group`; returns its `Work`."""
    return _all_reduce(t, group, op, async_op=True)


def agree(
    failed: bool, maxima: torch.Tensor | None, group: Group | MaxReducer
) -> tuple[bool, torch.Tensor]:
    """One all-reduce (MAX) of [failed, *maxima]: whether any rank failed, and the
    element-wise maxima over all ranks (float32, CPU). Every rank gets identical
    answers; every rank must pass maxima of the same length."""
    return agree_start(failed, maxima, group)()


def agree_start(
    failed: bool, maxima: torch.Tensor | None, group: Group | MaxReducer
) -> Callable[[], tuple[bool, torch.Tensor]]:
    """`agree` begun: its all-reduce issued now; the function returned waits
    for it and gives `agree`'s answer. Call it once, before the next
    collective on `group` starts (its work between the two overlaps the
    all-reduce: the step's decoding, `dlcp.shim.stepend`)."""
    flag = torch.tensor([1.0 if failed else 0.0], dtype=torch.float32)
    parts = [flag] if maxima is None else [flag, maxima.reshape(-1).to("cpu", torch.float32)]
    t = torch.cat(parts)
    if group is None or isinstance(group, DirectGroup | dist.ProcessGroup):
        result = global_max_start(t, group)
    else:
        result = group.start(t)

    def answer() -> tuple[bool, torch.Tensor]:
        out = result()
        return bool(out[0] > 0.0), out[1:]

    return answer


def global_max(values: torch.Tensor, group: Group) -> torch.Tensor:
    """The element-wise max of `values` over all ranks (float32, CPU)."""
    return global_max_start(values, group)()


def global_max_start(values: torch.Tensor, group: Group) -> Callable[[], torch.Tensor]:
    """`global_max` begun: the all-reduce issued now; the function returned
    waits for it and gives the maxima."""
    t = values.reshape(-1).to(_device(group), torch.float32, copy=True)
    work = _all_reduce(t, group, dist.ReduceOp.MAX, async_op=True)

    def result() -> torch.Tensor:
        work.wait()
        return t.cpu()

    return result


def average(values: torch.Tensor, group: Group) -> torch.Tensor:
    """The element-wise mean of `values` over all ranks (float32, CPU); every rank
    gets the same bytes (one all-reduce)."""
    t = values.reshape(-1).to(_device(group), torch.float32, copy=True)
    _all_reduce(t, group)
    return t.cpu() / group_size(group)


def fallback_all_reduce(
    tensor: torch.Tensor, group: Group, *, async_op: bool = False, average: bool = True
) -> torch.futures.Future[torch.Tensor] | None:
    """Average `tensor` in place over the group exactly as PyTorch's default hook
    does (divide by the group size first, then sum), or sum it (`average`
    False). With `async_op`, returns a future holding the tensor; otherwise
    waits."""
    if average:
        tensor.div_(group_size(group))
    work = _all_reduce(tensor, group, async_op=async_op)
    if not async_op:
        return None
    assert work is not None
    fut: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda f: f.value()[0])
    return fut
