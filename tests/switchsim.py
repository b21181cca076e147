"""A virtual-time cluster: engines, the daemon's send scheduler, a shaped switch.

Each host is one `Engine` and one `Outbox` glued as `dlcp.daemon.server.Daemon`
glues them (no flow-control credits), configured as the benchmark configures
the daemons. Each host's downlink is a switch egress port as the testbed
builds it (dlcp/tc/plan.py): its rate counts wire bytes (UDP payload + 42),
eight classes by DSCP in strict priority, a pfifo per class (1000 packets, 16
for the droppable class 7; HTB's small guaranteed rates left out). Uplinks
are unshaped unless `uplink_bps` is given. With `paths` > 1 every host has
that many ports, one a path (a switch plane each), and the daemons probe
their paths as `Daemon` does (dlcp/daemon/probing.py); `set_port` takes one
host's port on one path down (nothing crosses it) or up. Deterministic: one
event heap in (time, sequence number) order, nothing random, nothing sleeps.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from dlcp.bench.cluster import Setup, dlcp_daemon_config
from dlcp.core.engine import Engine, JobSpec, RoundComplete, SendBatch
from dlcp.core.layout import Layout
from dlcp.core.pathhealth import health_config
from dlcp.core.rate import WIRE_OVERHEAD
from dlcp.daemon.config import Config, parse
from dlcp.daemon.outbox import Outbox, Peer
from dlcp.daemon.probing import Prober
from dlcp.daemon.transport import NATIVE_SEND, UdpPath
from dlcp.policies import apply_droppable, from_config
from dlcp.tc.plan import TcConfig
from dlcp.wire import Codec, PacketType
from dlcp.wire.header import HEADER_SIZE
from dlcp.wire.probe import probe_of

TC = TcConfig(dev="sim", rate_bps=10**9)  # the testbed's queues (its defaults)
KEY, JOB, PORT = b"switchsim-key-32-bytes-long-...!", 1, 7400
N_LAYERS = 16  # the benchmark's synthetic layers (dlcp/bench/ar_worker.py)
_ACKING = (PacketType.RESULT, PacketType.ACK, PacketType.DONE)  # the daemon's _ACKING
# (source host, destination host, TOS byte, datagram, path)
Item = tuple[int, int, int, bytes, int]


def address(host: int, path: int = 0) -> str:
    return f"10.9.{path}.{host + 1}"


def line_time(elements: int, hosts: int, link_bps: float, payload: int = 1408) -> float:
    """Seconds a transpose all-reduce of `elements` fp32 takes at line rate: each
    downlink carries 2 (H - 1) / H of the bucket's wire bytes (with a 64-byte
    dlcp header and 42 bytes of Ethernet, IP and UDP a packet)."""
    lay = Layout(total=elements, codec=Codec.FP32, shards=hosts, payload=payload)
    wire = 4 * elements + lay.packets * (64 + WIRE_OVERHEAD)
    return 2 * (hosts - 1) / hosts * wire * 8 / link_bps


def _ignore(_name: str) -> None:
    pass


def bench_config(hosts: int, link_bps: float, pacing: str = "link") -> Config:
    """The daemons' config as `dlcp bench allreduce` makes it."""
    setup = Setup(hosts=hosts, rate_bps=int(link_bps), pacing=pacing)
    return parse(dlcp_daemon_config(setup, "dlcp"))


@dataclass
class Port:
    """An egress port: sends wire bytes at `rate_bps`, class 0 first, FIFO in a
    class of at most `limits[c]` packets (more are dropped); `deliver(item)`
    takes a packet as its last bit leaves."""

    rate_bps: float
    limits: Sequence[int]
    deliver: Callable[[Item], None]
    queues: list[deque[Item]] = field(default_factory=lambda: [deque() for _ in range(8)])
    busy: bool = False
    drops: Counter[int] = field(default_factory=Counter)  # per class
    depth: list[int] = field(default_factory=lambda: [0] * 8)  # each queue's deepest


@dataclass
class RoundResult:
    host: int
    round: int
    start: float  # when the host submitted it
    end: float  # when it completed (or failed) there
    lost_lanes: int = 0  # as `RoundComplete.lost_lanes` says (what the ranks are told)
    short_lanes: int = 0  # lanes summed without every contribution (`contributors`)
    failed: str | None = None


