"""The daemon's network receive path: drains a path's socket, hands the drain's
datagrams to the engine in one call, and acts on the control packets it
accepted (NACKs, credits, probes).

`NetworkIn` is given its collaborators (the engine, the daemon's paths and
jobs, the outbox, the prober, the counters) and the daemon's callbacks: its
clock, `pump` (the engine's output out), `credit` (`Credits.send`) and
`watch` (the sockets watched by the event loop, or not). It owns receive
moderation (`moderate`): while a drain finds work, the sockets are polled
on a timer instead of watched.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dlcp.core.engine import Engine, credit_of
from dlcp.daemon.flow import CREDIT_STEP
from dlcp.daemon.jobs import JobState
from dlcp.daemon.outbox import Outbox, Peer
from dlcp.daemon.poll import NATIVE_POLL, take
from dlcp.daemon.probing import Prober
from dlcp.daemon.transport import Split, UdpPath
from dlcp.wire.batch import _bulk
from dlcp.wire.header import HEADER_SIZE, PacketType, header_of_valid
from dlcp.wire.probe import probe_of

__all__ = ["MODERATION_BYTES", "NetworkIn"]

log = logging.getLogger("dlcpd")

_DATA = int(PacketType.DATA)  # the type byte (3) of a datagram
_DATA_BYTE = bytes([_DATA])
_RESULT_BYTE = bytes([PacketType.RESULT])
_NACK_BYTE = bytes([PacketType.NACK])
_CONTROL_BYTE = bytes([PacketType.CONTROL])
_NACK = int(PacketType.NACK)
_CONTROL = int(PacketType.CONTROL)
_ACKING = np.zeros(256, dtype=bool)  # by type byte: the packets that acknowledge their peer
_ACKING[[PacketType.RESULT, PacketType.ACK, PacketType.DONE]] = True
_NONE = slice(0, 0)  # selects nothing (of a kind not present)
# GRO buffers taken per readable event (by recvmmsg) before yielding to the
# loop: a drain of up to 4 MB (64 GRO buffers of 64 KB), whose buffers are
# still in cache when the MAC and the sums read them after the last is taken.
# With 256 (16 MB) they were not: each daemon spent about 10 % more CPU a
# round (BENCHMARKS.md, round 25).
_RX_BUDGET = 64
# ... while the outbox has datagrams to send: 16 GRO buffers of 64 KB, one
# send call's worth when a call sent up to 1 MB. Calls now send up to 4 MB,
# but 64 buffers did no better (ratio 0.89 against 0.93, 8 alternated pairs;
# BENCHMARKS.md, round 32). Draining 16 MB of arrivals per 1 MB sent let the
# daemon that received more fall behind in sending, so that its peer sat idle
# at the end of the data leg, waiting for the rest of its shard.
_RX_SENDING = 16
_RX_SENDING_BYTES = 1_000_000  # ... taken again while a drain is smaller (16 GRO buffers are more)
# A poll that takes this much or more comes back at once (`take_from`): the
# link brings more than a batch per poll interval (1 Gbit/s and faster), and
# waiting would leave it idle with data queued rather than save wake-ups.
MODERATION_BYTES = 256 * 1024


def _join(parts: list[Sequence[memoryview]]) -> Sequence[memoryview]:
    """A drain's datagrams, in order: one `Datagrams` (no object per datagram)
    when the C split made every part, else a list."""
    if _bulk is not None and all(type(p) is _bulk.Datagrams for p in parts):
        return _bulk.join(parts)
    return [dg for p in parts for dg in p]


class NetworkIn:
    """The receive half of the daemon: socket drains to `Engine.receive_many`."""

    def __init__(
        self,
        *,
        engine: Engine,
        paths: Sequence[UdpPath],
        jobs: dict[int, JobState],
        outbox: Outbox,
        prober: Prober,
        counters: Counter[str],
        daemon_rejects: Counter[str],
        moderation_s: float,
        clock: Callable[[], float],
        pump: Callable[[], None],
        credit: Callable[[Peer, JobState], None],
        watch: Callable[[bool], None],
    ) -> None:
        self.engine = engine
        self.paths = paths  # the daemon's list (its sockets)
        self.jobs = jobs  # read only: the round lifecycle keeps it
        self.outbox = outbox
        self.prober = prober
        self.counters = counters
        self.daemon_rejects = daemon_rejects
        self._clock = clock
        self._pump = pump
        self._credit = credit
        self._watch = watch
        # receive moderation (`moderate`): while busy, the sockets are not
        # watched and a poll comes every `moderation` seconds, the next at `poll_at`
        self.moderation = moderation_s
        self.polling = False
        self.poll_at = 0.0
        # a drain as one C call and Python per source and job (dlcp.daemon.poll),
        # not per buffer; DLCP_NATIVE_POLL=0: the per-buffer loop below
        self.native_poll = NATIVE_POLL

    @property
    def now(self) -> float:
        return self._clock()

    def on_readable(self, path: UdpPath) -> None:
        self.counters["wakeups_readable"] += 1
        _, full = self.take_from((path,))
        if self.moderation > 0:
            self.moderate(True, full, self.now)
        self._pump()

    def take_from(self, paths: Sequence[UdpPath]) -> tuple[int, bool]:
        """`_receive` on each of `paths`: the bytes taken, and whether there is
        likely more (a drain took its whole budget, or MODERATION_BYTES: the
        link is fast enough that a poll interval holds more than one batch)."""
        before = self.counters["rx_bytes"]
        full = False
        for path in paths:
            full = self._receive(path) or full
        taken = self.counters["rx_bytes"] - before
        return taken, full or taken >= MODERATION_BYTES

    def _splits(self, path: UdpPath) -> tuple[list[Split], bool]:
        """One drain of `path`'s socket, and whether it stopped at its budget:
        up to _RX_BUDGET buffers, or while the outbox has datagrams to send
        _RX_SENDING buffers at a time up to _RX_SENDING_BYTES (behind a shaped
        port a buffer is one datagram: 16 of them are 24 KB, and a poll's
        arrivals took three drains and pumps)."""
        if not self.outbox.backlog:
            calls = path.recvmsg_calls
            out = path.receive_split(_RX_BUDGET)
            return out, path.recvmsg_calls - calls >= _RX_BUDGET
        out = []
        taken = 0
        while True:
            calls = path.recvmsg_calls
            got = path.receive_split(_RX_SENDING)
            out += got
            if path.recvmsg_calls - calls < _RX_SENDING:
                return out, False
            taken += sum(split[1] for split in got)
            if taken >= _RX_SENDING_BYTES:
                return out, True

    def moderate(self, busy: bool, full: bool, now: float) -> None:
        """Interrupt moderation: after a wake-up that found work the daemon
        stops watching its sockets and polls them every `moderation` seconds
        (at once when a drain took its whole budget), taking what arrived
        meanwhile in one drain and sending what the pacers earned in one
        flush; a poll that finds nothing to take or send goes back to
        watching the sockets."""
        if busy:
            if not self.polling:
                self.polling = True
                self._watch(False)
            self.poll_at = now if full else now + self.moderation
        elif self.polling:
            self.polling = False
            self._watch(True)

    def _receive(self, path: UdpPath) -> bool:
        """Take what waits on `path`'s socket: each recvmsg buffer (a GRO
        super-datagram: one source, one segment size) is split and its job and
        node looked up once when all its datagrams name one job; the engine
        takes the whole drain at once; then the accepted control packets (NACKs,
        and the bytes that acknowledge each peer) are acted on. True when
        the drain stopped at its budget (more may wait)."""
        now = self.now
        if self.native_poll:
            if self.outbox.backlog:
                drain = path.receive_drain(_RX_SENDING, _RX_SENDING_BYTES)
            else:
                drain = path.receive_drain(_RX_BUDGET, 0)
            if drain is not None:
                take(self, drain, now)
                return bool(drain[8])
        jobs = self.jobs
        rx = 0
        rx_bytes = 0
        parts: list[Sequence[memoryview]] = []  # runs of the drain's datagrams, in order
        kinds: list[bytes] = []  # the type byte of each of `dgs` (b"\0" for a truncated one)
        groups: list[tuple[JobState | None, int | None]] = []  # (job, node) of a run of `dgs`
        runs: list[int] = []  # datagrams of each group
        sizes: list[int] = []  # bytes of each group's datagrams but its last (all one size)
        lasts: list[int] = []  # bytes of each group's last datagram
        # per buffer (transport.Split): its datagrams, bytes, how many have a
        # whole header (all but a shorter last one, or none), their job (a list
        # when they name more than one) and type bytes, the source
        senders: dict[Peer, JobState] = {}  # the peers the buffers came from (a job of each)
        splits, more = self._splits(path)
        for segs, size, full, ids, types, src in splits:
            k = len(segs)
            rx += k
            rx_bytes += size
            if full:
                if isinstance(ids, list):  # more than one job: datagram by datagram
                    self._receive_mixed(
                        segs, ids, src, parts, kinds, groups, runs, sizes, lasts, senders
                    )
                    continue
                job = jobs.get(ids)
                node = None
                if job is not None:
                    node = job.node_of.get(src)
                    if node is None:
                        self.daemon_rejects["bad_address"] += full
                    else:
                        peer = job.peers.get(node)
                        if peer is not None:  # its bytes but a truncated last one's
                            peer.rx_bytes += size if full == k else size - len(segs[-1])
                            senders[peer] = job
                if job is None or node is not None:
                    seg = len(segs[0])
                    parts.append(segs if full == k else segs[:full])
                    kinds.append(types)
                    groups.append((job, node))
                    runs.append(full)
                    sizes.append(seg)
                    lasts.append(len(segs[-1]) if full == k else seg)
            if full < k:  # truncated datagrams: the engine counts them
                tail = segs[full:]
                parts.append(tail)
                for dg in tail:
                    kinds.append(b"\0")
                    groups.append((None, None))
                    runs.append(1)
                    sizes.append(len(dg))
                    lasts.append(len(dg))
        self.counters["rx_packets"] += rx  # all of them, those rejected here too
        self.counters["rx_bytes"] += rx_bytes
        for peer, job in senders.items():  # their bytes left the socket: room for more
            peer.rx_job = job.spec.job
            if peer.health is not None:
                peer.health.touch(now)
            if peer.rx_bytes - peer.rx_credited >= CREDIT_STEP:
                self._credit(peer, job)
        if not parts:
            return more
        dgs = _join(parts)
        # each datagram's source node (-1: none), made per group, not per datagram
        if len(groups) == 1:  # the usual drain: one run of one peer
            node = groups[0][1]
            nodes = np.full(runs[0], -1 if node is None else node, np.int64)
        else:
            nodes = np.repeat(
                np.array([-1 if g[1] is None else g[1] for g in groups], np.int64), runs
            )
        accepted = self.engine.receive_many(dgs, now, nodes)
        types = b"".join(kinds)
        if not accepted.size or not types.strip(_DATA_BYTE):  # none, or all data
            return more
        kind = np.frombuffer(types, np.uint8)[accepted]
        if _DATA_BYTE not in types:  # no data (a drain of results): all go on
            self._on_control(accepted, kind, dgs, groups, runs, sizes, lasts, now)
            return more
        control = kind != _DATA
        if control.any():
            self._on_control(accepted[control], kind[control], dgs, groups, runs, sizes, lasts, now)
        return more

    def _receive_mixed(
        self,
        segs: Sequence[memoryview],
        ids: list[int],
        src: str,
        parts: list[Sequence[memoryview]],
        kinds: list[bytes],
        groups: list[tuple[JobState | None, int | None]],
        runs: list[int],
        sizes: list[int],
        lasts: list[int],
        senders: dict[Peer, JobState],
    ) -> None:
        """`_receive` for a buffer whose datagrams name more than one job."""
        jobs = self.jobs
        for i, dg in enumerate(segs):
            job = node = None
            if i < len(ids):
                job = jobs.get(ids[i])
                if job is not None:
                    node = job.node_of.get(src)
                    if node is None:
                        self.daemon_rejects["bad_address"] += 1
                        continue
                    peer = job.peers.get(node)
                    if peer is not None:
                        peer.rx_bytes += len(dg)
                        senders[peer] = job
            parts.append(segs[i : i + 1])
            kinds.append(bytes(dg[3:4]) if i < len(ids) else b"\0")
            groups.append((job, node))
            runs.append(1)
            sizes.append(len(dg))
            lasts.append(len(dg))

    def on_nack(self, peer: Peer, job: JobState, dg: Any, now: float) -> None:
        """An accepted NACK from `peer` of `job`: its lost packets counted, the
        packets it names queued again."""
        h = header_of_valid(dg)
        if h.count:  # a NACK that only asks for the DONE names no lost packet
            self.outbox.on_loss(peer, h.count, now)
        spec = job.spec
        self.outbox.on_nack(
            peer, h, dg, shards=len(spec.owners), payload=spec.payload, now=now, ranks=spec.ranks
        )

    def on_control(self, peer: Peer, job: JobState, dg: Any, now: float) -> None:
        """An accepted CONTROL packet from `peer` of `job`: a credit to the
        outbox, a probe or its echo to the prober, anything else ignored."""
        payload = dg[HEADER_SIZE:]
        got = credit_of(payload)
        if got is not None:
            self.outbox.on_credit(peer, got.received, got.epoch, got.drained, got.window, now=now)
        elif (probe := probe_of(payload)) is not None:
            self.prober.on_probe(peer, job.spec.job, probe, now)

    def _on_control(
        self,
        positions: np.ndarray,
        kind: np.ndarray,
        dgs: Sequence[memoryview],
        groups: list[tuple[JobState | None, int | None]],
        runs: list[int],
        sizes: list[int],
        lasts: list[int],
        now: float,
    ) -> None:
        """Accepted packets other than data, at `positions` of `dgs` (in groups
        of `runs` datagrams, each of `sizes` bytes but the group's last, of
        `lasts`): each NACK in order, then per peer the bytes of its results,
        ACKs and DONEs."""
        one = len(groups) == 1  # the usual drain: one run of one peer
        if one:
            group = np.zeros(positions.size, np.intp)
        else:
            group = np.repeat(np.arange(len(groups)), runs)[positions]
        types = kind.tobytes()  # the kinds present, found without an array per kind
        nack = kind == _NACK if _NACK_BYTE in types else _NONE
        for i, g in zip(positions[nack].tolist(), group[nack].tolist(), strict=True):
            job, node = groups[g]
            if job is None or node is None:
                continue
            peer = job.peers.get(node)
            if peer is None:
                continue
            self.on_nack(peer, job, dgs[i], now)
        credit = kind == _CONTROL if _CONTROL_BYTE in types else _NONE
        for i, g in zip(positions[credit].tolist(), group[credit].tolist(), strict=True):
            job, node = groups[g]
            peer = None if job is None or node is None else job.peers.get(node)
            if peer is None:
                continue
            assert job is not None
            self.on_control(peer, job, dgs[i], now)
        if one and not types.strip(_RESULT_BYTE):  # all results: all acknowledge
            at = positions
        else:
            acking = _ACKING[kind]
            if not acking.any():
                return
            at = positions[acking]
        if one:  # its datagrams of sizes[0] bytes, but its last one of lasts[0]
            job, node = groups[0]
            peer = None if job is None or node is None else job.peers.get(node)
            nbytes0 = at.size * sizes[0] + (lasts[0] - sizes[0] if at[-1] == runs[0] - 1 else 0)
            if peer is not None and nbytes0:
                peer.rate.on_ack(nbytes0, None, now)
            return
        g = group[acking]  # (several groups: `acking` was made above)
        weights = np.array(sizes, np.int64)[g]  # by group: no Python step a datagram
        last = at == np.cumsum(runs)[g] - 1
        weights[last] = np.array(lasts, np.int64)[g[last]]
        nbytes = np.bincount(g, weights=weights, minlength=len(groups))
        acked: dict[Peer, int] = {}
        for g in np.flatnonzero(nbytes).tolist():  # groups in arrival order
            job, node = groups[g]
            if job is None or node is None:
                continue
            peer = job.peers.get(node)
            if peer is not None:
                acked[peer] = acked.get(peer, 0) + int(nbytes[g])
        for peer, n in acked.items():  # once per peer and batch
            peer.rate.on_ack(n, None, now)
