"""What a step of the shim holds and needs: its buckets in flight (`_Pending`,
one a bucket: its buffer, plan, submission, reply and error-feedback state),
the key that names a bucket across steps, the segment one step's gradients
take (`segment_for`, `with_headroom`), and the error `strict=True` raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dlcp.codecs import CodecState
from dlcp.errors import DlcpError
from dlcp.shim.arena import MIN_SEGMENT
from dlcp.shim.exchange import RoundPlan, Submitted
from dlcp.shim.timeline import BucketTimes

__all__ = ["Key", "ShimError", "segment_for", "with_headroom"]

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
    average: bool = True  # False: the sums, not the mean (a float codec only)
