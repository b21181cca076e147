"""What a benchmark invocation runs on (`Setup`: hosts, links, scenario, dlcp's
mode and pacing), the scenarios' disturbances (`Burst`, `Congestion`,
`PathDown`) and the dlcp daemons' config per backend (`dlcp_daemon_config`).
`dlcp.bench.cluster.Cluster` builds the testbed of a `Setup`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from dlcp.bench.common import SCENARIOS, BenchError, format_rate
from dlcp.testbed.config import merge_config

__all__ = [
    "BURST",
    "CONGESTION",
    "MODES",
    "PACING",
    "PATH_DOWN",
    "Burst",
    "Congestion",
    "PathDown",
    "Setup",
    "dlcp_daemon_config",
]

PACING: tuple[str, ...] = ("link", "share")
# dlcp's: host to host, summed in the switch, or by parameter servers
MODES: tuple[str, ...] = ("transpose", "switch", "ps")


@dataclass(frozen=True)
class Burst:
    """Every `period_s`, `length_s` of `pct` % loss on one switch port (host `host`'s)."""

    period_s: float = 2.0
    length_s: float = 0.3
    pct: float = 50.0
    host: int = 0


@dataclass(frozen=True)
class Congestion:
    """Background traffic toward every host: `tcp_streams` TCP streams and
    `udp_share` of the link in UDP (iperf3, unmarked DSCP 0), from the previous
    host ("ring"), which is 4 TCP + 600 Mbit/s UDP per 1 Gbit/s port by default."""

    tcp_streams: int = 4
    udp_share: float = 0.6


@dataclass(frozen=True)
class PathDown:
    """`after_s` into a backend's run, host `host`'s switch port on `path` goes
    down for `length_s` (no carrier, nothing crosses it; 0: until the run
    ends), then up again. Path 0 is the one a single-path transport (Gloo's
    TCP) uses."""

    after_s: float = 4.0
    length_s: float = 6.0
    host: int = 0
    path: int = 0


BURST = Burst()
PATH_DOWN = PathDown()
CONGESTION = Congestion()


@dataclass(frozen=True)
class Setup:
    """What a benchmark invocation runs on."""

    hosts: int = 3
    rate_bps: int | None = 10**9
    scenario: str = "clean"
    loss_pct: float = 1.0  # scenario "loss"
    paths: int | None = None  # default: 2 for "multipath" and "pathdown", else 1
    mtu: int = 1500
    # dlcp's pacing: "link" is the daemon's default with the link rate
    # configured (AIMD per peer up to the link over the hosts that send to
    # it); "share" (diagnosis) also makes that share the floor and start.
    pacing: str = "link"
    # dlcp's mode; "switch" also gives the testbed its aggregator (--switch-aggregator)
    mode: str = "transpose"
    # mode "ps": dedicated servers (testbed hosts after the training hosts, with
    # daemons and no ranks), and whether the training hosts aggregate too
    servers: int = 0
    colocate: bool = False
    name: str | None = None  # testbed name; default "bench-<pid>"
    burst: Burst = BURST
    congestion: Congestion = CONGESTION
    path_down: PathDown = PATH_DOWN

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise BenchError(f"unknown scenario {self.scenario!r}; valid: {', '.join(SCENARIOS)}")
        if self.hosts < 2:
            raise BenchError(f"--hosts must be at least 2, not {self.hosts}")
        if not (math.isfinite(self.loss_pct) and 0 <= self.loss_pct <= 100):
            raise BenchError(f"--loss must be a percentage 0..100, not {self.loss_pct}")
        if self.paths is not None and self.paths < 1:
            raise BenchError(f"paths must be >= 1, not {self.paths}")
        if self.scenario == "pathdown" and self.n_paths < 2:
            raise BenchError("the pathdown scenario needs at least 2 paths")
        if self.scenario == "pathdown" and not 0 <= self.path_down.path < self.n_paths:
            raise BenchError(
                f"--down-path {self.path_down.path}: the paths are 0..{self.n_paths - 1}"
            )
        if self.pacing not in PACING:
            raise BenchError(f"pacing must be one of {', '.join(PACING)}, not {self.pacing!r}")
        if self.mode not in MODES:
            raise BenchError(f"--mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.mode != "ps" and (self.servers or self.colocate):
            raise BenchError("--servers and --colocate are for --mode ps")
        if self.mode == "ps" and not (self.servers >= 1 or (self.servers == 0 and self.colocate)):
            raise BenchError(f"--mode ps needs --servers N >= 1 or --colocate, not {self.servers}")

    @property
    def n_paths(self) -> int:
        if self.paths is not None:
            return self.paths
        return 2 if self.scenario in ("multipath", "pathdown") else 1

    @property
    def testbed_name(self) -> str:
        return self.name or f"bench-{os.getpid()}"

    def describe(self) -> str:
        what = self.scenario
        if self.scenario == "loss":
            what += f" {self.loss_pct:g}%"
        return (
            f"{self.hosts} hosts, {format_rate(self.rate_bps)} links, "
            f"{self.n_paths} path(s), {what}"
            + (f", {self.servers} parameter server(s)" if self.servers else "")
        )


def dlcp_daemon_config(setup: Setup, variant: str, *, timeout_s: float = 60.0) -> dict[str, Any]:
    """The daemons' extra config for backend `variant` (dlcp or an ablation).

    Pacing on, and the daemons told their link rate (a path's: the testbed's
    rate): the daemon's own default pacing. The diagnostic `--pacing share`
    also fixes each peer's floor and start at the link over (hosts - 1).
    """
    rate: dict[str, Any] = {"pacing": True}
    if setup.rate_bps is not None:
        rate["link_rate_bps"] = float(setup.rate_bps)
        if setup.pacing == "share":
            share = float(setup.rate_bps / (setup.hosts - 1))
            # Random and droppable-class losses are not congestion here: the
            # switch's strict priorities protect the gradient classes.
            rate["min_rate_bps"] = share
            rate["initial_rate_bps"] = share
    # DLCP_BENCH_DAEMON_CONFIG: JSON merged into every daemon's config (tuning)
    extra = json.loads(os.environ.get("DLCP_BENCH_DAEMON_CONFIG") or "{}")
    policies: dict[str, Any] = {"balance": "spray"}
    if variant == "dlcp-noprio":
        policies["priority"] = "flow"
    if variant == "dlcp-nobound":
        policies["drop"] = "none"
    config = {
        "daemon": {"log_level": os.environ.get("DLCP_BENCH_DAEMON_LOG", "warning")},
        "rate": rate,
        "policies": policies,
        "timing": {"timeout": timeout_s},
    }
    return merge_config(config, extra)
