"""One sender's packets of one shard at their receiver: when each missing
packet was asked for, and which are known lost by what came after them.

A sender sends a shard's packets in index order, each in its class; the
classes are strict-priority queues, so a packet may be overtaken by later
ones of a higher class, never by later ones of its own class or a lower one.
A first transmission of packet k in class c that arrives therefore says that
every earlier packet whose class is at least as high as c was sent before it
and should be in: one that is not was lost, as TCP's RACK (RFC 8985) reads
a delivery. The receiver does not know a missing packet's class, only the
lowest it may have (its `bound`: LOWEST_REQUIRED_CLASS, as no required
gradient packet is in a lower one; the priority policy's lowest class for
the packet's layer, `PriorityPolicy.lowest`; for a result packet the
receiver's own class for it), so a packet is taken for lost once a later one
has come in its bound's class or a lower one (a number at least the bound).

Retransmissions all travel in one class (RETRANSMIT_CLASS), in the order
their NACKs asked for them: one that arrives says that every packet asked for
earlier (or earlier in the same NACK) whose retransmission is not in lost
that too. And the sender's DONE, which its outbox holds behind the shard's
packets, says every packet still missing is lost (`found`). What has not
come says nothing: behind a congested port a queue is worth far more than
any window.

A packet so found lost is asked for once `reorder` seconds have passed
since (paths of other delays, a queue's own reordering), instead of at the
sender's DONE plus `nack_delay`, or a NACK's repeat time: under loss a
round's legs no longer end with a NACK round trip per lost packet.

`PacketStream` owns its record of asks and of packets found lost; it reads
the owner's `received` mask (one sender's row), which the owner fills in
place, after each store calling `arrived`.
"""

from __future__ import annotations

import math

import numpy as np

from dlcp.core.timing import NackClock
from dlcp.errors import LocalError
from dlcp.policies.priority import GRADIENT_CLASSES, N_CLASSES

__all__ = ["LOWEST_REQUIRED_CLASS", "PacketStream"]

# a gradient packet that must arrive (not droppable) is never in a lower class;
# results travel in these classes too (records.LOWEST_RELIABLE_CLASS)
LOWEST_REQUIRED_CLASS = GRADIENT_CLASSES[-1]
_CLASSES = N_CLASSES


def pointers(aux: np.ndarray) -> np.ndarray:
    """The result indices an EARLY packet's `aux` points at (`dlcp.core.early`):
    (n, 2), the nearer one first; -1 where there is none."""
    a = np.asarray(aux, dtype=np.int64)
    return np.stack(((a & 0xFFFF) - 1, (a >> 16) - 1), axis=-1)


