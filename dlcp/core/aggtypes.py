"""What the aggregators (`aggregate.ShardAggregator`, `collector.ResultCollector`)
hand the engine and share: a NACK to send, a summed shard's result, a run of
packets rejected, the earliest-due timer of a poll, and `PartField`, the
aggregator's read-through to its parts' fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from dlcp.errors import Reason, RemoteError

__all__ = ["Nack", "PartField", "RunRejected", "ShardResult"]

T = TypeVar("T")


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


class PartField(Generic[T]):
    """A read-only attribute that is the same-named attribute of one of the
    object's parts (`ShardAggregator.created` is its `clock.created`)."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, objtype: type | None = None) -> T:
        value: T = getattr(getattr(obj, self.part), self.name)
        return value


class RunRejected(RemoteError):
    """A run of packets rejected for `reason`, except those of `bad`, which
    are BAD_RANGE (not packets of the shard)."""

    def __init__(self, reason: Reason, detail: str, bad: np.ndarray) -> None:
        super().__init__(reason, detail)
        self.bad = bad
