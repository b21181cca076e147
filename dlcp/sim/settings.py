"""One simulation's settings (the command's arguments, validated)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dlcp.errors import LocalError
from dlcp.sim.fabric import Topology
from dlcp.sim.scenario import SCENARIOS, Scenario

__all__ = ["BACKENDS", "MODES", "Settings"]

MODES: tuple[str, ...] = ("transpose", "ps", "switch")
BACKENDS: tuple[str, ...] = ("dlcp", "ring")
BALANCE: tuple[str, ...] = ("spray", "ecmp")


@dataclass(frozen=True)
class Settings:
    hosts: int = 3
    topology: str = "single"
    oversub: float = 2.0
    hosts_per_leaf: int = 16
    spines: int = 4
    rate_bps: float = 200e6
    size_bytes: int = 10_000_000
    scenario: Scenario = field(default_factory=Scenario)
    iters: int = 10
    warmup: int = 2
    mode: str = "transpose"
    balance: str = "spray"  # dlcp over a leaf-spine: spray (a path a spine) or ecmp
    loss_bound: float = 0.05  # the bench's
    delay_s: float | None = None  # a link's; default 25 us one switch, 2 us leaf-spine
    buckets: int = 1  # > 1: a DDP-like step of that many buckets ...
    backward_s: float = 0.0  # ... released evenly over this backward time
    seed: int = 0
    probe_budget: int | None = None  # the daemons' [network] probe_budget (None: its default)
    gap_s: float = 1e-3  # between a round's end everywhere and the next start (the bench's "go")
    skew_s: float = 2e-3  # each rank's start within this of the step's (the daemon's poll period)
    timeout_s: float = 60.0  # virtual seconds a round may take before the run gives up

    def __post_init__(self) -> None:
        sc = self.scenario
        checks = [
            (self.hosts >= 2, f"--hosts must be at least 2, not {self.hosts}"),
            (self.hosts <= 256, f"--hosts must be at most 256, not {self.hosts}"),
            (self.topology in ("single", "leafspine"),
             f"--topology: single or leafspine, not {self.topology!r}"),
            (self.mode in MODES, f"--mode must be one of {', '.join(MODES)}, not {self.mode!r}"),
            (self.balance in BALANCE, f"--balance must be spray or ecmp, not {self.balance!r}"),
            (sc.name in SCENARIOS,
             f"--scenario must be one of {', '.join(SCENARIOS)}, not {sc.name!r}"),
            (math.isfinite(self.rate_bps) and self.rate_bps > 0,
             "--rate must be a positive rate (e.g. 200mbit)"),
            (math.isfinite(self.oversub) and self.oversub >= 1,
             f"--oversub must be >= 1, not {self.oversub}"),
            (self.size_bytes >= 4, f"--size must be at least 4 bytes, not {self.size_bytes}"),
            (self.iters >= 1, f"--iters must be at least 1, not {self.iters}"),
            (self.warmup >= 0, f"--warmup must be >= 0, not {self.warmup}"),
            (self.buckets >= 1, f"--buckets must be >= 1, not {self.buckets}"),
            (self.probe_budget is None or self.probe_budget >= 0,
             f"--probe-budget must be >= 0, not {self.probe_budget}"),
            (self.backward_s >= 0, f"--backward must be >= 0, not {self.backward_s}"),
            (0 <= sc.loss_pct <= 100, f"--loss must be a percentage 0..100, not {sc.loss_pct}"),
            (0 <= self.loss_bound < 1, f"--loss-bound must be in [0, 1), not {self.loss_bound}"),
            (self.hosts_per_leaf >= 1 and self.spines >= 1,
             "--hosts-per-leaf and --spines must be >= 1"),
        ]  # fmt: skip
        for ok, msg in checks:
            if not ok:
                raise LocalError(msg)

    @property
    def leaves(self) -> int:
        if self.topology == "single":
            return 1
        return -(-self.hosts // self.hosts_per_leaf)

    def topo(self) -> Topology:
        leafspine = self.topology == "leafspine"
        delay = self.delay_s if self.delay_s is not None else (2e-6 if leafspine else 25e-6)
        return Topology(
            kind=self.topology,
            rate_bps=self.rate_bps,
            delay_s=delay,
            # a real NIC on a leaf-spine; the testbed's veths are unshaped
            uplink_bps=self.rate_bps if leafspine else None,
            hosts_per_leaf=min(self.hosts_per_leaf, self.hosts),
            spines=self.spines,
            oversub=self.oversub,
        )

    @property
    def elements(self) -> int:
        return self.size_bytes // 4
