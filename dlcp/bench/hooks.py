"""PyTorch's own DDP communication hooks, as the Gloo baselines register them.

    state = register(ddp, "fp16")      # fp16_compress_hook
    state = register(ddp, "powersgd")  # powerSGD_hook, buckets one after another

`bf16`: PyTorch's `bf16_compress_hook` itself, called from a function of
another name: DDP refuses a hook named bf16_compress_hook unless CUDA and
NCCL are there, though Gloo all-reduces bfloat16 on CPU.

`powersgd`: `powerSGD_hook` (rank `POWERSGD_RANK`, error feedback and warm
start, PowerSGD from the second step: the first two run DDP's all-reduce).
Its all-reduces are chained in `.then` callbacks that run on Gloo's threads;
with two buckets in flight the ranks issue them in different orders and Gloo
aborts. Here each bucket's chain starts when the previous bucket's future has
completed, so every rank issues the same collectives in the same order; the
cost is the overlap between buckets' communication.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook checks the
# hooks' annotations and wants the real types, not strings.
from typing import Any

import torch
import torch.distributed as dist

from dlcp.bench.backends import HOOK_CODECS, POWERSGD_RANK

__all__ = ["SerialPowerSGD", "bf16_hook", "register"]


def bf16_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's bf16_compress_hook (cast, divide by the world, all-reduce, cast back)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)


class SerialPowerSGD:
    """powerSGD_hook's state, and the future of the bucket last handed to it."""

    def __init__(self, rank: int = POWERSGD_RANK, seed: int = 0) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        self.psgd = psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=2,
            use_error_feedback=True,
            warm_start=True,
            random_seed=seed,
        )
        self.last: torch.futures.Future[torch.Tensor] | None = None

    @staticmethod
    def hook(
        state: "SerialPowerSGD", bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        if state.last is not None and bucket.index() != 0:
            state.last.wait()  # the previous bucket's chain is done: no race between them
        state.last = fut = psgd.powerSGD_hook(state.psgd, bucket)
        return fut


def register(ddp: Any, hook: str) -> Any:
    """Register the Gloo baseline `hook` (a HOOK_CODECS key) on `ddp`; its state."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if hook not in HOOK_CODECS:
        raise ValueError(f"unknown hook {hook!r}; valid: {', '.join(HOOK_CODECS)}")
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        ddp.register_comm_hook(None, bf16_hook)
    elif hook == "powersgd":
        state = SerialPowerSGD()
        ddp.register_comm_hook(state, SerialPowerSGD.hook)
        return state
    return None
