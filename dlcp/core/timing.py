"""Timer settings of the aggregation state machines, and their adaptation.

All values are seconds. The core never reads a clock: callers pass `now`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlcp.errors import LocalError

__all__ = ["NackClock", "Timing", "done_wait", "note_late", "reorder_wait", "repeat_wait"]


@dataclass(frozen=True)
class Timing:
    # After a shard's last arrival, how long before a missing required packet of
    # a sender whose DONE came is NACKed (again): the packets found lost by what
    # came after them (`reorder`) are asked for sooner.
    nack_delay: float = 0.005
    # A packet found lost by what came after it (`dlcp.core.stream`): how long
    # it may still be reordered (paths of other delays) before it is NACKed.
    # 0: at once.
    reorder: float = 0.002
    # Between repeated NACKs for the same missing packets: the longest wait,
    # and the wait until a peer's answers to NACKs have been timed (NackClock).
    nack_interval: float = 0.03
    # The shortest wait between repeated NACKs, however fast a peer answers.
    nack_min: float = 0.005
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
        for name in (
            "nack_delay",
            "nack_interval",
            "nack_min",
            "linger",
            "grace",
            "timeout",
            "retain",
        ):
            value = getattr(self, name)
            if not value > 0:
                raise LocalError(f"timing.{name} must be > 0 seconds, got {value}")
        if not 0 <= self.reorder < self.timeout:
            raise LocalError(
                f"timing.reorder must be 0 or more seconds, below timing.timeout; "
                f"got {self.reorder}"
            )
        if not 0 <= self.ack_wait < self.timeout:
            raise LocalError(
                f"timing.ack_wait must be 0 or more seconds, below timing.timeout; "
                f"got {self.ack_wait}"
            )
        if self.timeout <= self.grace:
            raise LocalError("timing.timeout must exceed timing.grace")
        if self.nack_min > self.nack_interval:
            raise LocalError(
                f"timing.nack_min ({self.nack_min}) must not exceed timing.nack_interval "
                f"({self.nack_interval})"
            )


class NackClock:
    """How soon one peer answers a NACK, and so how long to wait before
    repeating one that has gone unanswered.

    A NACK's answer is the first retransmitted packet that comes back for it.
    The time from the NACK to its answer is learnt as TCP learns its
    retransmission timeout (RFC 6298: a smoothed mean and mean deviation), and
    with Karn's rule: a NACK that had to be repeated is no sample, since which
    copy was answered is unknown. A fixed wait between NACKs would have to
    cover the slowest network and the busiest host, and every lost NACK or
    retransmission costs a round that wait.
    """

    __slots__ = ("reorder", "rttvar", "samples", "srtt")

    def __init__(self) -> None:
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.samples = 0
        # how late this peer's packets have come after what came behind them
        # said they were lost (`late`): the reordering of its paths
        self.reorder = 0.0

    def late(self, seconds: float, timing: Timing) -> None:
        """A packet of this peer asked for as lost came `seconds` after it was
        found lost (the paths reorder more than the window): the window takes
        half as much again, at most `timing.nack_interval`, as RACK's grows on
        a spurious retransmission (RFC 8985)."""
        if seconds >= 0:
            self.reorder = min(max(self.reorder, 1.5 * seconds), timing.nack_interval)

    def sample(self, seconds: float) -> None:
        """One NACK answered `seconds` after it was sent (never repeated)."""
        if not seconds >= 0:
            return
        self.samples += 1
        self.reorder *= 0.9  # a NACK answered: the window shrinks back, slowly
        if self.srtt is None:
            self.srtt = seconds
            self.rttvar = seconds / 2
            return
        self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - seconds)
        self.srtt = 0.875 * self.srtt + 0.125 * seconds

    def repeat_after(self, timing: Timing, unanswered: int = 1) -> float:
        """How long after the last of `unanswered` (>= 1) NACKs to repeat it:
        the mean answer time plus four deviations, within `timing.nack_min`
        and `timing.nack_interval`, doubled for each NACK before the last that
        went unanswered too (at most `nack_interval`); `nack_interval` until an
        answer has been timed."""
        if self.srtt is None:
            return timing.nack_interval
        wait = min(max(self.srtt + 4 * self.rttvar, timing.nack_min), timing.nack_interval)
        return min(wait * (1 << min(max(unanswered - 1, 0), 16)), timing.nack_interval)


def repeat_wait(clock: NackClock | None, timing: Timing, unanswered: int) -> float:
    """How long after its last of `unanswered` NACKs a peer is asked again:
    its clock's wait, or `nack_interval` for a peer without one."""
    return timing.nack_interval if clock is None else clock.repeat_after(timing, unanswered)


def reorder_wait(clock: NackClock | None, timing: Timing) -> float:
    """How long after a packet of a peer is found lost it is NACKed:
    `timing.reorder`, or the reordering seen on the peer's paths if more."""
    return timing.reorder if clock is None else max(timing.reorder, clock.reorder)


def note_late(clock: NackClock | None, late: float | None, timing: Timing) -> None:
    """A packet of the peer asked for as lost came `late` after its ask
    (None: none did): the window it was asked after was short by that much
    (`NackClock.late`)."""
    if late is not None and clock is not None:
        clock.late(late + reorder_wait(clock, timing), timing)


def done_wait(clock: NackClock | None, timing: Timing) -> float:
    """How long a peer's packets may pause before it is asked for the DONE
    that should have followed them: the time it takes to answer a NACK
    (`NackClock.repeat_after`, a few round-trips), at most `timing.grace`;
    the grace for a peer not yet timed."""
    if clock is None or clock.srtt is None:
        return timing.grace
    return min(clock.repeat_after(timing, 1), timing.grace)
