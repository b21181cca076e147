"""What a result collector (dlcp.core.collector) still waits for from one
owner's shard: which result packets came, the owner's DONE, and the NACKs
sent it since its last answer (with their `PacketStream`: the asks and the
packets found lost)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dlcp.core.stream import LOWEST_REQUIRED_CLASS, PacketStream
from dlcp.core.timing import NackClock

__all__ = ["Awaited"]


@dataclass
class Awaited:
    """What a result collector still waits for from one owner's shard."""

    owner: int
    indices: np.ndarray  # global result-packet indices of the shard
    received: np.ndarray
    done: bool = False
    last_arrival: float | None = None
    last_nack: float = -math.inf
    unanswered: int = 0  # NACKs sent to the owner since it last answered one
    # per result packet, the lowest class it may travel in (`PacketStream`)
    bound: np.ndarray | int = LOWEST_REQUIRED_CLASS
    # its asks and the packets found lost by later arrivals
    stream: PacketStream = field(init=False)

    def __post_init__(self) -> None:
        self.stream = PacketStream(self.received, self.bound)

    def asked(self, ask: np.ndarray, counted: bool, now: float) -> None:
        """The owner was sent a NACK for packets `ask` (or for its DONE alone,
        `counted` towards the repeat back-off or not) at `now`; the back-off
        counts as `ShardClock._asked` does (`PacketStream.ask`)."""
        again = self.stream.ask(ask, now)
        if (ask.size and (again or not self.unanswered)) or (not ask.size and counted):
            self.unanswered += 1
        self.last_nack = now

    def answered(self, clock: NackClock | None, now: float) -> None:
        """A retransmission came: the answer to the NACKs sent since the last
        (`PacketStream.answered`)."""
        self.stream.answered(clock, now)
        self.unanswered = 0
