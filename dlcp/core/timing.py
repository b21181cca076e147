"""Timer settings of the aggregation state machines, and their adaptation.

All values are seconds. The core never reads a clock: callers pass `now`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlcp.errors import LocalError

__all__ = ["Timing"]


@dataclass(frozen=True)
class Timing:
    # After a sender's DONE, how long a missing required packet may still be in
    # flight (reordered behind the top-priority DONE) before it is NACKed.
    nack_delay: float = 0.005
    # Between repeated NACKs for the same missing packets.
    nack_interval: float = 0.03
    # Once every required packet is in and the bound is met, how long to wait
    # for droppable stragglers before completing without them.
    linger: float = 0.002
    # With data but no DONE from a sender, how long before asking for it; and
    # with no result yet from a shard's owner, how long it must have been quiet
    # (none of its data for this host's shards either) before it is asked.
    grace: float = 0.05
    # A round that cannot complete within this time fails with a clear reason.
    timeout: float = 10.0
    # How long completed results are kept to answer NACKs from slow receivers.
    retain: float = 5.0
    # A round complete here while some receiver has not ACKed this node's result
    # shards, whose datagrams read the caller's `out` in place (Engine(gather=
    # True)): how long its completion waits for those ACKs before the datagrams
    # copy their payloads (the caller may reuse `out` once told). 0: copy at once.
    # A receiver ACKs as its own round completes, so the wait ends about when
    # the job's slowest node is done, which every rank's step waits for anyway.
    ack_wait: float = 0.05

    def __post_init__(self) -> None:
        for name in ("nack_delay", "nack_interval", "linger", "grace", "timeout", "retain"):
            value = getattr(self, name)
            if not value > 0:
                raise LocalError(f"timing.{name} must be > 0 seconds, got {value}")
        if not 0 <= self.ack_wait < self.timeout:
            raise LocalError(
                f"timing.ack_wait must be 0 or more seconds, below timing.timeout; "
                f"got {self.ack_wait}"
            )
        if self.timeout <= self.grace:
            raise LocalError("timing.timeout must exceed timing.grace")
