"""Per-destination send queues: operations in the order they came, paced per path, sprayed.

The engine hands datagrams with a priority class; they wait here per peer in
one FIFO per class (a class is also the packet's DSCP, and one send call
carries one class). `flush` serves first what was queued first: each push of
a shard's first transmission is one step of the peer's order, and the class
whose oldest packet belongs to the oldest step goes next (within a step, the
highest class first). Control packets, DONEs and retransmissions are urgent:
they go before every step. So a host sends a shard's data, droppable packets
and DONE before the results it queued later, whatever their classes: the
other hosts' aggregations, which wait for that DONE, never wait behind this
host's results (a strict priority by class let results of class 1 overtake
droppable data of class 7 and its DONE, and the other hosts' rounds waited
for this host's whole result leg). The switches still serve the classes
strictly by DSCP. `flush` sends in GSO-sized
batches, choosing a path per packet with the load balancer among the paths
whose pacer has budget; each (peer, path) has its own rate controller and
pacer, cut by the losses NACKs charge to that path. What the pacers or a full
socket hold back waits for the next `flush` (the daemon calls it again at
`next_wake`, or when the socket is writable). This module queues; `flush` and
the rest of sending are `dlcp.daemon.sending`'s, a peer `dlcp.daemon.peer`'s.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from dlcp.core.pathhealth import HealthConfig
from dlcp.core.rate import RateConfig
from dlcp.daemon.packet_keys import (
    _BKEY,
    _DATA,
    _DONE,
    _DR,
    _RESULT,
    _barrier_key,
    _by_class,
    _clamped_classes,
    _identity,
    _not_repeats,
    _shard_keys,
)
from dlcp.daemon.pathloss import charge_nack
from dlcp.daemon.peer import (
    _F_RETRANSMIT,
    _NOT_DR_TABLE,
    FRONT,
    N_CLASSES,
    SHARDS_TRACKED,
    Peer,
    _append,
    _left,
    _next_queue,
    _took,
    _urgent,
    _watch,
    new_peer,
)
from dlcp.daemon.sending import Sending
from dlcp.daemon.transport import UdpPath
from dlcp.errors import LocalError
from dlcp.wire.header import Flags, Header

__all__ = ["Outbox", "Peer"]


_F_DROPPABLE = int(Flags.DROPPABLE)


# bytes.translate tables over type and flags bytes
_DROPPABLE_TABLE = bytes(f & _F_DROPPABLE for f in range(256))
_RETRANSMIT_TABLE = bytes(1 if f & _F_RETRANSMIT else 0 for f in range(256))
_MIN_RUN = 4  # shorter runs of DATA/RESULT packets are queued one by one


class Outbox:
    """The send queues of every peer; `sending` flushes them."""

    def __init__(
        self,
        paths: Sequence[UdpPath],
        *,
        dscp: Sequence[int],
        rate: RateConfig,
        pacing: bool,
        balancer_factory: object,
        window_bytes: int = 0,
        health: HealthConfig | None = None,
    ) -> None:
        """`window_bytes`: each peer's flow-control window (0: none; see
        flow.CREDIT_TIMEOUT); `health`: probe the paths of peers with two or more
        (None: never, every path stays in use)."""
        self.health = health
        self.paths = paths
        self.window_bytes = window_bytes
        self.rate_config = rate
        self.pacing = pacing
        self._balancer_factory = balancer_factory
        self.peers: dict[tuple[tuple[str, ...], int], Peer] = {}
        self.multipath: list[Peer] = []  # the peers whose paths are probed (`Peer.health`)
        self._backlog: set[Peer] = set()  # the peers with datagrams queued
        self.repeats = 0
        self._step = 0  # the last step given to a shard and leg (see `Peer.steps`)
        self.loss_interval = 0.05  # at most one rate cut per path in this many seconds
        self.sending = Sending(
            backlog=self._backlog, tos=[int(d) << 2 for d in dscp], push=self.push
        )
        self.flush = self.sending.flush  # the sending half's, without a hop a call
        self.path_down = self.sending.path_down
        self.on_credit = self.sending.on_credit
        self.on_loss = self.sending.on_loss

    # -- the sending half's state, by the names the daemon and tests read -----
    @property
    def backlog(self) -> set[Peer]:
        return self._backlog

    @backlog.setter
    def backlog(self, peers: set[Peer]) -> None:  # a simulation's own set
        self._backlog = self.sending.backlog = peers

    @property
    def blocked(self) -> bool:
        return self.sending.blocked

    @blocked.setter
    def blocked(self, blocked: bool) -> None:  # the socket is writable again
        self.sending.blocked = blocked

    @property
    def next_wake(self) -> float | None:
        return self.sending.next_wake

    @property
    def tos(self) -> list[int]:
        return self.sending.tos

    @tos.setter
    def tos(self, tos: list[int]) -> None:  # a reload's DSCP table
        self.sending.tos = tos

    @property
    def credits(self) -> int:
        return self.sending.credits

    @property
    def resent_on_down(self) -> int:
        return self.sending.resent_on_down

    def peer(self, addresses: tuple[str, ...], port: int, now: float) -> Peer:
        """The peer at `addresses`:`port`, made on first use (`peer.new_peer`)."""
        key = (addresses, port)
        p = self.peers.get(key)
        if p is None:
            p = new_peer(
                addresses,
                port,
                self.paths,
                self.rate_config,
                pacing=self.pacing,
                balancer=self._balancer_factory(),  # type: ignore[operator]
                window_bytes=self.window_bytes,
                health=self.health,
                loss_interval=self.loss_interval,
                now=now,
            )
            if p.health is not None:
                self.multipath.append(p)
            self.peers[key] = p
        return p

    def set_balancer_factory(self, factory: object) -> None:
        self._balancer_factory = factory
        for p in self.peers.values():
            p.balancer = factory()  # type: ignore[operator]

    def push(self, peer: Peer, datagram: bytes, priority: int) -> bool:
        """Queue a datagram; False when the same bytes are already waiting (a repeat).

        A DONE is never a repeat: the engine sends each one twice, as insurance
        against losing it (and again when a receiver asks), and every copy goes.
        """
        if datagram[3] != _DONE:
            key = _identity(datagram)
            if datagram[3] in _DR and key[:_BKEY] not in peer.watched:
                _watch(peer, key[:_BKEY])
            if key in peer.pending:
                self.repeats += 1
                return False
            peer.pending.add(key)
        peer.queued += 1
        self._backlog.add(peer)
        self._queue(peer, datagram, min(max(priority, 0), N_CLASSES - 1))
        return True

    def _step_for(self, peer: Peer, bkey: bytes) -> int:
        """Shard and leg `bkey`'s step: the next one when none of it is queued."""
        step = peer.step_of.get(bkey)
        if step is None:
            self._step += 1
            step = peer.step_of[bkey] = self._step
        return step

    def _queue(self, peer: Peer, datagram: bytes, cls: int) -> None:
        """Put a datagram that is not a repeat (already in `pending` and `queued`)
        in class `cls`'s queue, or hold it (a DONE behind its shard)."""
        kind = datagram[3]
        if kind == _DONE:
            # A DONE says "all my packets of this shard are out". It waits here
            # until they have left, and then travels in the class of the last of
            # them, so neither our queues nor the switch's let it overtake them
            # (the receiver would NACK packets that are merely queued). So does
            # a DONE sent again (asked for by the receiver): a receiver takes
            # the packets still missing when a DONE comes for lost
            # (`dlcp.core.stream`), and one in the control class that overtook
            # its shard's packets queued at a congested switch port had the
            # whole shard asked for again and again.
            bkey = _barrier_key(datagram)
            if peer.inflight.get(bkey):
                peer.held.setdefault(bkey, []).append((datagram, cls))
            else:
                cls = peer.trail_class.get(bkey, cls)
                peer.queues[FRONT + cls].append(datagram)
            return
        if kind in (_DATA, _RESULT):
            bkey = _barrier_key(datagram)
            peer.inflight[bkey] += 1
            droppable = datagram[4] & _F_DROPPABLE
            if not droppable and cls < N_CLASSES - 1 and cls > peer.trail_class.get(bkey, -1):
                trail = peer.trail_class
                if bkey not in trail and len(trail) >= SHARDS_TRACKED:
                    for old in list(trail)[: len(trail) // 2]:  # the oldest shards
                        del trail[old]
                trail[bkey] = cls
        if _urgent(datagram):
            peer.queues[FRONT + cls].append(datagram)
        else:
            peer.queues[cls].append(datagram)
            _append(peer, cls, 1, self._step_for(peer, _barrier_key(datagram)))

    def push_many(self, peer: Peer, datagrams: Sequence[bytes], priorities: Sequence[int]) -> int:
        """Queue `datagrams` (with their `priorities`) in order, exactly as `push`
        one after the other would; returns how many were queued (the rest were
        repeats). The per-packet bookkeeping is done in bulk where it can be: a
        run of DATA/RESULT packets of one class (the bulk of a shard) costs a
        few list comprehensions and C-level Counter/deque operations, and a
        batch that cannot repeat a packet (a shard's first send) keeps no
        identity apiece (see `Peer.pending`)."""
        n = len(datagrams)
        if n != len(priorities):
            raise LocalError(f"{n} datagrams but {len(priorities)} priorities")
        if n < 2:
            return self._push_each(peer, datagrams, priorities)
        heads, bkeys, distinct = _shard_keys(datagrams)  # heads: type and flags bytes
        types = heads[0::2]
        watched, inflight = peer.watched, peer.inflight
        checked = False  # whether the packets other than DATA/RESULT/DONE were looked up
        if distinct is None or any(  # two of its DATA/RESULT packets may be the same
            b in watched or inflight.get(b) for b in distinct
        ):
            # a repeat is possible: every shard and leg of the batch is watched,
            # and the identities of all but the DONEs are looked up
            for b in distinct if distinct is not None else dict.fromkeys(bkeys):
                if b is not None and b not in watched:
                    _watch(peer, b)
            kept, repeats = _not_repeats(peer.pending, datagrams, types)
            self.repeats += repeats
            checked = True
            if kept is not None:
                if not kept:
                    return 0
                n = len(kept)
                datagrams = [datagrams[k] for k in kept]
                priorities = [priorities[k] for k in kept]
                bkeys = [bkeys[k] for k in kept]
                heads = b"".join([heads[2 * k : 2 * k + 2] for k in kept])
        # else none of its DATA/RESULT packets can be a repeat: a run of
        # increasing offsets per shard and leg, none of them queued (or
        # watched); its other packets (DONEs, never repeats, and the odd ACK or
        # NACK, looked up one by one below) come between them
        peer.queued += n
        self._backlog.add(peer)
        # one pass (in C): whether all are one class, and each into range
        priorities, uniform = _clamped_classes(
            priorities if isinstance(priorities, list) else list(priorities), N_CLASSES
        )
        flags = heads[1::2]
        others = heads[0::2].translate(_NOT_DR_TABLE)  # 1 where not DATA/RESULT
        # runs of DATA/RESULT packets between the others, in order: each of the
        # others sees what the packets before it left (a DONE is held by them)
        start = 0
        queued = n
        while start < n:
            stop = others.find(1, start)
            if stop < 0:
                stop = n
            if stop - start >= _MIN_RUN:
                self._queue_run(
                    peer,
                    datagrams[start:stop],
                    bkeys[start:stop],  # all DATA/RESULT: no None
                    priorities[start:stop],
                    flags[start:stop],
                    uniform,
                )
            else:
                for i in range(start, stop):
                    self._queue(peer, datagrams[i], priorities[i])
            if stop < n:
                dg = datagrams[stop]
                if checked or dg[3] == _DONE or self._not_pending(peer, dg):
                    self._queue(peer, dg, priorities[stop])
                else:  # a repeat of an ACK or NACK still queued
                    peer.queued -= 1
                    queued -= 1
            start = stop + 1
        return queued

    def _not_pending(self, peer: Peer, datagram: bytes) -> bool:
        """`push`'s look-up for a packet other than DATA/RESULT/DONE: False
        (counted) when it is queued already, else its identity is kept."""
        key = _identity(datagram)
        if key in peer.pending:
            self.repeats += 1
            return False
        peer.pending.add(key)
        return True

    def _push_each(self, peer: Peer, datagrams: Sequence[bytes], priorities: Sequence[int]) -> int:
        push = self.push
        k = 0
        for dg, priority in zip(datagrams, priorities, strict=True):
            if push(peer, dg, priority):
                k += 1
        return k

    def _queue_run(
        self,
        peer: Peer,
        dgs: Sequence[bytes],
        bkeys: list[bytes],
        classes: Sequence[int],
        flags: bytes,
        uniform: bool = False,
    ) -> None:
        """`_queue` for each of `dgs`, DATA/RESULT packets (with their barrier
        keys, classes and flags bytes) that are not repeats, in bulk: same
        queues, barriers, trail, steps. `uniform`: the classes are known to be
        one."""
        n = len(dgs)
        head = bkeys[0]
        inflight = peer.inflight
        distinct: Iterable[bytes]  # in order of first appearance
        one = bkeys.count(head) == n  # one shard and leg (the usual run)
        if one:
            inflight[head] += n
            distinct = (head,)
        else:
            counts = Counter(bkeys)
            for bkey, k in counts.items():
                inflight[bkey] += k
            distinct = counts
        cls0 = classes[0]
        uniform = uniform or classes.count(cls0) == n
        # the trail class of each shard: the highest class of its non-droppable
        # packets below the droppable class (in order of first appearance)
        drop = flags.translate(_DROPPABLE_TABLE)
        split: list[list[bytes] | None] | None = None  # each class's packets, where they differ
        want: dict[bytes, int]
        if uniform and 1 not in drop:
            want = dict.fromkeys(distinct, cls0) if cls0 < N_CLASSES - 1 else {}
        elif uniform and one:  # some droppable: the class, if any packet is not
            want = {head: cls0} if cls0 < N_CLASSES - 1 and 0 in drop else {}
        elif one:  # in C: no Python step a packet
            split, top = _by_class(dgs, classes, drop, N_CLASSES)
            want = {head: top} if top >= 0 else {}
        else:
            want = {}
            for bkey, cls, d in zip(bkeys, classes, drop, strict=True):
                if not d and cls < N_CLASSES - 1 and cls > want.get(bkey, -1):
                    want[bkey] = cls
        trail = peer.trail_class
        if len(trail) + len(want) <= SHARDS_TRACKED:  # no eviction: same as one by one
            for bkey, cls in want.items():
                if cls > trail.get(bkey, -1):
                    trail[bkey] = cls
        else:  # the oldest shards are forgotten on the way: one by one
            for bkey, cls, d in zip(bkeys, classes, drop, strict=True):
                if not d and cls < N_CLASSES - 1 and cls > trail.get(bkey, -1):
                    if bkey not in trail and len(trail) >= SHARDS_TRACKED:
                        for old in list(trail)[: len(trail) // 2]:
                            del trail[old]
                    trail[bkey] = cls
        resent = flags.translate(_RETRANSMIT_TABLE)
        if not one or 0 < resent.count(1) < n:
            # each shard and leg's first transmissions or retransmissions on
            # their own (one run of each, usually)
            start = 0
            for stop in range(1, n + 1):
                if stop == n or bkeys[stop] is not bkeys[start] or resent[stop] != resent[start]:
                    self._place(peer, dgs[start:stop], bkeys[start], classes[start:stop], None)
                    start = stop
            return
        if not uniform and split is None:
            split = _by_class(dgs, classes, drop, N_CLASSES)[0]
        self._place(peer, dgs, head, classes, split)

    def _place(
        self,
        peer: Peer,
        dgs: Sequence[bytes],
        bkey: bytes,
        classes: Sequence[int],
        split: list[list[bytes] | None] | None,
    ) -> None:
        """Append DATA/RESULT packets of shard and leg `bkey`, all first
        transmissions or all retransmissions, to their classes' queues (`split`:
        each class's of them, when known and the classes are not all one)."""
        urgent = bool(dgs[0][4] & _F_RETRANSMIT)
        at = FRONT if urgent else 0
        step = 0 if urgent else self._step_for(peer, bkey)
        cls0 = classes[0]
        if split is None and classes.count(cls0) == len(dgs):
            peer.queues[at + cls0].extend(dgs)
            if step:
                _append(peer, cls0, len(dgs), step)
            return
        if split is None:
            split = _by_class(dgs, classes, bytes(len(dgs)), N_CLASSES)[0]
        for cls, part in enumerate(split):
            if part is not None:
                peer.queues[at + cls].extend(part)
                if step:
                    _append(peer, cls, len(part), step)

    def drop_head(self) -> None:
        """After a send error: drop the first datagram of the class every
        backlogged peer sends next (the one that failed), so the queue moves on."""
        for peer in list(self._backlog):
            i = _next_queue(peer)
            if i >= 0:
                dg = peer.queues[i].popleft()
                if i < FRONT:
                    _took(peer, i, 1)
                peer.pending.discard(_identity(dg))
                peer.queued -= 1
                _left(peer, dg)
            if peer.queued == 0:
                self._backlog.discard(peer)

    def on_nack(
        self,
        peer: Peer,
        nack: Header,
        datagram: bytes | memoryview,
        *,
        shards: int,
        payload: int,
        now: float,
        ranks: int = 0,
    ) -> None:
        """Charge the losses an accepted NACK names to the paths they went on
        (`pathloss.charge_nack`)."""
        charge_nack(peer, nack, datagram, shards=shards, payload=payload, now=now, ranks=ranks)

    def queued(self) -> int:
        return sum(p.queued for p in self.peers.values())
