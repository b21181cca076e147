"""The testbed's switch aggregator: a dlcp daemon inside the switch namespace.

THC's in-network aggregation sums gradients in a programmable switch at line
rate: each host sends its bucket once up and receives the sum once down,
where host-to-host all-reduce sends and receives it about twice. The testbed
emulates that switch with `--switch-aggregator`: a daemon in the switch
namespace listens on each bridge's own address (10.77.P.254, `switch_address`),
so it sits behind the switch at the switch's speed, as the switch's own
pipeline would. Jobs in "switch" mode name it as their last host and their
only aggregator (`dlcp.shim` `mode="switch"`, `dlcp bench ... --mode switch`).

What stays honest about the links:
- the sums go down to each host through that host's shaped switch port,
  with the same priorities, queues and loss as any traffic toward it;
- each host's traffic into the aggregator is shaped to the port's rate on
  its way in (an ifb device per host and path, `uplink_ifb`, with the same
  dlcp.tc plan as the ports): a host's uplink is a link like its downlink.
  Host-to-host traffic is not redirected: it meets its bottleneck at the
  receiver's port, as before;
- random loss on a port's "in" direction drops traffic into the aggregator
  too (the nft ingress hook runs again when the ifb hands a packet back).

`SwitchAggregator` is the testbed's aggregator: its files and addresses, its
wiring and shaping in the switch namespace (recorded in the testbed's state
file), and its daemon (started through the hosts' `HostProcesses`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlcp.testbed import system
from dlcp.testbed.config import merge_config
from dlcp.testbed.host import Host
from dlcp.testbed.plan import (
    PREFIX_LEN,
    TestbedError,
    TestbedSpec,
    bridge_name,
    host_address,
    host_ifname,
    host_mac,
    switch_address,
    switch_mac,
    uplink_ifb,
)
from dlcp.testbed.state import StateRecord

if TYPE_CHECKING:
    from dlcp.testbed.procs import HostProcesses

__all__ = ["SWITCH_ROLE", "SwitchAggregator", "switch_config"]

SWITCH_ROLE = "switch-daemon"
SWITCH_LABEL = "switch"
SWITCH_INDEX = -1  # the "host" index its process is recorded under


def switch_config(
    spec: TestbedSpec, socket: Path | str, extra: Mapping[str, Any]
) -> dict[str, Any]:
    """The switch aggregator's daemon config: its socket, its addresses (the
    bridges'), the hosts as its peers. `extra` as for the hosts' daemons (the
    link rate there is each host port's: the aggregator paces each host
    on its own port)."""
    config: dict[str, Any] = {
        "daemon": {
            "socket": str(socket),
            "metrics_port": spec.metrics_port,
            "host_index": spec.hosts,
        },
        "network": {
            "addresses": [switch_address(p) for p in range(spec.paths)],
            "udp_port": spec.udp_port,
            **({"payload": spec.mtu - 92} if spec.mtu != 1500 else {}),
            "peers": [
                {"index": i, "addresses": [host_address(i, p) for p in range(spec.paths)]}
                for i in range(spec.hosts)
            ],
        },
    }
    return merge_config(config, extra)


def switch_link_commands(spec: TestbedSpec) -> list[str]:
    """`ip -b` lines in the switch namespace: each bridge gets the aggregator's
    address and static neighbours for the hosts."""
    out: list[str] = []
    for p in range(spec.paths):
        br = bridge_name(p)
        out += [
            f"link set {br} address {switch_mac(p)}",
            f"addr add {switch_address(p)}/{PREFIX_LEN} dev {br}",
        ]
        out += [
            f"neigh replace {host_address(i, p)} lladdr {host_mac(i, p)} dev {br} nud permanent"
            for i in range(spec.hosts)
        ]
    return out


def host_neigh_commands(spec: TestbedSpec, ifname: Callable[[int], str]) -> list[str]:
    """`ip -b` lines in a host: the aggregator's static neighbour on each path."""
    return [
        f"neigh replace {switch_address(p)} lladdr {switch_mac(p)} dev {ifname(p)} nud permanent"
        for p in range(spec.paths)
    ]


