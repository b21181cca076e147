"""dlcp's rounds in the simulator: the job's nodes (hosts, and the aggregators of
"ps" and "switch"), each a `DlcpHost`, and the rounds driven as the bench's
workers drive them: every contributor submits at once, a round's time is the
slowest contributor's, the next starts once all are done (the bench's "go").
A DDP-like step (`buckets` > 1) releases its buckets evenly over `backward_s`.

Modes as the daemon builds them (`RoundsMixin._make_job`): transpose, every
host owns a shard; "ps", one aggregator a leaf, a node of its own at the
host's line rate, owning a shard each; "switch", the aggregator is in the ToR:
on one switch `JobSpec.switch` (8 shards, pipelined), on a leaf-spine one per
leaf owning a shard each, attached to its leaf at the leaf's whole host
bandwidth (no hierarchical sum across leaves: each ToR's aggregator takes
every host's packets of its shard).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dlcp.bench.cluster import Setup, dlcp_daemon_config
from dlcp.core.engine import JobSpec, RoundComplete, RoundFailed
from dlcp.core.pathhealth import PathStatus
from dlcp.daemon.config import Config, parse
from dlcp.sim.events import EventLoop
from dlcp.sim.fabric import Fabric
from dlcp.sim.host import DlcpHost
from dlcp.sim.settings import Settings
from dlcp.sim.workload import Contribution, bench_buffers, contribution, layout_of
from dlcp.wire import Codec

__all__ = ["DlcpRun", "daemon_config"]

KEY, JOB = b"dlcp-simulate-key-32-bytes-long!", 1


def daemon_config(hosts: int, link_bps: float, balance: str = "spray") -> Config:
    """The daemons' config as `dlcp bench allreduce` writes it."""
    setup = Setup(hosts=max(2, hosts), rate_bps=int(link_bps))
    raw = dlcp_daemon_config(setup, "dlcp")
    if balance == "ecmp":
        raw["policies"]["balance"] = "flow"
    return parse(raw)


@dataclass
class Step:
    start: float
    starts: dict[int, float] = field(default_factory=dict)  # node -> its first submit
    ends: dict[tuple[int, int], float] = field(default_factory=dict)  # (node, bucket) -> t
    lost: int = 0
    total: int = 0
    failed: list[str] = field(default_factory=list)


