"""One dlcp daemon in virtual time: the real `Engine`, `Outbox` (send
scheduling, pacing, per-peer rate control, path choice by the configured
balancer), `Prober` (path health) and `flow.size_windows` (the pacing cap a
peer's fan-in allows), glued as `dlcp.daemon.server.Daemon` and
`dlcp.daemon.netin.NetworkIn` glue them.

What is this module's own code, not the daemon's (the daemon's versions read
sockets and the asyncio loop): the drain (every datagram that arrived since
the last one, handed to `Engine.receive_many` in arrival order with their
sources), the reaction to accepted control packets (as `NetworkIn._on_control`:
NACKs to `Outbox.on_loss`/`on_nack`, probes to `Prober.on_probe`, the bytes
of results, ACKs and DONEs to the peer's rate once per drain), the receive
moderation rule (`NetworkIn.moderate`: after a wake-up that found work, poll
every `moderation_s`, at once when a drain took MODERATION_BYTES) and the
timer (`Daemon._arm`). Not simulated: flow-control credits (the sockets never
fill here, so the daemon's 64 MiB windows never bind), the shim and shared
memory, CPU time (a drain and a flush take no virtual time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

from dlcp.core.engine import Engine, JobSpec, RoundComplete, RoundFailed, SendBatch
from dlcp.core.pathhealth import health_config
from dlcp.core.rate import WIRE_OVERHEAD
from dlcp.daemon.config import Config
from dlcp.daemon.flow import size_windows
from dlcp.daemon.jobs import HostAddr, JobState
from dlcp.daemon.netin import MODERATION_BYTES
from dlcp.daemon.outbox import Outbox, Peer
from dlcp.daemon.probing import Prober
from dlcp.daemon.transport import UdpPath
from dlcp.policies import from_config
from dlcp.sim.events import Timer
from dlcp.sim.port import Packet
from dlcp.wire import PacketType
from dlcp.wire.header import HEADER_SIZE, header_of_valid
from dlcp.wire.probe import probe_of

if TYPE_CHECKING:
    from dlcp.sim.fabric import Fabric

__all__ = ["PORT", "DlcpHost", "address"]

PORT = 7400
_NACK, _CONTROL = int(PacketType.NACK), int(PacketType.CONTROL)
_ACKING = frozenset((int(PacketType.RESULT), int(PacketType.ACK), int(PacketType.DONE)))


def address(node: int, path: int = 0) -> str:
    return f"10.{path}.{node >> 8}.{node & 255}"


class _Backlog(dict[Peer, None]):
    """An insertion-ordered stand-in for `Outbox.backlog` (a set of peers hashed
    by id): flushed in the same order every run, so a seed fixes the run."""

    # `self[peer] = None` in one C call (the outbox adds a peer a push):
    # a peer already in keeps its place, as there
    add = dict.setdefault

    def discard(self, peer: Peer) -> None:
        self.pop(peer, None)


class _Path:
    """What `Outbox` needs of a `UdpPath`: `address` and `send`, here into the
    fabric on this path's spine (the socket never fills)."""

    def __init__(self, host: DlcpHost, path: int) -> None:
        self.host, self.path, self.gso = host, path, True
        self.address = address(host.me, path)

    def send(self, datagrams: Sequence[bytes], dest: tuple[str, int], tos: int) -> int:
        h = self.host
        dst = h.node_of[dest[0]]
        cls = h.class_of_tos.get(tos & 0xFC, 6)
        # read now, as the kernel copies a datagram when sent
        frames = [dg if isinstance(dg, bytes) else bytes(dg) for dg in datagrams]
        h.fabric.send_frames(h.me, dst, cls, frames, WIRE_OVERHEAD, self.path)
        return len(datagrams)