class Backlog(dict[Peer, None]):
    """An insertion-ordered stand-in for `Outbox.backlog`, a set of peers that
    hash by id: flushed in the same order every run (the daemon's order is
    whatever the set's is)."""

    def add(self, peer: Peer) -> None:
        self[peer] = None

    def discard(self, peer: Peer) -> None:
        self.pop(peer, None)


class FakePath:
    """What `Outbox` needs of a `UdpPath`: `address` and `send`, which hands
    every datagram to the simulator (the socket never fills)."""

    def __init__(self, sim: SwitchSim, host: int, path: int = 0) -> None:
        self.sim, self.host, self.path, self.gso = sim, host, path, True
        self.address = address(host, path)

    def send(self, datagrams: Sequence[bytes], dest: tuple[str, int], tos: int) -> int:
        dst = self.sim.host_of[dest[0]]
        for dg in datagrams:  # read now, as the kernel copies a datagram when sent
            dg = dg if isinstance(dg, bytes) else bytes(dg)
            self.sim.inject(self.host, dst, tos, dg, self.path)
        return len(datagrams)


class SimHost:
    """One daemon: its engine, its outbox over one fake path, its rounds.
    `stalls`: flushes that left packets queued with no wake-up asked for (they
    wait for whatever comes next: a datagram or an engine timer)."""

    def __init__(self, sim: SwitchSim, me: int, config: Config, gather: bool) -> None:
        self.sim, self.me = sim, me
        self.engine = Engine(timing=config.timing, gather=gather)
        self.engine.add_job(JobSpec.transpose(JOB, KEY, me, sim.n_hosts, payload=config.payload))
        self.paths = [FakePath(sim, me, p) for p in range(sim.n_paths)]
        self.outbox = Outbox(
            cast("list[UdpPath]", self.paths),
            dscp=config.dscp,
            rate=config.rate,
            pacing=config.pacing,
            balancer_factory=lambda: from_config("balance", config.balance),
            health=health_config(config.probe_interval_s),
        )
        self.outbox.backlog = cast("set[Peer]", Backlog())
        self.prober = Prober(
            lambda: self.outbox.multipath,
            self.engine,
            lambda: self.outbox.tos[0],
            _ignore,
            budget=config.probe_budget,
        )
        others = [n for n in range(sim.n_hosts) if n != me]
        self.peers: dict[int, Peer] = {
            n: self.outbox.peer(tuple(address(n, p) for p in range(sim.n_paths)), PORT, 0.0)
            for n in others
        }
        # `Credits.size_windows`' pacing cap: each peer hears from the others
        cap = config.rate.fan_in_rate(len(others))
        if cap is not None:
            for peer in self.peers.values():
                peer.rate.set_max_rate(cap)
        self.armed: float | None = None  # the wake-up in the heap (`SwitchSim.arm`)
        self.results: list[RoundResult] = []
        self.started: dict[int, float] = {}
        self.stalls = 0

    def receive(self, src: int, dg: bytes, now: float) -> None:
        """`NetworkIn._receive` of one datagram: the engine, then a NACK to the
        outbox, the bytes of an acknowledging packet to the peer's rate."""
        h = self.engine.receive(dg, now, src=src)
        peer = self.peers[src]
        if h is not None and peer.health is not None:
            peer.rx_job = JOB
            peer.health.touch(now)
        if h is not None and h.type == PacketType.CONTROL:
            probe = probe_of(dg[HEADER_SIZE:])
            if probe is not None:
                self.prober.on_probe(peer, JOB, probe, now)
        elif h is not None and h.type == PacketType.NACK:
            if h.count:
                self.outbox.on_loss(peer, h.count, now)
            shards = self.sim.n_hosts
            self.outbox.on_nack(peer, h, dg, shards=shards, payload=self.sim.payload, now=now)
        elif h is not None and h.type in _ACKING:
            peer.rate.on_ack(len(dg), None, now)

    def pump(self, now: float) -> None:
        """`Daemon._pump`: the engine's batches into the outbox (a run of batches
        for one peer at once), its events, a flush; then the next wake-up."""
        run: list[SendBatch] = []
        for b in [*self.engine.send_batches(), None]:
            if run and (b is None or b.node != run[0].node):
                dgs = [dg for x in run for dg in x.datagrams]
                prios = [p for x in run for p in x.priorities]
                peer = self.peers[run[0].node]
                if peer.health is not None:
                    peer.tx_job = JOB
                    peer.health.touch(now)
                self.outbox.push_many(peer, dgs, prios)
                run = []
            if b is not None and b.datagrams:
                run.append(b)
        while (ev := self.engine.next_event()) is not None:
            res = RoundResult(self.me, ev.round, self.started[ev.round], now)
            if isinstance(ev, RoundComplete):
                res.lost_lanes = int(ev.lost_lanes)
                short = np.asarray(ev.contributors) < self.sim.n_hosts
                res.short_lanes = int(ev.layout.packet_counts()[short].sum())
                self.sim.round_done(self, ev.round, now)
            else:
                res.failed = ev.reason
            self.results.append(res)
        ob = self.outbox
        if ob.multipath:
            for peer, path in self.prober.run(now):
                ob.path_down(peer, path, now)
        if ob.backlog and not ob.blocked:
            ob.flush(now)
            self.stalls += bool(ob.backlog and ob.next_wake is None and not ob.blocked)
        self.engine.drop_settled()
        self.sim.arm(self, now)

    def on_timer(self, now: float) -> None:
        t = self.engine.get_timer()
        if t is not None and t <= now:
            self.engine.handle_timer(now)
        self.pump(now)