class PacketStream:
    """Asks and found losses of one sender's packets of one shard."""

    __slots__ = (
        "_levels",
        "any_asked",
        "asked",
        "asks",
        "bound",
        "pending",
        "reach",
        "received",
        "repeated",
        "rtx_mark",
        "suspect",
        "waiting_since",
    )

    def __init__(
        self, received: np.ndarray, bound: int | np.ndarray = LOWEST_REQUIRED_CLASS
    ) -> None:
        n = received.size
        self.received = received  # the owner's (read only here)
        # per packet, the lowest class (highest number) it may have been sent in
        b = np.asarray(bound)
        if b.ndim == 0:
            b = np.full(n, int(b), dtype=np.intp)
        elif b.shape != (n,) or (b.size and not 0 <= int(b.min()) <= int(b.max()) < _CLASSES):
            raise LocalError(f"class bounds of {n} packets in 0..{_CLASSES - 1}, not {b!r}")
        self.bound = b.astype(np.intp, copy=False)
        self._levels: list[int] = np.unique(self.bound).tolist()  # the classes bounds have
        self.asked = np.full(n, -math.inf)  # when each packet was last asked for
        self.asks = np.zeros(n, dtype=np.uint8)  # how often (saturating)
        # per class c, one past the highest packet whose first transmission
        # came in class c or a later one (a number at least c): every packet
        # below it whose bound is c or earlier was sent before it
        self.reach = np.zeros(_CLASSES, dtype=np.int64)
        # the (asked time, index) of the latest-asked retransmission that came
        self.rtx_mark: tuple[float, int] = (-math.inf, -1)
        # packets found lost and not yet asked for since: (when found, indices)
        self.pending: list[tuple[float, np.ndarray]] = []
        self.suspect = np.zeros(n, dtype=bool)
        self.any_asked = False  # whether any packet was ever asked for
        # when the oldest NACK since the sender's last answer went (None: none
        # waits), and whether one since asked again (no sample then: `ask`)
        self.waiting_since: float | None = None
        self.repeated = False

    # -- what came ----------------------------------------------------------
    def arrived(
        self,
        local: np.ndarray,
        classes: np.ndarray,
        rtx: np.ndarray | None,
        now: float,
        resent: np.ndarray | None = None,
        droppable: np.ndarray | None = None,
        silent: np.ndarray | None = None,
        aux: np.ndarray | None = None,
    ) -> float | None:
        """Packets `local` were stored (in `received` already), sent in
        `classes`; `rtx`: which were retransmissions (None: none); `resent`
        as `on_retransmits` takes it; `silent`: first transmissions whose
        place in the sender's order says nothing of others' (results sent
        early, `dlcp.core.early`; None: none), and `aux` each packet's header
        field, whose pointers the silent ones carry (`pointed`). Returns how
        long after its ask
        the latest first transmission came of a packet asked for (found lost
        but merely late), None where none was; of the packets of mask
        `droppable` none counts (sent in the lowest class, last, they are
        found lost early when the bound says nothing of them)."""
        pointed = None
        if silent is not None and aux is not None and silent.any():
            pointed = pointers(aux[silent]).reshape(-1)
        first, first_classes = local, classes
        if rtx is not None and rtx.any():
            first, first_classes = local[~rtx], classes[~rtx]
            self.on_retransmits(local[rtx], now, resent)
            if silent is not None:
                silent = silent[~rtx]
        late = None
        asked = self.asks[first] > 0
        if droppable is not None:
            asked &= ~droppable[first]
        if asked.any():
            late = now - float(self.asked[first[asked]].min())
        if silent is not None and silent.any():
            first, first_classes = first[~silent], first_classes[~silent]
        self.on_first(first, first_classes, now)
        if pointed is not None:
            self.pointed(pointed, now)
        return late

    def on_first(self, local: np.ndarray, classes: np.ndarray, now: float) -> None:
        """First transmissions of packets `local` came, in `classes` (stored
        in `received` already)."""
        if local.size == 0:
            return
        # `reach` is kept only at the classes some bound has (a few): a masked
        # maximum each, not a scatter over all eight (a third of a drain's time)
        old = self.reach
        grown: list[tuple[int, int]] = []
        lowest = int(classes.max())
        if lowest == int(classes.min()):  # one class (the outbox sends class by class)
            top = int(local.max()) + 1
            grown = [(c, top) for c in self._levels if c <= lowest and top > old[c]]
        else:
            for c in self._levels:
                at = classes >= c
                if at.any():
                    top = int(local[at].max()) + 1
                    if top > old[c]:
                        grown.append((c, top))
        if not grown:
            return
        new = old.copy()
        for c, top in grown:
            new[: c + 1] = np.maximum(new[: c + 1], top)
        lo, hi = min(int(old[c]) for c, _ in grown), max(top for _, top in grown)
        self.reach = new
        lost = ~self.received[lo:hi]
        if not lost.any():  # the common case: all in
            return
        b = self.bound[lo:hi]
        idx = np.arange(lo, hi)
        lost &= (idx < new[b]) & (idx >= old[b])
        lost &= ~self.suspect[lo:hi] & (self.asks[lo:hi] == 0)
        if lost.any():
            self._found(np.flatnonzero(lost) + lo, now)

    def set_bound(self, bound: np.ndarray, now: float) -> None:
        """Per packet, a lower class bound learnt (the receiver's own round
        began): what came before says more packets are lost."""
        if bound.shape != self.bound.shape:
            raise LocalError(f"class bounds of {self.bound.size} packets, not {bound.shape}")
        self.bound = np.minimum(self.bound, bound).astype(np.intp, copy=False)
        self._levels = np.unique(self.bound).tolist()
        idx = np.arange(self.bound.size)
        lost = (idx < self.reach[self.bound]) & ~self.received & ~self.suspect & (self.asks == 0)
        if lost.any():
            self._found(np.flatnonzero(lost), now)

    def found(self, missing: np.ndarray, now: float) -> None:
        """The packets of mask `missing` not yet asked for are known lost now
        (their sender's DONE came behind them)."""
        lost = missing & ~self.suspect & (self.asks == 0)
        if lost.any():
            self._found(np.flatnonzero(lost), now)

    def pointed(self, idx: np.ndarray, now: float) -> None:
        """Packets `idx` were queued before one that came, in its class (an
        EARLY result's pointers, `dlcp.core.early`; -1: none): those missing,
        not yet found lost nor asked for, are found lost now."""
        idx = idx[(idx >= 0) & (idx < self.received.size)]
        lost = idx[~self.received[idx] & ~self.suspect[idx] & (self.asks[idx] == 0)]
        if lost.size:
            self._found(np.unique(lost), now)

    def on_retransmits(
        self, local: np.ndarray, now: float, resent: np.ndarray | None = None
    ) -> None:
        """Retransmissions of packets `local` came (stored in `received`
        already): what was asked for before them and is still missing is
        lost again, of the packets of mask `resent` (None: all), those whose
        asks were sure to be resent. A sender resends no packet still queued
        there (its first transmission is on its way), and a droppable packet,
        sent last in a class of its own, may be queued still when a later
        packet of a higher class came and had it asked for."""
        if local.size == 0:
            return
        asked = self.asked[local]
        last = int(np.lexsort((local, asked))[-1])
        mark = (float(asked[last]), int(local[last]))
        if mark <= self.rtx_mark or mark[0] == -math.inf:
            return
        self.rtx_mark = mark
        t, k = mark
        idx = np.arange(self.asked.size)
        before = (self.asked < t) | ((self.asked == t) & (idx < k))
        lost = ~self.received & ~self.suspect & (self.asks > 0) & before
        if resent is not None:
            lost &= resent
        if lost.any():
            self._found(np.flatnonzero(lost), now)

    def _found(self, idx: np.ndarray, now: float) -> None:
        self.suspect[idx] = True
        self.pending.append((now, idx))

    # -- what to ask for ----------------------------------------------------
    def due(self, now: float, reorder: float) -> np.ndarray:
        """The packets found lost at least `reorder` ago and still missing,
        no longer pending (the caller asks for them or drops them).

        Nothing is taken for lost by what has not come (a NACK's answer that
        stops short, say): behind a congested port the queue is worth far
        more than any window, and asking again fed a retransmission storm."""
        out: list[np.ndarray] = []
        while self.pending and self.pending[0][0] + reorder <= now:
            _, idx = self.pending.pop(0)
            out.append(idx)
        if not out:
            return np.zeros(0, dtype=np.int64)
        idx = np.concatenate(out) if len(out) > 1 else out[0]
        self.suspect[idx] = False
        return idx[~self.received[idx]]

    def next_due(self, reorder: float) -> float | None:
        """When `due` next has packets to give (None: none pending)."""
        return self.pending[0][0] + reorder if self.pending else None

    def ask(self, idx: np.ndarray, now: float) -> bool:
        """Packets `idx` were asked for at `now` (none: the DONE alone).
        Returns whether the NACK asked again: for a packet asked for before,
        or for the DONE alone. The first retransmission after it times the
        sender's answer (`answered`) unless a NACK since the last answer asked
        again (Karn's rule is for a packet asked for twice; NACKs for packets
        newly found lost are no ambiguity)."""
        again = not idx.size or bool(self.asks[idx].any())
        if self.waiting_since is None:
            self.waiting_since = now
        self.repeated |= again
        self.any_asked |= bool(idx.size)
        self.asked[idx] = now
        self.asks[idx] = np.minimum(self.asks[idx].astype(np.int64) + 1, 255)
        self.suspect[idx] = False
        return again

    def answered(self, clock: NackClock | None, now: float) -> None:
        """A retransmission came: the answer to the NACKs sent since the last.
        A sender answers its NACKs in order (its retransmissions share one
        queue), so it answers the oldest: its time is a sample for `clock`
        unless a NACK since asked again."""
        if self.waiting_since is not None and not self.repeated and clock is not None:
            clock.sample(now - self.waiting_since)
        self.waiting_since, self.repeated = None, False

    def repeat_due(self, missing: np.ndarray, now: float, wait: float) -> np.ndarray:
        """Of the packet mask `missing`, those never asked for or asked
        `wait` or more ago (indices)."""
        return np.flatnonzero(missing & (self.asked + wait <= now))

    def first_repeat(self, missing: np.ndarray, wait: float) -> float:
        """When the first packet of mask `missing` may be asked for again
        (-inf: one never asked for)."""
        return float(self.asked[missing].min(initial=math.inf)) + wait