def uplink_commands(
    spec: TestbedSpec, host: int, path: int, port: str
) -> tuple[list[str], list[str]]:
    """(`ip -b` lines, `tc -b` lines) in the switch namespace that send host
    `host`'s traffic for the aggregator on `path` through its ifb, whose
    root qdisc (the dlcp.tc plan at the port's rate) the caller applies."""
    ifb = uplink_ifb(host, path)
    ip = [f"link add {ifb} mtu {spec.mtu} type ifb", f"link set {ifb} up"]
    tc = [
        f"qdisc add dev {port} handle ffff: ingress",
        f"filter add dev {port} parent ffff: protocol ip prio 1 u32 "
        f"match ip dst {switch_address(path)}/32 action mirred egress redirect dev {ifb}",
    ]
    return ip, tc


class SwitchAggregator:
    """Wiring, shaping and running the switch aggregator of a testbed (its
    properties are None or empty where the testbed has none)."""

    def __init__(
        self,
        spec: TestbedSpec,
        hosts: tuple[Host, ...],
        state_dir: Path,
        switch_netns: str,
        record: StateRecord,
    ) -> None:
        self.spec = spec
        self.hosts = hosts
        self.switch_netns = switch_netns
        self._record = record
        self.socket: Path | None = (
            state_dir / SWITCH_LABEL / "dlcpd.sock" if spec.switch_aggregator else None
        )

    @property
    def log(self) -> Path | None:
        """The aggregator daemon's log (None: the testbed has none)."""
        return None if self.socket is None else self.socket.parent / "dlcpd.log"

    @property
    def addresses(self) -> tuple[str, ...]:
        if not self.spec.switch_aggregator:
            return ()
        return tuple(switch_address(p) for p in range(self.spec.paths))

    def wire(self) -> None:
        """The bridges' addresses and static neighbours, both ways."""
        system.batch("ip", self.switch_netns, switch_link_commands(self.spec))
        for h in self.hosts:
            system.batch("ip", h.netns, host_neigh_commands(self.spec, host_ifname))

    def shape_uplinks(self, tc_plan: Any, tc_apply: Any, rate: int, **tc_options: Any) -> None:
        """Each host's traffic into the aggregator, through an ifb shaped as its port."""
        made = set(self._record.read().get("uplinks", []))
        for h in self.hosts:
            for p, port in enumerate(h.switch_ports):
                ifb = uplink_ifb(h.index, p)
                if ifb not in made:
                    ip, tc = uplink_commands(self.spec, h.index, p, port)
                    system.batch("ip", self.switch_netns, ip)
                    system.batch("tc", self.switch_netns, tc)
                    self._record.update(_recorder(ifb))
                plan = tc_plan.build_plan(tc_plan.TcConfig(dev=ifb, rate_bps=rate, **tc_options))
                tc_apply.apply_plan(plan, netns=self.switch_netns, force=True)

    def start_daemon(
        self,
        procs: HostProcesses,
        extra_config: Mapping[str, Any],
        command: Sequence[str],
        env: Mapping[str, str],
        deadline: float,
        timeout_s: float,
    ) -> None:
        """Start the aggregator daemon through `procs` (`command` as for the
        hosts' daemons, "{host}" the word "switch") and wait for its socket."""
        socket, log = self.socket, self.log
        if socket is None or log is None:
            raise TestbedError("this testbed has no switch aggregator (up --switch-aggregator)")
        proc = procs.launch_daemon(
            SWITCH_ROLE,
            SWITCH_INDEX,
            (socket.parent / "dlcpd.toml", socket, log),
            switch_config(self.spec, socket, extra_config),
            command,
            env,
            label=SWITCH_LABEL,
            netns=self.switch_netns,
        )
        system.wait_socket(proc, socket, "the switch aggregator", log, deadline, timeout_s)

    def show(self, procs: list[dict[str, Any]]) -> dict[str, Any] | None:
        """For `Testbed.show`: the aggregator and its daemon among `procs`."""
        if self.socket is None:
            return None
        daemon = next((p for p in procs if p["role"] == SWITCH_ROLE), None)
        return {
            "addresses": list(self.addresses),
            "udp_port": self.spec.udp_port,
            "socket": str(self.socket),
            "daemon_pid": None if daemon is None else daemon["pid"],
            "daemon_alive": False if daemon is None else daemon["alive"],
        }


def _recorder(ifb: str) -> Callable[[dict[str, Any]], None]:
    def record(st: dict[str, Any]) -> None:
        st.setdefault("uplinks", []).append(ifb)

    return record
