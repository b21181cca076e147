"""What a run's network suffers, as the bench's scenarios (dlcp/bench/cluster.py):
random loss on every port, bursts of loss on one port, background load per
port, a link down. Loss and bursts act where the testbed's nftables chains
do: on what a host sends, as it enters its switch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dlcp.bench.cluster import BURST, Burst
from dlcp.sim.fabric import TC, Fabric
from dlcp.sim.port import Packet, Port

__all__ = ["SCENARIOS", "Scenario"]

SCENARIOS: tuple[str, ...] = ("clean", "loss", "burst", "background", "linkdown")
FRAME = 1514  # a background frame's wire bytes


@dataclass(frozen=True)
class Scenario:
    """`loss_pct`: scenario loss, on every host's ingress; `burst`: the bench's
    bursts (host `burst.host`'s ingress); `load`: background, a share of each
    host's downlink in Poisson frames of the default class (unmarked);
    linkdown: host `down_host`'s links down from `down_at_s` for `down_for_s`."""

    name: str = "clean"
    loss_pct: float = 1.0
    burst: Burst = BURST
    load: float = 0.3
    down_host: int = 0
    down_at_s: float = 0.5
    down_for_s: float = 1.0

    def install(self, fabric: Fabric, hosts: int, seed: int) -> None:
        """Arm it on `fabric`, whose nodes 0..hosts-1 are the hosts."""
        loop = fabric.loop
        if self.name == "loss":
            fabric.set_ingress_loss(range(hosts), self.loss_pct / 100)
        elif self.name == "burst":
            port = fabric.up[self.burst.host]
            b = self.burst

            def on() -> None:
                port.loss = b.pct / 100
                loop.at(loop.now + b.length_s, off)

            def off() -> None:
                port.loss = 0.0
                loop.at(loop.now + b.period_s - b.length_s, on)

            loop.at(b.period_s - b.length_s, on)
        elif self.name == "background":
            for h in range(hosts):
                _Background(fabric, fabric.down[h], self.load, random.Random(f"{seed}/bg{h}"))
        elif self.name == "linkdown":
            ports = (fabric.up[self.down_host], fabric.down[self.down_host])

            def down(state: bool) -> None:
                for p in ports:
                    p.set_down(state)

            loop.at(self.down_at_s, down, True)
            if self.down_for_s > 0:
                loop.at(self.down_at_s + self.down_for_s, down, False)


class _Background:
    """Poisson frames into one port at `load` of its rate, taken at its far end."""

    def __init__(self, fabric: Fabric, port: Port, load: float, rng: random.Random) -> None:
        assert port.rate_bps is not None
        self.port, self.rng, self.loop = port, rng, fabric.loop
        self.rate = load * port.rate_bps / (FRAME * 8)  # frames a second
        self.route = (port,)
        if self.rate > 0:
            self.loop.at(rng.expovariate(self.rate), self._send)

    def _send(self) -> None:
        self.port.offer(Packet(TC.default_class, FRAME, -1, -1, self.route, None))
        self.loop.at(self.loop.now + self.rng.expovariate(self.rate), self._send)
