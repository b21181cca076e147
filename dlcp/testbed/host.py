"""One emulated host of a testbed (`Host`): its namespace, addresses (one per
path), interfaces, switch ports and its daemon's files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dlcp.testbed.plan import (
    TestbedSpec,
    host_address,
    host_ifname,
    host_label,
    host_netns,
    switch_port,
)

__all__ = ["Host", "make_host"]


@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace, addresses (one per path) and daemon files."""

    index: int
    name: str
    netns: str
    addresses: tuple[str, ...]
    interfaces: tuple[str, ...]
    switch_ports: tuple[str, ...]
    udp_port: int
    socket: Path
    config: Path
    log: Path
    metrics_url: str


def make_host(spec: TestbedSpec, state_dir: Path, index: int) -> Host:
    """Host `index` of the testbed of `spec` whose state lives in `state_dir`."""
    addresses = tuple(host_address(index, p) for p in range(spec.paths))
    directory = state_dir / host_label(index)
    return Host(
        index=index,
        name=host_label(index),
        netns=host_netns(spec.name, index),
        addresses=addresses,
        interfaces=tuple(host_ifname(p) for p in range(spec.paths)),
        switch_ports=tuple(switch_port(index, p) for p in range(spec.paths)),
        udp_port=spec.udp_port,
        socket=directory / "dlcpd.sock",
        config=directory / "dlcpd.toml",
        log=directory / "dlcpd.log",
        metrics_url=f"http://{addresses[0]}:{spec.metrics_port}/metrics",
    )
