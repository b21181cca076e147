"""What a receiver learns of one sender's missing packets from what came after
them (`dlcp.core.stream.PacketStream`), sans-IO."""

from __future__ import annotations

import numpy as np
import pytest

from dlcp.core.stream import PacketStream
from dlcp.errors import LocalError

REORDER = 0.002


def came(stream: PacketStream, local: list[int], classes: list[int], now: float) -> None:
    idx = np.asarray(local, dtype=np.int64)
    stream.received[idx] = True
    stream.arrived(idx, np.asarray(classes, dtype=np.uint8), None, now)


def resent(
    stream: PacketStream, local: list[int], now: float, mask: np.ndarray | None = None
) -> None:
    idx = np.asarray(local, dtype=np.int64)
    stream.received[idx] = True
    stream.arrived(idx, np.ones(idx.size, np.uint8), np.ones(idx.size, bool), now, mask)


def test_a_later_packet_in_a_class_at_the_bound_tells_the_earlier_missing_ones_lost() -> None:
    s = PacketStream(np.zeros(10, dtype=bool), bound=5)
    came(s, [0, 1], [1, 1], 0.0)
    came(s, [4], [3], 0.001)  # a higher class: it may have overtaken 2 and 3
    assert s.next_due(REORDER) is None
    came(s, [6], [5], 0.002)  # at the bound: 2, 3 and 5 were sent before it
    assert s.next_due(REORDER) == pytest.approx(0.004)
    assert s.due(0.0039, REORDER).size == 0  # not before the reorder window
    came(s, [3], [2], 0.003)  # one was merely late: it is not asked for
    assert s.due(0.004, REORDER).tolist() == [2, 5]
    assert s.next_due(REORDER) is None
    came(s, [9], [5], 0.005)  # packets 7 and 8, once each
    assert s.due(0.01, REORDER).tolist() == [7, 8]


def test_per_packet_bounds_take_a_later_packet_of_each_ones_class_or_after() -> None:
    s = PacketStream(np.zeros(6, dtype=bool), bound=np.array([2, 5, 2, 5, 1, 1]))
    came(s, [4], [2], 0.0)  # class 2: packets 0 and 2 (bound 2) were sent before it
    assert s.due(1.0, REORDER).tolist() == [0, 2]
    came(s, [5], [5], 1.0)  # class 5: packets 1 and 3 now too
    assert s.due(2.0, REORDER).tolist() == [1, 3]
    with pytest.raises(LocalError, match="class bounds"):
        PacketStream(np.zeros(3, dtype=bool), bound=np.array([1, 9, 1]))


def test_an_asked_packet_is_not_found_lost_again_by_first_transmissions() -> None:
    s = PacketStream(np.zeros(8, dtype=bool))
    came(s, [3], [5], 0.0)
    lost = s.due(0.01, REORDER)
    assert lost.tolist() == [0, 1, 2]
    s.ask(lost, 0.01)
    assert s.asks[:3].tolist() == [1, 1, 1]
    came(s, [7], [5], 0.02)  # 4, 5, 6 only
    assert s.due(0.03, REORDER).tolist() == [4, 5, 6]


def test_a_retransmission_tells_those_asked_before_it_lost_again() -> None:
    s = PacketStream(np.zeros(8, dtype=bool))
    s.ask(np.array([1, 4]), 0.010)
    s.ask(np.array([2, 6]), 0.012)
    resent(s, [2], 0.015)  # the second NACK's answer: 1 and 4 (asked before) lost again
    assert s.due(0.015 + REORDER, REORDER).tolist() == [1, 4]
    # a sender resends nothing still queued there: only those sure to be resent
    s = PacketStream(np.zeros(8, dtype=bool))
    s.ask(np.array([1, 4, 6]), 0.010)
    mask = np.ones(8, dtype=bool)
    mask[1] = False
    resent(s, [6], 0.015, mask)
    assert s.due(1.0, REORDER).tolist() == [4]


def test_what_has_not_come_tells_nothing() -> None:
    """A NACK's answer that stops short is no loss yet: behind a congested
    port its rest may be queued far longer than any window."""
    s = PacketStream(np.zeros(8, dtype=bool))
    s.ask(np.array([1, 3, 5, 7]), 0.010)
    resent(s, [1], 0.014)
    resent(s, [3], 0.0141)
    assert s.next_due(REORDER) is None
    assert s.due(10.0, REORDER).size == 0
    resent(s, [7], 0.5)  # 5 asked before 7 in the same NACK: lost again
    assert s.due(0.6, REORDER).tolist() == [5]


def test_a_done_behind_the_packets_tells_every_missing_one_lost() -> None:
    s = PacketStream(np.zeros(6, dtype=bool))
    came(s, [0, 2], [1, 1], 0.0)
    s.ask(np.array([1]), 0.001)
    missing = ~s.received
    s.found(missing, 0.002)  # 1 was asked already: its repeat is the clock's
    assert s.due(0.01, REORDER).tolist() == [3, 4, 5]
    assert s.repeat_due(~s.received, 0.01, 0.005).tolist() == [1, 3, 4, 5]
    assert s.first_repeat(~s.received, 0.005) == -np.inf
