"""What a step of the shim holds and needs: its buckets in flight (`_Pending`,
one a bucket: its buffer, plan, submission, reply and error-feedback state;
`StepBuckets`, the step's list of them, and waiting for their replies),
the key that names a bucket across steps, the segment one step's gradients
take (`segment_for`, `with_headroom`), and the error `strict=True` raises.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dlcp.codecs import CodecState
from dlcp.errors import DlcpError
from dlcp.shim.arena import MIN_SEGMENT
from dlcp.shim.exchange import RoundPlan, Submitted
from dlcp.shim.timeline import BucketTimes

__all__ = ["Key", "ShimError", "StepBuckets", "segment_for", "wait_replies", "with_headroom"]

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


def wait_replies(pending: Iterable[_Pending], deadline: float, timeout_s: float) -> None:
    """Wait until `deadline` (time.monotonic) for the replies of `pending`; a
    bucket without one gets its error (`timeout_s`: the round timeout, named
    in it)."""
    for p in pending:
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
            p.error = f"no reply within {timeout_s:g} s"
        except Exception as exc:
            p.error = f"{type(exc).__name__}: {exc}"


class StepBuckets:
    """The buckets of the step under way, in the order they were launched,
    until the step ends (`take`) or overlap mode takes them over (`release`)."""

    def __init__(self) -> None:
        self._buckets: list[_Pending] = []

    def __len__(self) -> int:
        return len(self._buckets)

    def __bool__(self) -> bool:
        return bool(self._buckets)

    def __iter__(self) -> Iterator[_Pending]:
        return iter(self._buckets)

    def add(self, p: _Pending) -> None:
        self._buckets.append(p)

    def first_error(self) -> str | None:
        """The error of the step's first failed bucket (None: none failed)."""
        return next((p.error for p in self._buckets if p.error), None)

    def wait(self, deadline: float, timeout_s: float) -> None:
        """Wait for every bucket's reply (`wait_replies`)."""
        wait_replies(self._buckets, deadline, timeout_s)

    def release(self, held: Iterable[_Pending]) -> None:
        """`held` leave the step: the step's end no longer waits for them."""
        ids = {id(p) for p in held}
        self._buckets = [p for p in self._buckets if id(p) not in ids]

    def take(self) -> list[_Pending]:
        """The step's buckets, leaving none (the step ended)."""
        out, self._buckets = self._buckets, []
        return out