class DlcpRun:
    """Builds the nodes on a fabric and runs `warmup + iters` steps."""

    def __init__(self, s: Settings, progress: Callable[[int, int], None] | None = None) -> None:
        self.s, self.progress = s, progress
        self.loop = EventLoop()
        self.fabric = Fabric(self.loop, s.topo(), seed=s.seed)
        H = s.hosts
        hpl = self.fabric.topo.hosts_per_leaf
        spray = s.topology == "leafspine" and s.balance == "spray"
        paths = self.fabric.spines if spray else 1
        self.aggs: list[int] = []
        if s.mode in ("ps", "switch"):
            self.aggs = list(range(H, H + s.leaves))
        n = H + len(self.aggs)
        self.hosts: list[DlcpHost] = []
        for node in range(n):
            leaf = node // hpl if node < H else node - H
            rate = None
            if node >= H and s.mode == "switch":
                rate = hpl * s.rate_bps  # the ToR's own aggregator: its whole host bandwidth
            link = rate or s.rate_bps
            config = daemon_config(n, link, s.balance)
            if s.probe_budget is not None:
                config.probe_budget = s.probe_budget
            spec = self._spec(node, n, config.mac)
            h = DlcpHost(self.fabric, spec, s.mode, config, n, paths, self._on_event)
            got = self.fabric.add_endpoint(
                leaf, h.on_packet, rate_bps=rate, uplink_bps=rate,
                delay_s=1e-6 if rate else None,
            )  # fmt: skip
            assert got == node
            self.hosts.append(h)
        self.config = self.hosts[0].engine  # (for tests: the engine of node 0)
        self.payload = daemon_config(n, s.rate_bps).payload
        self.steps: list[Step] = []
        self.finished_at = 0.0  # when the last step completed everywhere
        self.contributors = list(range(H))
        s.scenario.install(self.fabric, H, s.seed)
        per = max(1, s.elements // s.buckets)
        self.sizes = [per] * (s.buckets - 1) + [s.elements - per * (s.buckets - 1)]
        cfg = daemon_config(n, s.rate_bps)
        self.parts: list[list[Contribution]] = []  # [bucket][host]
        shards = len(self.hosts[0].spec.owners)
        for b, size in enumerate(self.sizes):
            lay = layout_of(size, shards, self.payload)
            xs = bench_buffers(size, H, s.seed + b)
            self.parts.append([contribution(x, lay, s.loss_bound, cfg) for x in xs])
        self.rng = random.Random(f"{s.seed}/skew")
        self.results: dict[tuple[int, int, int], Any] = {}  # (step, bucket, node) -> event

    def _spec(self, me: int, n: int, mac: str) -> JobSpec:
        """The job as `RoundsMixin._make_job` builds it, with the daemon's MAC."""
        s = self.s
        if s.mode == "transpose":
            return JobSpec.transpose(JOB, KEY, me, n, payload=1408, mac=mac)
        if s.mode == "switch" and len(self.aggs) == 1:
            return JobSpec.switch(JOB, KEY, me, n, payload=1408, mac=mac)
        return JobSpec(
            job=JOB, key=KEY, me=me, contributors=tuple(range(s.hosts)),
            owners=tuple(self.aggs), payload=1408, mac=mac,
        )  # fmt: skip

    # -- driving ---------------------------------------------------------------
    def _submit(self, step: int, bucket: int, h: int) -> None:
        now = self.loop.now
        if bucket == 0:
            self.steps[step].starts[h] = now
        if True:
            c = self.parts[bucket][h]
            host = self.hosts[h]
            host.engine.submit(
                job=JOB, round=step, bucket=bucket, codec=Codec.FP32, total=c.lanes.size,
                lanes=c.lanes, now=now, classes=c.classes, droppable=c.droppable,
                layers=c.layers, bound=self.s.loss_bound, class_bounds=c.class_bounds,
            )  # fmt: skip
            host.pump(now)

    def _start_step(self) -> None:
        s, now = self.s, self.loop.now
        k = len(self.steps)
        self.steps.append(Step(now))
        for h in self.contributors:
            # the ranks' starts are not in step: the bench's "go" reaches each
            # worker through its own pipe, and the daemons' polls have their own phase
            skew = self.rng.uniform(0.0, s.skew_s)
            for b in range(s.buckets):
                t = now + skew + ((b + 1) * s.backward_s / s.buckets if s.buckets > 1 else 0.0)
                self.loop.at(t, self._submit, k, b, h)

    def _on_event(self, host: DlcpHost, ev: RoundComplete | RoundFailed, now: float) -> None:
        if host.me not in self.contributors or ev.round >= len(self.steps):
            return
        st = self.steps[ev.round]
        st.ends[(host.me, ev.bucket)] = now
        if isinstance(ev, RoundComplete):
            st.lost += int(ev.lost_lanes)
            st.total += int(ev.total_lanes)
        else:
            st.failed.append(f"host {host.me} bucket {ev.bucket}: {ev.reason}")
        if len(st.ends) == len(self.contributors) * self.s.buckets:
            self.finished_at = now
            if self.progress is not None:
                self.progress(len(self.steps), self.s.warmup + self.s.iters)
            if len(self.steps) < self.s.warmup + self.s.iters:
                self.loop.at(now + self.s.gap_s, self._start_step)

    def run(self) -> list[Step]:
        total = self.s.warmup + self.s.iters
        self.loop.at(0.0, self._start_step)

        def done() -> bool:
            return (
                len(self.steps) == total
                and len(self.steps[-1].ends) == len(self.contributors) * self.s.buckets
            )

        self.loop.run(total * (self.s.timeout_s + 1), done, check=256)
        return self.steps[self.s.warmup :]

    def probe_counts(self) -> dict[str, int]:
        """Path probes sent, echoes of them received, how often due probes
        waited for the probe budget, and the paths' moves to suspect and to
        down, over all hosts (warm-up rounds too)."""
        healths = [p.health for h in self.hosts for p in h.peers.values() if p.health]
        moves: Counter[PathStatus] = Counter()
        for x in healths:
            for (_path, st), k in x.transitions.items():
                moves[st] += k
        return {
            "sent": sum(x.probes_sent for x in healths),
            "echoed": sum(x.echoes for x in healths),
            "held": sum(h.prober.plan.held for h in self.hosts),
            "to_suspect": moves[PathStatus.SUSPECT],
            "to_down": moves[PathStatus.DOWN],
        }

    def times(self, steps: list[Step]) -> list[float]:
        n = len(self.contributors) * self.s.buckets
        out = []
        for st in steps:
            if len(st.ends) == n:  # each rank's own time, from its submit; the slowest
                out.append(max(t - st.starts[h] for (h, _), t in st.ends.items()))
        return out
