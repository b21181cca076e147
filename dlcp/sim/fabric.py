"""The topology: endpoints (hosts, aggregators) on one switch or on a
leaf-spine fabric, built of `Port`s, and the route of a packet through it.

Every endpoint has an uplink (its NIC: the link to its switch; unshaped, as
the testbed's veths, when `uplink_bps` is None) and a downlink (the switch's
egress port toward it, shaped: the testbed's bottleneck). Leaf-spine: every
leaf has one uplink to each spine and every spine one downlink to each leaf,
each at `hosts_per_leaf * rate / (spines * oversub)`. A packet between leaves
crosses the spine its sender names (`spine`): dlcp's paths each pin one
spine (a source port per path, as a host picks for ECMP to hash), a TCP flow
takes the spine its 5-tuple hashes to (`ecmp_spine`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dlcp.sim.events import EventLoop
from dlcp.sim.port import Packet, Port
from dlcp.tc.plan import TcConfig

__all__ = ["TC", "Fabric", "Topology", "class_limits"]

TC = TcConfig(dev="sim", rate_bps=10**9)  # the testbed's queues (its defaults)
# a host's NIC queue: the sender's socket and qdisc push back rather than drop
# (a datagram the qdisc refuses blocks the daemon's send, `Outbox.blocked`)
NIC_LIMITS = [1 << 20] * 8


def class_limits(
    queue_packets: int = TC.queue_packets, short: int = TC.short_queue_packets
) -> list[int]:
    """Each class's pfifo limit as the tc plan sets it."""
    return [short if c in TC.droppable_classes else queue_packets for c in range(8)]


@dataclass(frozen=True)
class Topology:
    """`kind` single: every host on one switch; leafspine: `hosts_per_leaf`
    hosts a leaf, `spines` spines, fabric links `oversub` times thinner than
    the hosts' links they carry."""

    kind: str = "single"
    rate_bps: float = 200e6
    delay_s: float = 25e-6  # one link's propagation and switching
    uplink_bps: float | None = None  # hosts' NICs (None: unshaped)
    hosts_per_leaf: int = 16
    spines: int = 4
    oversub: float = 2.0
    queue_packets: int = TC.queue_packets
    short_queue_packets: int = TC.short_queue_packets

    @property
    def fabric_bps(self) -> float:
        return self.hosts_per_leaf * self.rate_bps / (self.spines * self.oversub)


class Fabric:
    """Ports and routes. `add_endpoint` attaches a node to a leaf (leaf 0 on
    one switch); its packets go to `deliver(pkt)` of the node they are for."""

    def __init__(self, loop: EventLoop, topo: Topology, seed: int = 0) -> None:
        self.loop, self.topo, self.seed = loop, topo, seed
        self.limits = class_limits(topo.queue_packets, topo.short_queue_packets)
        self.up: list[Port] = []
        self.down: list[Port] = []
        self.leaf_of: list[int] = []
        self.receivers: list[Callable[[Packet], None]] = []
        self.leaf_up: list[list[Port]] = []  # [leaf][spine]
        self.spine_down: list[list[Port]] = []  # [spine][leaf]
        self._routes: dict[tuple[int, int, int], tuple[Port, ...]] = {}

    @property
    def spines(self) -> int:
        return self.topo.spines if self.topo.kind == "leafspine" else 1

    def _ensure_leaf(self, leaf: int) -> None:
        t = self.topo
        if t.kind != "leafspine":
            return
        while len(self.leaf_up) <= leaf:
            n = len(self.leaf_up)
            self.leaf_up.append(
                [
                    Port(self.loop, f"leaf{n}-spine{s}", t.fabric_bps, t.delay_s, self.limits,
                         self._deliver, tier="leaf-up", seed=self.seed)
                    for s in range(t.spines)
                ]
            )  # fmt: skip
            for s in range(t.spines):
                if len(self.spine_down) <= s:
                    self.spine_down.append([])
                self.spine_down[s].append(
                    Port(self.loop, f"spine{s}-leaf{n}", t.fabric_bps, t.delay_s, self.limits,
                         self._deliver, tier="spine-down", seed=self.seed)
                )  # fmt: skip

    def add_endpoint(
        self, leaf: int, receive: Callable[[Packet], None], rate_bps: float | None = None,
        uplink_bps: float | None = None, delay_s: float | None = None,
    ) -> int:  # fmt: skip
        """A node on `leaf` (its links at the topology's rates unless given); its id."""
        t = self.topo
        node = len(self.up)
        self._ensure_leaf(leaf)
        d = t.delay_s if delay_s is None else delay_s
        up = t.uplink_bps if uplink_bps is None else uplink_bps
        down = t.rate_bps if rate_bps is None else rate_bps
        self.up.append(Port(self.loop, f"n{node}-up", up, d, NIC_LIMITS, self._deliver,
                            tier="host-up", seed=self.seed))  # fmt: skip
        self.down.append(Port(self.loop, f"n{node}-down", down, d, self.limits, self._deliver,
                              tier="host-down", seed=self.seed))  # fmt: skip
        self.leaf_of.append(leaf)
        self.receivers.append(receive)
        return node

    def _deliver(self, pkt: Packet) -> None:
        if pkt.dst >= 0:  # (background frames end where they are taken)
            self.receivers[pkt.dst](pkt)

    def route(self, src: int, dst: int, spine: int = 0) -> tuple[Port, ...]:
        key = (src, dst, spine)
        r = self._routes.get(key)
        if r is None:
            a, b = self.leaf_of[src], self.leaf_of[dst]
            if self.topo.kind != "leafspine" or a == b:
                r = (self.up[src], self.down[dst])
            else:
                s = spine % self.topo.spines
                r = (self.up[src], self.leaf_up[a][s], self.spine_down[s][b], self.down[dst])
            self._routes[key] = r
        return r

    def ecmp_spine(self, src: int, dst: int, flow: int) -> int:
        """The spine a flow's 5-tuple hashes to (seeded: another seed, other collisions)."""
        h = zlib.crc32(f"{self.seed}:{src}:{dst}:{flow}".encode())
        return h % self.spines

    def send(self, src: int, dst: int, cls: int, wire: int, data: object, spine: int = 0) -> None:
        """A frame leaves `src`'s NIC toward `dst`."""
        route = self.route(src, dst, spine)
        route[0].offer(Packet(cls, wire, src, dst, route, data))

    def send_frames(
        self, src: int, dst: int, cls: int, frames: Sequence[bytes], overhead: int, spine: int = 0
    ) -> None:
        """`send` of each of `frames` in order (wire bytes: its length plus
        `overhead`), the route looked up once: a host's batch of datagrams,
        one heap entry for all of them off an unshaped NIC."""
        route = self.route(src, dst, spine)
        first = route[0]
        if first.rate_bps is None and len(frames) > 1:
            first.offer_many([Packet(cls, len(b) + overhead, src, dst, route, b) for b in frames])
            return
        offer = first.offer
        for b in frames:
            offer(Packet(cls, len(b) + overhead, src, dst, route, b))

    def ports(self) -> list[Port]:
        out = [*self.up, *self.down]
        for row in (*self.leaf_up, *self.spine_down):
            out += row
        return out

    def set_ingress_loss(self, nodes: Sequence[int], p: float) -> None:
        """Random loss `p` on what `nodes` send, as it enters their switch (the
        testbed's `--loss`: netdev ingress on the switch port)."""
        for n in nodes:
            self.up[n].loss = p