class DlcpHost:
    """Node `me` of a dlcp job (`spec`) with the daemon `config`, on `fabric`.
    `on_event(host, event, now)` is told each round's completion or failure."""

    def __init__(
        self,
        fabric: Fabric,
        spec: JobSpec,
        mode: str,
        config: Config,
        n_nodes: int,
        paths: int,
        on_event: Callable[[DlcpHost, RoundComplete | RoundFailed, float], None],
        *,
        gather: bool = False,
    ) -> None:
        self.fabric, self.loop, self.spec, self.me = fabric, fabric.loop, spec, spec.me
        self.on_event = on_event
        self.class_of_tos = {d << 2: c for c, d in enumerate(config.dscp)}
        self.node_of = {address(n, p): n for n in range(n_nodes) for p in range(paths)}
        self.engine = Engine(
            timing=config.timing, gather=gather, early_results=config.early_results
        )
        self.engine.add_job(spec)
        self.paths = [_Path(self, p) for p in range(paths)]
        self.outbox = Outbox(
            cast("list[UdpPath]", self.paths),
            dscp=config.dscp,
            rate=config.rate,
            pacing=config.pacing,
            balancer_factory=lambda: from_config("balance", config.balance),
            window_bytes=0,
            health=health_config(config.probe_interval_s),
        )
        self.outbox.backlog = cast("set[Peer]", _Backlog())
        self.prober = Prober(
            lambda: self.outbox.multipath,
            self.engine,
            lambda: self.outbox.tos[0],
            _ignore,
            budget=config.probe_budget,
        )
        hosts = tuple(
            HostAddr(tuple(address(n, p) for p in range(paths)), PORT) for n in range(n_nodes)
        )
        self.peers: dict[int, Peer] = {
            n: self.outbox.peer(hosts[n].addresses, PORT, 0.0)
            for n in sorted(spec.members)
            if n != self.me
        }
        job = JobState(spec=spec, hosts=hosts, local_ranks=1, mode=mode, peers=self.peers)
        size_windows([job], 0, config.rate)  # each peer's pacing cap, as the daemon's
        self.moderation = config.moderation_s
        self.inbox: list[tuple[int, bytes]] = []  # (src, datagram): `Packet.data` is bytes here
        self.polling = False
        self.poll_at: float | None = None
        self.wake_pending = False
        self.timer = Timer(self.loop, self._on_timer)  # `Daemon._arm`'s wake-up
        self.drains = 0
        self.stalls = 0

    # -- the network in ---------------------------------------------------------
    def on_packet(self, pkt: Packet) -> None:
        self.inbox.append((pkt.src, pkt.data))
        if not self.polling and not self.wake_pending:
            self.wake_pending = True
            self.loop.at(self.loop.now, self._on_readable)

    def _on_readable(self) -> None:
        self.wake_pending = False
        now = self.loop.now
        taken = self._drain(now)
        if self.moderation > 0:
            self._moderate(True, taken >= MODERATION_BYTES, now)
        self.pump(now)

    def _on_timer(self) -> None:
        now = self.loop.now
        taken = self._drain(now)
        due = self.engine.get_timer()
        if due is not None and due <= now:
            self.engine.handle_timer(now)
        if self.polling:
            busy = taken > 0 or bool(self.outbox.backlog)
            self._moderate(busy, taken >= MODERATION_BYTES, now)
        self.pump(now)

    def _moderate(self, busy: bool, full: bool, now: float) -> None:
        if busy:
            self.polling = True
            self.poll_at = now if full else now + self.moderation
        elif self.polling:
            self.polling = False
            if self.inbox and not self.wake_pending:  # arrived while polling: readable now
                self.wake_pending = True
                self.loop.at(now, self._on_readable)

    def _drain(self, now: float) -> int:
        """Every datagram waiting, into the engine at once; then the accepted
        control packets acted on. The bytes taken."""
        inbox = self.inbox
        if not inbox:
            return 0
        self.inbox = []
        self.drains += 1
        srcs = [s for s, _ in inbox]
        dgs = [d for _, d in inbox]
        taken = sum(len(d) for d in dgs)
        for s in set(srcs):
            peer = self.peers.get(s)
            if peer is not None:
                peer.rx_job = self.spec.job
                if peer.health is not None:
                    peer.health.touch(now)
        accepted = self.engine.receive_many(dgs, now, srcs)
        acked: dict[int, int] = {}
        for i in accepted.tolist():
            dg = dgs[i]
            kind = dg[3]
            if kind == 1:  # data
                continue
            src = srcs[i]
            peer = self.peers.get(src)
            if peer is None:
                continue
            if kind in _ACKING:
                acked[src] = acked.get(src, 0) + len(dg)
            elif kind == _NACK:
                h = header_of_valid(dg)
                if h.count:
                    self.outbox.on_loss(peer, h.count, now)
                spec = self.spec
                self.outbox.on_nack(
                    peer, h, dg, shards=len(spec.owners), payload=spec.payload, now=now,
                    ranks=spec.ranks,
                )  # fmt: skip
            elif kind == _CONTROL:
                probe = probe_of(dg[HEADER_SIZE:])
                if probe is not None:
                    self.prober.on_probe(peer, self.spec.job, probe, now)
        for src, n in acked.items():
            self.peers[src].rate.on_ack(n, None, now)
        return taken

    # -- the engine out -----------------------------------------------------------
    def pump(self, now: float) -> None:
        """`Daemon._pump`: the engine's batches to the outbox (a run of batches
        for one peer at once), its events, probes, a flush; the next wake-up."""
        engine, ob = self.engine, self.outbox
        run: list[SendBatch] = []
        for b in [*engine.send_batches(), None]:
            if run and (b is None or b.node != run[0].node):
                peer = self.peers[run[0].node]
                if peer.health is not None:
                    peer.tx_job = self.spec.job
                    peer.health.touch(now)
                if len(run) == 1:
                    ob.push_many(peer, run[0].datagrams, run[0].priorities)
                else:
                    dgs: list[bytes] = []
                    prios: list[int] = []
                    for x in run:
                        dgs += x.datagrams
                        prios += x.priorities
                    ob.push_many(peer, dgs, prios)
                run = []
            if b is not None and b.datagrams:
                run.append(b)
        while (ev := engine.next_event()) is not None:
            self.on_event(self, ev, now)
        if ob.multipath:
            for peer, path in self.prober.run(now):
                ob.path_down(peer, path, now)
        if ob.backlog and not ob.blocked:
            ob.flush(now)
            self.stalls += bool(ob.backlog and ob.next_wake is None and not self.polling)
        engine.drop_settled()
        self._arm(now)

    def _arm(self, now: float) -> None:
        if self.polling:
            t = self.poll_at
        else:
            t = self.engine.get_timer()
            wake = self.outbox.next_wake
            if wake is not None and (t is None or wake < t):
                t = wake
            if self.outbox.multipath:
                probe = self.prober.next_timer()
                if probe is not None and (t is None or probe < t):
                    t = probe
        if t is not None and t != self.timer.deadline:
            self.timer.set(t)


def _ignore(_name: str) -> None:
    pass
