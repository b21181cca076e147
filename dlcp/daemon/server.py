"""dlcpd: moves bytes between the shim, the protocol engine and the network.

Everything that decides (what to send, when a round is complete, which class
and path a packet takes) lives in the sans-IO core and the policies; this
module owns the sockets, the timers and the shared memory.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import struct
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dlcp import ipc
from dlcp.codecs import lanes as lane_ops
from dlcp.core.buffers import SpareBuffers
from dlcp.core.engine import Engine, JobSpec, RoundComplete, RoundFailed, SendBatch, credit_of
from dlcp.core.layout import Layout
from dlcp.core.pathhealth import health_config
from dlcp.daemon import notify, status
from dlcp.daemon.config import Config
from dlcp.daemon.flow import CREDIT_STEP, size_windows
from dlcp.daemon.jobs import HostAddr, JobState, LocalPart, LocalRound, parse_hosts
from dlcp.daemon.outbox import Outbox, Peer
from dlcp.daemon.probing import Prober
from dlcp.daemon.requests import RequestError, bad_request, float_field, int_field
from dlcp.daemon.shm import MAX_SEGMENT, MappedSegment, RankSegment
from dlcp.daemon.transport import NATIVE_SEND, Split, UdpPath
from dlcp.errors import DlcpError, LocalError
from dlcp.policies import apply_droppable, from_config
from dlcp.wire.batch import _bulk
from dlcp.wire.header import (
    HEADER_SIZE,
    Codec,
    PacketType,
    header_of_valid,
    lane_bytes,
)
from dlcp.wire.probe import probe_of

__all__ = ["Daemon", "RequestError"]

_UNION_BOUND = "the sketch's index union (codec union) is never droppable: its bound must be 0"

log = logging.getLogger("dlcpd")

_JOB = struct.Struct("!I")
_NACK_COUNT = struct.Struct("!I")
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
FD_TIMEOUT = 5.0  # seconds a rank has to send the memfd it announced
_INT_SIZE = array.array("i").itemsize
INPUT_BUFFERS = 4  # per rank: buffers of its submitted lanes kept for reuse
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
# A poll that takes this much or more comes back at once (`_take_from`): the
# link brings more than a batch per poll interval (1 Gbit/s and faster), and
# waiting would leave it idle with data queued rather than save wake-ups.
MODERATION_BYTES = 256 * 1024
OpKey = tuple[int, int, int]


def _join(parts: list[Sequence[memoryview]]) -> Sequence[memoryview]:
    """A drain's datagrams, in order: one `Datagrams` (no object per datagram)
    when the C split made every part, else a list."""
    if _bulk is not None and all(type(p) is _bulk.Datagrams for p in parts):
        return _bulk.join(parts)
    return [dg for p in parts for dg in p]


class Client:
    """One connection from a rank."""

    def __init__(self, daemon: Daemon, writer: asyncio.StreamWriter) -> None:
        self.daemon = daemon
        self.writer = writer
        self.segment: RankSegment | MappedSegment | None = None
        self.jobs: set[int] = set()
        self.pending = 0
        self.closed = False
        self.awaiting_fd: tuple[int, int] | None = None  # (request id, size) of a memfd segment
        # this rank's submitted lanes, copied into buffers reused across rounds
        self.inputs = SpareBuffers(INPUT_BUFFERS)

    def reply(self, rid: Any, **fields: Any) -> None:
        if self.closed:
            return
        try:
            self.writer.write(ipc.encode({"id": rid, "ok": True, **fields}))
        except (OSError, RuntimeError):
            self.closed = True

    def error(self, rid: Any, code: str, message: str) -> None:
        if self.closed:
            return
        try:
            self.writer.write(
                ipc.encode({"id": rid, "ok": False, "code": code, "error": message[:2000]})
            )
        except (OSError, RuntimeError):
            self.closed = True


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.id = f"{os.uname().nodename}-{os.getpid()}-{secrets.token_hex(4)}"
        self.engine = Engine(timing=config.timing, gather=NATIVE_SEND)
        self.paths: list[UdpPath] = []
        self.jobs: dict[int, JobState] = {}
        # the window granted in credits to each host that sends here (`_size_windows`)
        self.rx_grant = 0
        self.clients: set[Client] = set()
        self.rounds: dict[OpKey, LocalRound] = {}
        self.counters: Counter[str] = Counter()
        self.requests: Counter[tuple[str, str]] = Counter()
        self.daemon_rejects: Counter[str] = Counter()
        self._load_policies()
        self.outbox = Outbox(
            self.paths,
            dscp=config.dscp,
            rate=config.rate,
            pacing=config.pacing,
            balancer_factory=self._balancer_factory,
            window_bytes=config.window_bytes,
            health=health_config(config.probe_interval_s),
        )
        self.prober = Prober(
            lambda: self.outbox.multipath,
            self.engine,
            lambda: self.outbox.tos[0],
            self._count,
        )
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._writers: set[int] = set()
        # receive moderation (`_moderate`): while busy, the sockets are not
        # watched and a poll comes every `moderation_s` seconds
        self._moderation = config.moderation_s
        self._polling = False
        self._poll_at = 0.0
        self._server: asyncio.AbstractServer | None = None
        self._metrics_server: Any = None
        self._round_hist: Any = None
        self.tc = status.TcStats(config.tc_devices)  # tc class stats for /metrics
        self._tc_task: asyncio.Task[None] | None = None
        self.draining = False
        self.stopped = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- policies -----------------------------------------------------------
    def _count(self, name: str) -> None:
        self.counters[name] += 1

    def _load_policies(self) -> None:
        cfg = self.config
        self.priority = from_config("priority", {**cfg.priority, "dscp": list(cfg.dscp)})
        self.drop = from_config("drop", cfg.drop)
        self._balance_cfg = self._adaptive_tolerance(dict(cfg.balance))

    def _balancer_factory(self) -> Any:
        return from_config("balance", self._balance_cfg)

    def _adaptive_tolerance(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """`adaptive` takes as random the loss the rate control takes as random
        (rate.loss_tolerance), unless its own table says otherwise."""
        keys = {str(k).replace("-", "_") for k in cfg}
        if cfg.get("name") == "adaptive" and "loss_tolerance" not in keys:
            return {**cfg, "loss_tolerance": self.config.rate.loss_tolerance}
        return cfg

    def reload(self, config: Config) -> None:
        """SIGHUP: new policies, DSCP table and timing; sockets and jobs stay."""
        self.config.priority, self.config.drop = config.priority, config.drop
        self.config.balance, self.config.dscp = config.balance, config.dscp
        self._load_policies()
        self.outbox.tos = [int(d) << 2 for d in config.dscp]
        self.outbox.set_balancer_factory(self._balancer_factory)
        self.engine.timing = config.timing
        log.info("reloaded policies: %s %s %s", config.priority, config.drop, config.balance)

    # -- lifecycle ----------------------------------------------------------
    @property
    def now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    async def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        cfg = self.config
        for addr in cfg.addresses:
            path = UdpPath(
                addr, cfg.udp_port, gso=cfg.gso, gro=cfg.gro, buffer_bytes=cfg.socket_buffer_bytes
            )
            self.paths.append(path)
            loop.add_reader(path.fileno(), self._on_readable, path)
        for job in cfg.jobs:
            self._add_static_job(job)
        # everything that can fail to bind comes before the control socket: a
        # client that sees the socket finds a daemon that stays up
        if cfg.metrics_port:
            from dlcp.daemon.metrics import make_registry, serve_metrics

            registry, self._round_hist = make_registry(self)
            self._metrics_server = await serve_metrics(
                registry, cfg.metrics_address, cfg.metrics_port
            )
            self._tc_task = loop.create_task(self.tc.refresh(self.stopped))
        sock_dir = os.path.dirname(cfg.socket)
        if sock_dir:
            os.makedirs(sock_dir, exist_ok=True)
        if os.path.exists(cfg.socket):
            os.unlink(cfg.socket)
        self._server = await asyncio.start_unix_server(
            self._serve_client, path=cfg.socket, limit=ipc.MAX_MESSAGE + 4
        )
        os.chmod(cfg.socket, cfg.socket_mode)
        log.info(
            "dlcpd %s serving %s on %s udp/%d, metrics %s, MAC %s",
            self.id,
            cfg.socket,
            ",".join(cfg.addresses),
            cfg.udp_port,
            cfg.metrics_port or "off",
            status.mac_description(self.config.mac),
        )

    async def serve(self) -> None:
        """Run until SIGTERM/SIGINT (drain) ; SIGHUP reloads policies."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        # before the socket exists: whoever sees it may signal us at once
        loop.add_signal_handler(signal.SIGTERM, self.begin_drain)
        loop.add_signal_handler(signal.SIGINT, self.begin_drain)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        await self.start()
        notify.notify("READY=1", f"STATUS=serving {self.config.socket}")
        watchdog = notify.watchdog_interval()
        dog = loop.create_task(self._watchdog(watchdog)) if watchdog else None
        try:
            await self.stopped.wait()
        finally:
            if dog is not None:
                dog.cancel()
            await self.close()

    async def _watchdog(self, interval: float) -> None:
        while True:
            notify.notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    def _on_sighup(self) -> None:
        from dlcp.daemon.config import load

        if self.config.path is None:
            return
        try:
            self.reload(load(self.config.path))
        except DlcpError as exc:
            log.error("reload failed, keeping the old policies: %s", exc)

    def begin_drain(self) -> None:
        if self.draining:
            return
        self.draining = True
        notify.notify("STOPPING=1", "STATUS=draining")
        log.info("draining %d rounds in flight", self.engine.pending_rounds())
        assert self._loop is not None
        self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        deadline = self.now + self.config.drain_timeout_s
        while self.now < deadline and (
            self.engine.pending_rounds() or any(r.submitted for r in self.rounds.values())
        ):
            await asyncio.sleep(0.01)
        # let the last results and ACKs leave
        for _ in range(100):
            if not self.outbox.queued():
                break
            await asyncio.sleep(0.01)
        self.stopped.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self.clients):
            c.closed = True
            c.writer.close()
            self._drop_client(c)
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        for p in self.paths:
            loop.remove_reader(p.fileno())
            if p.fileno() in self._writers:
                loop.remove_writer(p.fileno())
            p.close()
        if self._metrics_server is not None:
            self._metrics_server.close()
        with contextlib.suppress(OSError):
            os.unlink(self.config.socket)
        log.info("stopped")

    # -- network in -----------------------------------------------------------
    def _on_readable(self, path: UdpPath) -> None:
        self.counters["wakeups_readable"] += 1
        _, full = self._take_from((path,))
        if self._moderation > 0:
            self._moderate(True, full, self.now)
        self._pump()

    def _take_from(self, paths: Sequence[UdpPath]) -> tuple[int, bool]:
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

    def _moderate(self, busy: bool, full: bool, now: float) -> None:
        """Interrupt moderation: after a wake-up that found work the daemon
        stops watching its sockets and polls them every `moderation` seconds
        (at once when a drain took its whole budget), taking what arrived
        meanwhile in one drain and sending what the pacers earned in one
        flush; a poll that finds nothing to take or send goes back to
        watching the sockets."""
        assert self._loop is not None
        if busy:
            if not self._polling:
                self._polling = True
                for p in self.paths:
                    self._loop.remove_reader(p.fileno())
            self._poll_at = now if full else now + self._moderation
        elif self._polling:
            self._polling = False
            for p in self.paths:
                self._loop.add_reader(p.fileno(), self._on_readable, p)

    def _receive(self, path: UdpPath) -> bool:
        """Take what waits on `path`'s socket: each recvmsg buffer (a GRO
        super-datagram: one source, one segment size) is split and its job and
        node looked up once when all its datagrams name one job; the engine
        takes the whole drain at once; then the accepted control packets (NACKs,
        and the bytes that acknowledge each peer) are acted on. True when
        the drain stopped at its budget (more may wait)."""
        now = self.now
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

    def _credit(self, peer: Peer, job: JobState) -> None:
        """Tell `peer` how many of its bytes this daemon has taken from its
        sockets, and whether they are empty now (a CONTROL packet of `job`,
        sent at once, past the queues: a credit must never wait for the window
        it opens)."""
        drained = all(p.empty() for p in self.paths)
        dg = self.engine.credit_datagram(
            job.spec.job, peer.rx_epoch, peer.rx_bytes, drained, self.rx_grant
        )
        if dg is None:
            return
        try:
            live = peer.live_path()  # path 0 unless it is out of use
            sent = peer.local[live].send([dg], peer.dest(live), self.outbox.tos[0])
        except OSError:
            sent = 0
        if not sent:  # socket full or an error: a later credit says as much (a count)
            self.counters["credits_unsent"] += 1
            return
        peer.rx_credited = peer.rx_bytes
        peer.rx_granted = self.rx_grant
        self.counters["credits_sent"] += 1

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
            dg = dgs[i]
            h = header_of_valid(dg)
            if h.count:  # a NACK that only asks for the DONE names no lost packet
                self.outbox.on_loss(peer, h.count, now)
            spec = job.spec
            self.outbox.on_nack(peer, h, dg, shards=len(spec.owners), payload=spec.payload, now=now)
        credit = kind == _CONTROL if _CONTROL_BYTE in types else _NONE
        for i, g in zip(positions[credit].tolist(), group[credit].tolist(), strict=True):
            job, node = groups[g]
            peer = None if job is None or node is None else job.peers.get(node)
            if peer is None:
                continue
            payload = dgs[i][HEADER_SIZE:]
            got = credit_of(payload)
            if got is not None:
                self.outbox.on_credit(
                    peer, got.received, got.epoch, got.drained, got.window, now=now
                )
            elif (probe := probe_of(payload)) is not None:
                assert job is not None
                self.prober.on_probe(peer, job.spec.job, probe, now)
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

    # -- engine out -----------------------------------------------------------
    def _pump(self) -> None:
        """Move the engine's output to the network and the ranks; re-arm timers."""
        now = self.now
        engine = self.engine
        sends = engine.send_batches()
        if sends:
            self._enqueue(sends, now)
        while (ev := engine.next_event()) is not None:
            if isinstance(ev, RoundComplete):
                self._complete(ev)
            else:
                self._failed(ev)
        if self.outbox.multipath:
            for peer, path in self.prober.run(now):
                self._path_down(peer, path, now)
        if self.outbox.backlog and not self.outbox.blocked:
            try:
                self.outbox.flush(now)
            except OSError as exc:  # never let a send error wedge the loop
                log.error("send failed, dropping the batch at the head: %s", exc)
                self.counters["send_errors"] += 1
                self.outbox.drop_head()
            if self.outbox.blocked:
                self._wait_writable()
        self._arm(now)
        engine.drop_settled()  # the ranks are told and the peers sent to: now free

    def _enqueue(self, batches: list[SendBatch], now: float) -> None:
        """Queue the engine's datagrams: each run of consecutive batches for the
        same peer at once (`Outbox.push_many`, as `push` one by one, in order).
        A batch's datagrams all belong to one job: its id is read once."""
        jobs = self.jobs
        run: Peer | None = None
        parts: list[SendBatch] = []
        for b in batches:
            if not b.datagrams:
                continue
            job = jobs.get(_JOB.unpack(b.datagrams[0][8:12])[0])  # bytes or Gathered
            peer = None if job is None else job.peers.get(b.node)
            if peer is None:
                continue
            if peer.health is not None:  # its paths are probed while it has traffic
                assert job is not None
                peer.tx_job = job.spec.job
                peer.health.touch(now)
            if peer is not run:
                if run is not None:
                    self._push_run(run, parts)
                run, parts = peer, []
            parts.append(b)
        if run is not None:
            self._push_run(run, parts)

    def _push_run(self, peer: Peer, parts: list[SendBatch]) -> None:
        if len(parts) == 1:  # the usual case: the lists as the engine made them
            self.outbox.push_many(peer, parts[0].datagrams, parts[0].priorities)
            return
        # new lists: the engine keeps some of its batches' lists (result
        # datagrams); joined by list extends, no Python step a datagram
        dgs: list[bytes] = []
        prios: list[int] = []
        for b in parts:
            dgs += b.datagrams
            prios += b.priorities
        self.outbox.push_many(peer, dgs, prios)

    def _path_down(self, peer: Peer, path: int, now: float) -> None:
        """`path` to `peer` was found down: what urgent went on it lately goes
        again on the live paths, and so does a credit (credits go on the
        first path in use, which may have been this one)."""
        self.outbox.path_down(peer, path, now)
        job = self.jobs.get(peer.rx_job) if peer.rx_job is not None else None
        if job is not None and peer.usable is not None:
            self._credit(peer, job)

    def _wait_writable(self) -> None:
        assert self._loop is not None
        for p in self.paths:
            if p.fileno() not in self._writers:
                self._writers.add(p.fileno())
                self._loop.add_writer(p.fileno(), self._on_writable)

    def _on_writable(self) -> None:
        assert self._loop is not None
        for fd in self._writers:
            self._loop.remove_writer(fd)
        self._writers.clear()
        self.outbox.blocked = False
        self._pump()

    def _arm(self, now: float) -> None:
        if self._polling:  # the poll takes the sockets, the timers and the pacers' due
            t: float | None = self._poll_at
        else:
            t = self.engine.get_timer()
            wake = self.outbox.next_wake
            if wake is not None and not self.outbox.blocked and (t is None or wake < t):
                t = wake
            if self.outbox.multipath:
                probe = self.prober.next_timer()
                if probe is not None and (t is None or probe < t):
                    t = probe
        if t == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = t
        if t is not None:
            assert self._loop is not None
            self._timer = self._loop.call_at(max(t, now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self.counters["wakeups_poll" if self._polling else "wakeups_timer"] += 1
        # Datagrams may be waiting in the sockets (the loop runs timers before
        # IO callbacks): take them first, or a NACK timer fires for packets
        # that have already arrived.
        try:
            taken, full = self._take_from(self.paths)
            now = self.now
            t = self.engine.get_timer()
            if t is not None and t <= now:
                self.engine.handle_timer(now)
            if self._polling:
                self._moderate(taken > 0 or bool(self.outbox.backlog), full, now)
        finally:
            # whatever went wrong above (it is logged by the loop), the timer
            # is armed again: without it no round would ever time out
            self._pump()

    # -- rounds -----------------------------------------------------------
    def _complete(self, ev: RoundComplete) -> None:
        op = (ev.job, ev.round, ev.bucket)
        job = self.jobs.get(ev.job)
        if job is not None:
            job.rounds_completed += 1
        self.counters["rounds_completed"] += 1
        if ev.lost_lanes:
            self.counters["rounds_lossy"] += 1
        lr = self.rounds.pop(op, None)
        if lr is None:
            return
        elapsed = self.now - lr.started
        if self._round_hist is not None:
            self._round_hist.observe(elapsed)
        lay = ev.layout
        contrib = np.ascontiguousarray(ev.contributors, dtype="<u2")
        bmax = np.ascontiguousarray(ev.block_max, dtype="<f4")
        counts = lay.packet_counts()
        expected = len(job.spec.contributors) * job.local_ranks if job else 0
        self.counters["result_lanes"] += lay.total * len(lr.parts)
        self.counters["result_lanes_lost"] += int(counts[contrib < expected].sum()) * len(lr.parts)
        sums = lane_ops.summed_wire(lay.codec, ev.sums)  # the wire's summed lanes
        for part in lr.parts:
            c = part.client
            if c.closed or c.segment is None:
                continue
            c.pending -= 1
            try:  # pwritev to a named segment, a copy into a mapped one
                if c.segment.holds(part.out[0], sums):  # the engine stored them there
                    c.segment.write(part.out[0] + sums.nbytes, (contrib, bmax))
                    self.counters["results_in_place"] += 1
                else:
                    c.segment.write(part.out[0], (sums, contrib, bmax))
            except LocalError as exc:
                self.requests[("submit", "bad_request")] += 1
                c.error(part.rid, "bad_request", f"round completed, but {exc}")
                continue
            self.requests[("submit", "ok")] += 1
            c.reply(
                part.rid,
                lost_lanes=int(ev.lost_lanes),
                total_lanes=int(ev.total_lanes),
                packets=lay.packets,
                contributors_min=int(contrib.min()) if contrib.size else 0,
                elapsed_s=round(elapsed, 6),
            )

    def _failed(self, ev: RoundFailed) -> None:
        op = (ev.job, ev.round, ev.bucket)
        job = self.jobs.get(ev.job)
        if job is not None:
            job.rounds_failed += 1
        self.counters["rounds_failed"] += 1
        log.warning("job %d round %d bucket %d failed: %s", *op, ev.reason)
        lr = self.rounds.pop(op, None)
        if lr is None:
            return
        for part in lr.parts:
            part.client.pending -= 1
            self.requests[("submit", "round_failed")] += 1
            part.client.error(part.rid, "round_failed", ev.reason)

    def _start_round(self, lr: LocalRound, job: JobState) -> None:
        """All local ranks are in: sum them and hand the contribution to the engine."""
        codec = Codec(lr.codec)
        spec = job.spec
        layout = Layout(total=lr.total, codec=codec, shards=len(spec.owners), payload=spec.payload)
        parts = lr.parts
        out = None
        if len(parts) == 1:
            lanes: Any = parts[0].data
            summed = False
            out = self._mapped_out(parts[0], codec, lr.total)
        else:
            acc = None
            for p in parts:
                v = lane_ops.unpack(codec, p.data.tobytes(), lr.total, False).astype(
                    lane_ops.sum_dtype(codec)
                )
                acc = v if acc is None else acc + v
            lanes = lane_ops.pack(codec, acc, True)  # type: ignore[arg-type]
            summed = True
        n = layout.packets
        counts = layout.packet_counts()
        layers = next((p.layers for p in parts if p.layers is not None), None)
        norms_list = [p.norms for p in parts if p.norms is not None]
        if layers is None:
            layers = np.zeros(n, dtype=np.int64)
        norms = np.sum(norms_list, axis=0) if norms_list else np.zeros(n)
        bmaxes = [p.block_max for p in parts if p.block_max is not None]
        block_max = np.max(bmaxes, axis=0) if bmaxes else None
        classes = self.priority.classify(
            layers=layers.astype(np.int64),
            n_layers=int(layers.max()) + 1 if n else 1,
            norms=norms,
            counts=counts,
        )
        droppable = np.zeros(n, dtype=bool)
        if lr.bound > 0:
            for s in range(layout.shards):
                r = layout.shard_packets(s)
                if len(r):
                    droppable[r.start : r.stop] = self.drop.droppable(
                        norms=norms[r.start : r.stop],
                        counts=counts[r.start : r.stop],
                        bound=lr.bound,
                    )
        classes = apply_droppable(classes, droppable)
        self.engine.submit(
            job=lr.job,
            round=lr.round,
            bucket=lr.bucket,
            codec=codec,
            total=lr.total,
            lanes=lanes,
            now=self.now,
            summed=summed,
            weight=len(parts),
            classes=classes,
            droppable=droppable,
            layers=layers,
            bound=lr.bound,
            scale=lr.scale,
            block_max=block_max,
            out=out,
        )
        lr.submitted = True
        self._pump()

    @staticmethod
    def _mapped_out(part: LocalPart, codec: Codec, total: int) -> np.ndarray | None:
        """The rank's result lanes in its mapped segment, where the engine may
        store results as they arrive (no copy at the end), if the segment is
        mapped and the codec sums in the wire's dtype (not fp16's fp32 sums)."""
        seg = part.client.segment
        dtype = lane_ops.sum_dtype(codec)
        if not isinstance(seg, MappedSegment) or dtype != lane_ops.wire_summed_dtype(codec):
            return None
        return seg.lanes(part.out[0], dtype, total)

    # -- jobs -------------------------------------------------------------
    def _make_job(
        self,
        *,
        job: int,
        key: bytes,
        hosts: tuple[HostAddr, ...],
        me: int,
        local_ranks: int,
        mode: str,
        payload: int,
        aggregators: tuple[int, ...] = (),
        contributors: tuple[int, ...] = (),
        static: bool = False,
    ) -> JobState:
        H = len(hosts)
        if not 0 <= me < H:
            raise bad_request(f"me={me} is not an index of hosts")
        mine = hosts[me]
        if mine.udp_port != self.config.udp_port or not set(mine.addresses) & set(
            self.config.addresses
        ):
            raise RequestError(
                "conflict",
                f"hosts[{me}] {list(mine.addresses)}:{mine.udp_port} is not this daemon "
                f"({list(self.config.addresses)}:{self.config.udp_port})",
            )
        if mode == "transpose":
            spec = JobSpec.transpose(job, key, me, H, payload=payload, mac=self.config.mac)
        elif mode == "ps":
            aggs = aggregators or (0,)
            contr = contributors or tuple(i for i in range(H) if i not in aggs)
            for i in (*aggs, *contr):
                if not 0 <= i < H:
                    raise bad_request(f"host index {i} out of range")
            spec = JobSpec(
                job=job,
                key=key,
                me=me,
                contributors=contr,
                owners=aggs,
                payload=payload,
                mac=self.config.mac,
            )
        else:
            raise bad_request(f"mode must be transpose or ps, not {mode!r}")
        state = JobState(spec=spec, hosts=hosts, local_ranks=local_ranks, mode=mode, static=static)
        now = self.now
        for node, h in enumerate(hosts):
            if node == me:
                continue
            state.peers[node] = self.outbox.peer(h.addresses, h.udp_port, now)
            for a in h.addresses:
                state.node_of[a] = node
        return state

    def _size_windows(self) -> None:
        """Each peer's pacing cap and flow-control window, and the window this
        daemon grants in its credits (`flow.size_windows`), told at once."""
        cfg = self.config
        self.rx_grant = size_windows(self.jobs.values(), cfg.window_bytes, cfg.rate)
        if self.rx_grant:
            self._announce_grant()

    def _announce_grant(self) -> None:
        """Credit at once each host that has sent here and was told another
        grant (a job joining or leaving changed it), rather than after its
        next 2 MiB, in the job it last sent in (one its daemon has). A host
        that has not sent yet starts at WINDOW_MIN (`Outbox.peer`) until its
        first credit tells it the grant."""
        for peer in self.outbox.peers.values():
            job = self.jobs.get(peer.rx_job) if peer.rx_job is not None else None
            if job is not None and peer.rx_granted != self.rx_grant:
                self._credit(peer, job)

    def _add_static_job(self, jc: Any) -> None:
        hosts = tuple(HostAddr(h.addresses, h.udp_port) for h in jc.hosts)
        state = self._make_job(
            job=jc.job,
            key=jc.key,
            hosts=hosts,
            me=jc.me,
            local_ranks=1,
            mode=jc.mode,
            payload=self.config.payload,
            aggregators=jc.aggregators,
            contributors=jc.contributors,
            static=True,
        )
        self.jobs[jc.job] = state
        self.engine.add_job(state.spec)
        self._size_windows()

    def _leave(self, client: Client, job_id: int) -> None:
        client.jobs.discard(job_id)
        job = self.jobs.get(job_id)
        if job is None:
            return
        job.clients.discard(client)
        if not job.clients and not job.static:
            del self.jobs[job_id]
            self.engine.remove_job(job_id, self.now)
            self._size_windows()
            for op in [op for op in self.rounds if op[0] == job_id]:
                del self.rounds[op]
            log.info("job %d left", job_id)
            self._pump()

    # -- shim requests -------------------------------------------------------
    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        client = Client(self, writer)
        self.clients.add(client)
        try:
            while True:
                try:
                    prefix = await reader.readexactly(4)
                    body = await reader.readexactly(ipc.decode_length(prefix))
                    req = ipc.decode_body(body)
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                except ipc.ProtocolError as exc:
                    client.error(None, "bad_request", str(exc))
                    self.requests[("framing", "bad_request")] += 1
                    break
                self._handle(client, req)
                if client.closed:
                    break
                await writer.drain()
                if client.awaiting_fd is not None:
                    await self._take_fd(client, reader, writer)
                    if client.closed:
                        break
        finally:
            self._drop_client(client)
            client.closed = True
            writer.close()

    def _drop_client(self, client: Client) -> None:
        if client not in self.clients:
            return
        self.clients.discard(client)
        for lr in self.rounds.values():
            lr.parts = [p for p in lr.parts if p.client is not client]
        for job_id in list(client.jobs):
            self._leave(client, job_id)
        if client.segment is not None:
            client.segment.close()
            client.segment = None

    _OPS = ("hello", "segment", "join", "submit", "leave", "status")

    def _handle(self, client: Client, req: dict[str, Any]) -> None:
        rid = req.get("id")
        op = req.get("op")
        if not isinstance(rid, int) or isinstance(rid, bool):
            client.error(rid, "bad_request", "id must be an integer")
            self.requests[("unknown", "bad_request")] += 1
            return
        if op not in self._OPS:
            client.error(rid, "unknown_op", f"unknown op {str(op)[:50]!r}")
            self.requests[("unknown", "unknown_op")] += 1
            return
        handler: Callable[[Client, int, dict[str, Any]], None] = getattr(self, f"_op_{op}")
        try:
            handler(client, rid, req)
        except RequestError as exc:
            self.requests[(op, exc.code)] += 1
            client.error(rid, exc.code, str(exc))
        except LocalError as exc:
            self.requests[(op, "bad_request")] += 1
            client.error(rid, "bad_request", str(exc))
        except Exception as exc:  # never let one request take the daemon down
            log.exception("internal error serving %s", op)
            self.requests[(op, "internal")] += 1
            client.error(rid, "internal", f"{type(exc).__name__}: {exc}")
        else:
            if op != "submit":
                self.requests[(op, "ok")] += 1

    def _op_hello(self, client: Client, rid: int, req: dict[str, Any]) -> None:
        version = req.get("version", ipc.PROTOCOL_VERSION)
        if version != ipc.PROTOCOL_VERSION:
            raise RequestError("bad_request", f"protocol version {version!r}; this daemon speaks 1")
        fb = req.get("fallbacks", 0)
        if isinstance(fb, int) and not isinstance(fb, bool) and 0 <= fb < 2**40:
            self.counters["fallbacks"] += fb
        client.reply(rid, version=ipc.PROTOCOL_VERSION, daemon=self.describe())

    def describe(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "id": self.id,
            "host_index": cfg.host_index,
            "addresses": list(cfg.addresses),
            "udp_port": cfg.udp_port,
            "payload": cfg.payload,
            "metrics_port": cfg.metrics_port,
            "peers": [
                {"index": p.index, "addresses": list(p.addresses), "udp_port": p.udp_port}
                for p in cfg.peers
            ],
        }

    def _op_segment(self, client: Client, rid: int, req: dict[str, Any]) -> None:
        if client.pending:
            raise RequestError("conflict", "cannot replace the segment with submits outstanding")
        if req.get("memfd") is True:
            # the descriptor follows as SCM_RIGHTS with one byte; nothing else is
            # read from this connection until it has come (_take_fd)
            size = int_field(req, "size", 1, MAX_SEGMENT)
            client.awaiting_fd = (rid, size)
            client.writer.transport.pause_reading()  # type: ignore[attr-defined]
            client.reply(rid, send_fd=True)
            return
        seg = RankSegment(req.get("name"), req.get("size"))  # type: ignore[arg-type]
        self._set_segment(client, seg)
        client.reply(rid)

    @staticmethod
    def _set_segment(client: Client, seg: RankSegment | MappedSegment) -> None:
        if client.segment is not None:
            client.segment.close()
        client.segment = seg

    async def _take_fd(
        self, client: Client, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Receive the memfd a `segment` request announced and map it; the
        request's second reply says whether that worked. A connection that
        sends anything else first, or nothing within FD_TIMEOUT, is closed."""
        assert client.awaiting_fd is not None
        rid, size = client.awaiting_fd
        client.awaiting_fd = None
        fds: list[int] = []
        try:
            if getattr(reader, "_buffer", b""):  # the stream read ahead: out of step
                raise ipc.ProtocolError("data sent after a memfd segment request")
            sock = writer.get_extra_info("socket")
            raw = socket.socket(fileno=os.dup(sock.fileno()))
            try:
                raw.setblocking(False)
                loop = asyncio.get_running_loop()
                ready: asyncio.Future[None] = loop.create_future()

                def wake() -> None:
                    if not ready.done():
                        ready.set_result(None)

                loop.add_reader(raw.fileno(), wake)
                try:
                    await asyncio.wait_for(ready, FD_TIMEOUT)
                finally:
                    loop.remove_reader(raw.fileno())
                msg, anc, flags, _ = raw.recvmsg(1, socket.CMSG_SPACE(_INT_SIZE))
            finally:
                raw.close()
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", data[: len(data) - len(data) % _INT_SIZE]))
            if msg != b"F" or len(fds) != 1 or flags & socket.MSG_CTRUNC:
                raise ipc.ProtocolError("expected one byte 'F' carrying one descriptor")
        except (ipc.ProtocolError, OSError, TimeoutError) as exc:
            for fd in fds:
                os.close(fd)
            self.requests[("segment", "bad_request")] += 1
            client.error(rid, "bad_request", f"no segment descriptor: {exc or 'timed out'}")
            client.closed = True  # the stream is out of step: drop the connection
            return
        try:
            seg = MappedSegment(fds[0], size)
        except LocalError as exc:
            self.requests[("segment", "bad_request")] += 1
            client.error(rid, "bad_request", str(exc))
        else:
            self._set_segment(client, seg)
            client.reply(rid, mapped=True)
        finally:
            os.close(fds[0])
            writer.transport.resume_reading()  # type: ignore[attr-defined]

    def _op_join(self, client: Client, rid: int, req: dict[str, Any]) -> None:
        if self.draining:
            raise RequestError("shutting_down", "the daemon is stopping")
        job_id = int_field(req, "job", 0, 2**32 - 1)
        key_hex = req.get("key")
        try:
            key = bytes.fromhex(key_hex) if isinstance(key_hex, str) else b""
        except ValueError:
            key = b""
        if not 16 <= len(key) <= 64:
            raise bad_request("key must be 16..64 bytes in hex")
        if "hosts" in req:
            hosts = parse_hosts(req["hosts"])
            me = int_field(req, "me", 0, len(hosts) - 1)
        else:  # membership from the config's peers
            cfg = self.config
            table = {p.index: HostAddr(p.addresses, p.udp_port) for p in cfg.peers}
            table[cfg.host_index] = HostAddr(cfg.addresses, cfg.udp_port)
            if sorted(table) != list(range(len(table))):
                raise bad_request("config peers do not form indices 0..H-1; pass hosts")
            hosts = tuple(table[i] for i in range(len(table)))
            me = cfg.host_index
        local = int_field(req, "local_ranks", 1, 256) if "local_ranks" in req else 1
        mode = req.get("mode", "transpose")
        payload = int_field(req, "payload", 64, 65443) if "payload" in req else self.config.payload
        aggs_raw, contr_raw = req.get("aggregators", ()), req.get("contributors", ())
        if not isinstance(aggs_raw, list | tuple) or not isinstance(contr_raw, list | tuple):
            raise bad_request("aggregators and contributors must list host indices")
        aggs, contr = tuple(aggs_raw), tuple(contr_raw)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in (*aggs, *contr)):
            raise bad_request("aggregators and contributors must list host indices")
        state = self._make_job(
            job=job_id,
            key=key,
            hosts=hosts,
            me=me,
            local_ranks=local,
            mode=str(mode),
            payload=payload,
            aggregators=aggs,
            contributors=contr,
        )
        existing = self.jobs.get(job_id)
        if existing is not None:
            if existing.signature() != state.signature():
                raise RequestError(
                    "conflict", f"job {job_id} is already here with other members, key or ranks"
                )
            state = existing
        else:
            self.jobs[job_id] = state
            self.engine.add_job(state.spec)
            self._size_windows()
            log.info(
                "job %d joined: %d hosts, me=%d, %d local ranks", job_id, len(hosts), me, local
            )
        state.clients.add(client)
        client.jobs.add(job_id)
        client.reply(rid)

    def _op_leave(self, client: Client, rid: int, req: dict[str, Any]) -> None:
        job_id = int_field(req, "job", 0, 2**32 - 1)
        if job_id not in client.jobs:
            raise RequestError("unknown_job", f"this client has not joined job {job_id}")
        self._leave(client, job_id)
        client.reply(rid)

    def _op_status(self, client: Client, rid: int, req: dict[str, Any]) -> None:
        client.reply(rid, status=status.snapshot(self))

    def _op_submit(self, client: Client, rid: int, req: dict[str, Any]) -> None:
        if self.draining:
            raise RequestError("shutting_down", "the daemon is stopping")
        job_id = int_field(req, "job", 0, 2**32 - 1)
        job = self.jobs.get(job_id)
        if job is None or job_id not in client.jobs:
            raise RequestError("unknown_job", f"job {job_id} was not joined on this connection")
        seg = client.segment
        if seg is None:
            raise bad_request("no segment: send 'segment' first")
        rnd = int_field(req, "round", 0, 2**32 - 1)
        bucket = int_field(req, "bucket", 0, 2**32 - 1)
        codec_name = req.get("codec")
        if not isinstance(codec_name, str) or codec_name not in ipc.CODEC_BY_NAME:
            raise bad_request(f"codec must be one of {', '.join(ipc.CODEC_BY_NAME)}")
        codec = Codec(ipc.CODEC_BY_NAME[codec_name])
        total = int_field(req, "total", 1, 2**32 - 1)
        bound = float_field(req, "bound", 0.0, 0.5, 0.0)
        scale = float_field(req, "scale", -3.4e38, 3.4e38, 0.0)
        if codec == Codec.UNION and bound > 0:
            raise bad_request(_UNION_BOUND)
        spec = job.spec
        layout = Layout(total=total, codec=codec, shards=len(spec.owners), payload=spec.payload)
        n = layout.packets
        d_off, d_len = seg.region(req.get("data"), "data")
        if d_len != lane_bytes(codec, total, False):
            raise bad_request(
                f"data holds {d_len} bytes; {total} {codec_name} lanes need "
                f"{lane_bytes(codec, total, False)}"
            )
        o_off, o_len = seg.region(req.get("out"), "out")
        need = lane_bytes(codec, total, True) + 6 * n
        if o_len < need:
            raise bad_request(f"out holds {o_len} bytes; the result needs {need}")
        regions = [(d_off, d_len)]
        layers = norms = bmax = None
        if req.get("meta") is not None:
            m_off, m_len = seg.region(req.get("meta"), "meta")
            if m_len not in (6 * n, 10 * n):
                raise bad_request(f"meta must hold {6 * n} or {10 * n} bytes for {n} packets")
            regions.append((m_off, m_len))
            mv = seg.read(m_off, m_len)
            layers = np.frombuffer(mv, "<u2", n, 0).astype(np.int64)
            norms = np.frombuffer(mv, "<f4", n, 2 * n).astype(np.float64)
            if not np.isfinite(norms).all() or (norms < 0).any():
                raise bad_request("norms must be finite and >= 0")
            if m_len == 10 * n:
                bmax = np.frombuffer(mv, "<f4", n, 6 * n).copy()
        for off, ln in regions:
            if off < o_off + o_len and o_off < off + ln:
                raise bad_request("out overlaps data or meta")
        op = (job_id, rnd, bucket)
        lr = self.rounds.get(op)
        if lr is None:
            if self.engine.has_round(*op):
                raise RequestError("conflict", f"round {rnd} bucket {bucket} was already run")
        elif lr.submitted:
            raise RequestError("conflict", f"round {rnd} bucket {bucket} already started")
        elif not lr.same(int(codec), total, bound, scale):
            raise RequestError("conflict", "local ranks disagree on codec, size, bound or scale")
        elif any(p.client is client for p in lr.parts):
            raise RequestError("conflict", "this client already submitted the bucket")
        # A named segment: a private copy by preadv, never a mapping (a rank that
        # shrinks its file gets bad_request instead of killing the daemon with
        # SIGBUS); the copy answers retransmissions until the round has its
        # results. A sealed memfd cannot shrink: its lanes are read in place.
        if isinstance(seg, MappedSegment):
            data = seg.read(d_off, d_len)
        else:
            data = client.inputs.take(d_len)
            seg.read_into(d_off, data)
        if lr is None:
            lr = LocalRound(
                job_id,
                rnd,
                bucket,
                int(codec),
                total,
                bound,
                scale,
                expected=job.local_ranks,
                started=self.now,
            )
            self.rounds[op] = lr
        lr.parts.append(LocalPart(client, rid, (o_off, o_len), data, layers, norms, bmax))
        client.pending += 1
        if len(lr.parts) >= lr.expected:
            try:
                self._start_round(lr, job)
            except LocalError as exc:
                self.rounds.pop(op, None)
                for p in lr.parts:
                    p.client.pending -= 1
                    if p.client is not client:
                        p.client.error(p.rid, "bad_request", str(exc))
                raise
        elif len(lr.parts) == 1:  # the other local ranks have until the timeout
            assert self._loop is not None
            self._loop.call_later(self.engine.timing.timeout, self._local_timeout, op, lr)

    def _local_timeout(self, op: OpKey, lr: LocalRound) -> None:
        """Not every local rank submitted (one died or hangs): fail the waiting ones."""
        if self.rounds.get(op) is not lr or lr.submitted:
            return
        del self.rounds[op]
        self.counters["rounds_failed"] += 1
        why = (
            f"only {len(lr.parts)} of {lr.expected} local ranks submitted round {op[1]} "
            f"bucket {op[2]} within {self.engine.timing.timeout:g}s"
        )
        log.warning("job %d: %s", op[0], why)
        for part in lr.parts:
            part.client.pending -= 1
            self.requests[("submit", "round_failed")] += 1
            part.client.error(part.rid, "round_failed", why)