class SwitchSim:
    """`hosts` hosts on one switch (see the module's docstring). `config`: the
    daemons' (default `bench_config`; its window is not used); `delay`: host
    to host, half on each link; `gather`: the engines' (the daemon's: whether
    its C send path is built); `next_round(host, r, now)` is told each round
    `r - 1` that completes."""

    def __init__(
        self,
        hosts: int = 3,
        *,
        link_bps: float = 200e6,
        config: Config | None = None,
        uplink_bps: float | None = None,
        delay: float = 50e-6,
        queue_packets: int = TC.queue_packets,
        short_queue_packets: int = TC.short_queue_packets,
        gather: bool = NATIVE_SEND,
        max_events: int = 10_000_000,
        loss: float = 0.0,
        loss_seed: int = 0,
        paths: int = 1,
    ) -> None:
        self.config = config = config or bench_config(hosts, link_bps)
        self.n_hosts, self.payload, self.delay = hosts, config.payload, delay
        self.n_paths = paths
        self.class_of_tos = {d << 2: c for c, d in enumerate(config.dscp)}
        self.host_of = {address(h, p): h for h in range(hosts) for p in range(paths)}
        self.dead: set[tuple[int, int]] = set()  # (host, path): ports set down
        self.port_loss: dict[tuple[int, int], float] = {}  # (host, path): loss both ways
        self.dead_drops = 0
        self.now, self.events_left = 0.0, max_events
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        short = TC.droppable_classes
        limits = [short_queue_packets if c in short else queue_packets for c in range(8)]
        # per path, then host
        self.down = [
            [Port(link_bps, limits, self._arrive) for _ in range(hosts)] for _ in range(paths)
        ]
        self.up = [
            [
                None if uplink_bps is None else Port(uplink_bps, limits, self._hop)
                for _ in range(hosts)
            ]
            for _ in range(paths)
        ]
        self.hosts = [SimHost(self, h, config, gather) for h in range(hosts)]
        self.next_round: Callable[[SimHost, int, float], None] | None = None
        # random loss at the switch ports' ingress (the testbed's nftables "in")
        self.loss, self._loss_rng, self.lost = loss, random.Random(loss_seed), 0

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def arm(self, host: SimHost, now: float) -> None:
        """`Daemon._arm`: wake `host` at its engine's timer or its outbox's wake-up."""
        t, wake = host.engine.get_timer(), host.outbox.next_wake
        if wake is not None and not host.outbox.blocked and (t is None or wake < t):
            t = wake
        probe = host.prober.next_timer() if host.outbox.multipath else None
        if probe is not None and (t is None or probe < t):
            t = probe
        if t is not None and t != host.armed:
            host.armed = t
            self.at(max(t, now), self._timer, host, t)

    def _timer(self, host: SimHost, t: float) -> None:
        if host.armed == t:  # else armed again since
            host.armed = None
            host.on_timer(self.now)

    def run(self, until: float, done: Callable[[], bool] | None = None) -> None:
        """Handle events in order until none is left, `done()`, or `until`."""
        while self._heap and self._heap[0][0] <= until and not (done and done()):
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = max(self.now, t)
            self.events_left -= 1
            if self.events_left < 0:
                raise RuntimeError(f"too many events by t={self.now:.6f}")
            fn(*args)

    def set_port(self, host: int, path: int, up: bool) -> None:
        """Host `host`'s switch port on `path` up or down: while down, what
        `host` sends on that path and what goes to it there is dropped."""
        if up:
            self.dead.discard((host, path))
        else:
            self.dead.add((host, path))

    def set_port_loss(self, host: int, path: int, loss: float) -> None:
        """Random loss `loss` (0..1) on host `host`'s port on `path`, both ways."""
        self.port_loss[(host, path)] = loss

    def inject(self, src: int, dst: int, tos: int, dg: bytes, path: int = 0) -> None:
        """A datagram leaves host `src`'s socket for host `dst` on `path`."""
        if (src, path) in self.dead:
            self.dead_drops += 1
            return
        up = self.up[path][src]
        if up is not None:
            self._offer(up, (src, dst, tos, dg, path))
        else:
            self._hop((src, dst, tos, dg, path))

    def _hop(self, item: Item) -> None:  # the link from a host to the switch
        self.at(self.now + self.delay / 2, self._to_switch, item)

    def _to_switch(self, item: Item) -> None:
        if self.loss and self._loss_rng.random() < self.loss:
            self.lost += 1
            return
        if (item[1], item[4]) in self.dead or (item[0], item[4]) in self.dead:
            self.dead_drops += 1
            return
        if self.port_loss:
            p = max(self.port_loss.get((h, item[4]), 0.0) for h in item[:2])
            if p and self._loss_rng.random() < p:
                self.lost += 1
                return
        self._offer(self.down[item[4]][item[1]], item)

    def _offer(self, port: Port, item: Item) -> None:
        cls = self.class_of_tos.get(item[2] & 0xFC, TC.default_class)
        q = port.queues[cls]
        if len(q) >= port.limits[cls]:
            port.drops[cls] += 1
            return
        q.append(item)
        port.depth[cls] = max(port.depth[cls], len(q))
        if not port.busy:
            self._serve(port)

    def _serve(self, port: Port) -> None:
        port.busy = False
        for q in port.queues:
            if q:
                item = q.popleft()
                port.busy = True
                wire = len(item[3]) + WIRE_OVERHEAD
                self.at(self.now + wire * 8 / port.rate_bps, self._sent, port, item)
                return

    def _sent(self, port: Port, item: Item) -> None:
        port.deliver(item)
        self._serve(port)

    def _arrive(self, item: Item) -> None:
        self.at(self.now + self.delay / 2, self._deliver, item)

    def _deliver(self, item: Item) -> None:
        host = self.hosts[item[1]]
        host.receive(item[0], item[3], self.now)
        host.pump(self.now)

    def round_done(self, host: SimHost, r: int, now: float) -> None:
        if self.next_round is not None:  # it schedules the submit: no pump within a pump
            self.next_round(host, r + 1, now)

    def drops(self) -> Counter[int]:
        """Switch drops per class, all ports together."""
        out: Counter[int] = Counter()
        for p in [q for ports in (*self.down, *self.up) for q in ports]:
            if p is not None:
                out.update(p.drops)
        return out


