"""What the aggregators (`aggregate.ShardAggregator`, `collector.ResultCollector`)
hand the engine and share: a NACK to send, a summed shard's result, a run of
packets rejected, the earliest-due timer of a poll.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlcp.errors import Reason, RemoteError

__all__ = ["Nack", "RunRejected", "ShardResult"]


@dataclass(frozen=True)
class Nack:
    """Ask `node` again for packets (local indices within the shard)."""

    node: int
    shard: int
    packets: tuple[int, ...]
    need_manifest: bool = False


@dataclass
class ShardResult:
    """The aggregated sums of one shard."""

    shard: int
    sums: np.ndarray  # summed lanes of the shard, lane_ops.sum_dtype(codec)
    contributors: np.ndarray  # per data packet of the shard: contributions summed
    block_max: np.ndarray  # per data packet: max of the contributors' block maxima
    lost_lanes: int  # droppable lanes left out of the sum
    total_lanes: int  # lanes all senders together should have sent


@dataclass
class _Tick:
    """Earliest time something is due; None when nothing is."""

    at: float | None = None

    def arm(self, t: float) -> None:
        if self.at is None or t < self.at:
            self.at = t


class RunRejected(RemoteError):
    """A run of packets rejected for `reason`, except those of `bad`, which
    are BAD_RANGE (not packets of the shard)."""

    def __init__(self, reason: Reason, detail: str, bad: np.ndarray) -> None:
        super().__init__(reason, detail)
        self.bad = bad
