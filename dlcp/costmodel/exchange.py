"""In-process gradient exchange through a codec: every worker and the shard owner
of one bucket in one process, no sockets (simulation, calibration, tests).

`average(codec, grads, states, seed=...)` runs the codec's `Pipeline` with one
shard and `len(grads)` contributors and returns the mean with the bytes each
worker pushed and pulled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dlcp.codecs.base import Codec, CodecState
from dlcp.costmodel.pipeline import ShardContext, pipeline_for
from dlcp.errors import LocalError

__all__ = ["Exchange", "average"]


@dataclass
class Exchange:
    """The mean one exchange produced and what it cost on the wire (per worker)."""

    mean: torch.Tensor
    push: list[int]  # one worker's payload bytes, per phase
    pull: list[int]  # the result bytes, per phase

    @property
    def phases(self) -> int:
        """Round trips: 2 for sketch (union, then cells), else 1."""
        return len(self.push)

    @property
    def push_bytes(self) -> int:
        return sum(self.push)

    @property
    def pull_bytes(self) -> int:
        return sum(self.pull)


def average(
    codec: Codec,
    grads: Sequence[torch.Tensor],
    states: Sequence[CodecState] | None = None,
    *,
    seed: int = 0,
    error_feedback: bool = True,
) -> Exchange:
    """Mean of `grads` (flat float32, one per worker) as it comes out of `codec`.

    `states` (one per worker) carry error feedback across calls; None starts
    fresh ones. THC's shared scale is the workers' maximum (THC's norm exchange).
    """
    if not grads:
        raise LocalError("no gradients to average")
    numel = grads[0].numel()
    if any(g.numel() != numel for g in grads):
        raise LocalError("workers' buckets differ in size")
    pipe = pipeline_for(codec, error_feedback=error_feedback)
    ctxs = [
        ShardContext(numel, state=s)
        for s in (states if states is not None else [CodecState() for _ in grads])
    ]
    for ctx, g in zip(ctxs, grads, strict=True):
        pipe.begin(ctx, g.reshape(-1).to(torch.float32), seed)
    maxima = [pipe.local_max(c) for c in ctxs]
    if all(m is not None for m in maxima):
        for ctx in ctxs:
            ctx.scale = max(m for m in maxima if m is not None)
    push: list[int] = []
    pull: list[int] = []
    result = b""
    for phase in range(pipe.phases):
        payloads = [pipe.encode(c, phase) for c in ctxs]
        result = pipe.aggregate(phase, payloads, numel)
        push.append(max(len(p) for p in payloads))
        pull.append(len(result))
        if phase < pipe.phases - 1:
            for c in ctxs:
                pipe.absorb(c, phase, result)
    mean = pipe.decode(ctxs[0], result, len(grads))  # every worker gets the same
    for c in ctxs[1:]:
        pipe.learn(c, result, len(grads))
    return Exchange(mean, push, pull)