def contribution(
    x: np.ndarray, lay: Layout, bound: float, config: Config
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(classes, droppable, layers) of a host's bucket as `RoundLifecycle._start_round`
    makes them with its policies: the benchmark's N_LAYERS equal layers,
    per-packet L2 norms, droppable packets chosen per shard within `bound`."""
    n, per = lay.packets, lay.per_packet
    counts = lay.packet_counts()
    padded = np.zeros(n * per, np.float64)
    padded[: x.size] = x
    norms = np.sqrt((padded.reshape(n, per) ** 2).sum(axis=1))
    layers = (np.arange(n, dtype=np.int64) * per * N_LAYERS // x.size).clip(0, N_LAYERS - 1)
    priority = from_config("priority", {**config.priority, "dscp": list(config.dscp)})
    n_layers = int(layers.max()) + 1
    classes = priority.classify(layers=layers, n_layers=n_layers, norms=norms, counts=counts)
    drop = np.zeros(n, dtype=bool)
    policy = from_config("drop", config.drop)
    for s in range(lay.shards):
        r = lay.shard_packets(s)
        if bound > 0 and len(r):
            drop[r.start : r.stop] = policy.droppable(
                norms=norms[r.start : r.stop], counts=counts[r.start : r.stop], bound=bound
            )
    return apply_droppable(classes, drop), drop, layers.astype(np.uint16)


def bench_data(elements: int, hosts: int, seed: int = 0, block: int = 352) -> list[np.ndarray]:
    """Each host's buffer as the benchmark makes it: random integers / 2^15 times
    per-block powers of two shared by all hosts, larger at the front."""
    rng = np.random.default_rng(seed)
    blocks = -(-elements // block)
    front = np.arange(blocks) < max(1, blocks // 8)
    exp = np.minimum(rng.integers(-8, 1, blocks) + 2 * front, 1)
    scale = np.repeat(np.ldexp(1.0, exp), block)[:elements]
    ints = [
        np.random.default_rng([seed, h]).integers(-(2**15), 2**15, elements, np.int32)
        for h in range(hosts)
    ]
    return [(i * 2.0**-15 * scale).astype("<f4") for i in ints]


@dataclass
class RunResult:
    """What `run_rounds` measured: each host's rounds in order, the switch's
    drops per class, a round's line-rate time, and the simulator."""

    rounds: list[list[RoundResult]]
    drops: Counter[int]
    line_time: float
    sim: SwitchSim

    def round_times(self) -> list[float]:
        """Each round's time from its last submit (no transport can complete it
        before every contribution is in) to its last completion."""
        n = min(len(rs) for rs in self.rounds)
        return [
            max(rs[r].end for rs in self.rounds) - max(rs[r].start for rs in self.rounds)
            for r in range(n)
        ]


def run_rounds(
    rounds: int = 4,
    elements: int = 1 << 19,
    hosts: int = 3,
    *,
    link_bps: float = 200e6,
    bound: float = 0.05,
    seed: int = 0,
    think: Sequence[float] = (),
    skew: Sequence[float] = (),
    until: float | None = None,
    at: Sequence[tuple[float, Callable[[SwitchSim], None]]] = (),
    **options: Any,
) -> RunResult:
    """`rounds` back-to-back all-reduce rounds of one bucket of `elements` fp32
    (transpose mode, the benchmark's data, the daemon's policies with loss bound
    `bound`): host h submits round 0 at `skew[h]` and round r + 1 `think[h]`
    seconds (its worker's decode and submit) after its round r completes, as
    the benchmark's worker does (0 where not given); each `(t, fn)` of `at`
    calls fn(sim) at virtual time t (e.g. a port set down). `options` go to
    `SwitchSim`."""
    sim = SwitchSim(hosts, link_bps=link_bps, **options)
    lay = Layout(total=elements, codec=Codec.FP32, shards=hosts, payload=sim.payload)
    xs = bench_data(elements, hosts, seed)
    parts = [contribution(x, lay, bound, sim.config) for x in xs]

    def submit(host: SimHost, r: int, now: float) -> None:
        if r < rounds:
            classes, drop, layers = parts[host.me]
            host.started[r] = now
            host.engine.submit(
                job=JOB, round=r, bucket=0, codec=Codec.FP32, total=elements, lanes=xs[host.me],
                now=now, classes=classes, droppable=drop, layers=layers, bound=bound,
            )  # fmt: skip
            host.pump(now)

    def next_round(host: SimHost, r: int, now: float) -> None:
        t = now + (think[host.me] if host.me < len(think) else 0.0)
        sim.at(t, submit, host, r, t)

    def finished() -> bool:
        return all(len(h.results) >= rounds or any(r.failed for r in h.results) for h in sim.hosts)

    sim.next_round = next_round
    for t, fn in at:
        sim.at(t, fn, sim)
    for h in sim.hosts:
        t0 = skew[h.me] if h.me < len(skew) else 0.0
        sim.at(t0, submit, h, 0, t0)
    line = line_time(elements, hosts, link_bps, sim.payload)
    sim.run(until if until is not None else 1.0 + 20 * rounds * line, finished)
    return RunResult([h.results for h in sim.hosts], sim.drops(), line, sim)
