"""The testbed's switch: a namespace with one bridge per path and a port per
host and path (veth pairs to the hosts' interfaces), random loss on the
ports (nftables), their shaping (dlcp.tc's plan at the link rate) and ports
set down and up. What it changes at run time is recorded in the testbed's
state file, so `show` in another process sees it.
"""

from __future__ import annotations

from typing import Any

from dlcp.testbed import system
from dlcp.testbed.host import Host
from dlcp.testbed.plan import (
    LOSS_DIRECTIONS,
    PREFIX_LEN,
    TestbedError,
    TestbedSpec,
    bridge_name,
    check_path,
    host_address,
    host_mac,
    loss_permille,
    loss_script,
    parse_host,
)
from dlcp.testbed.state import StateRecord
from dlcp.testbed.switchagg import SwitchAggregator

__all__ = ["Switch", "tc_modules"]


class Switch:
    """The switch namespace `netns` of the hosts `hosts`, and its aggregator's
    uplinks (shaped with the ports)."""

    def __init__(
        self,
        spec: TestbedSpec,
        hosts: tuple[Host, ...],
        netns: str,
        record: StateRecord,
        aggregator: SwitchAggregator,
    ) -> None:
        self.spec = spec
        self.hosts = hosts
        self.netns = netns
        self._record = record
        self._aggregator = aggregator

    @property
    def ports(self) -> list[str]:
        return [port for h in self.hosts for port in h.switch_ports]

    def port(self, host: str | int, path: int) -> str:
        """The switch port toward `host` on `path`."""
        return self.hosts[parse_host(host, self.spec.hosts)].switch_ports[
            check_path(path, self.spec.paths)
        ]

    # --- building ---------------------------------------------------------------------
    def create_links(self) -> None:
        """Bridges, veth pairs to the hosts, addresses and static neighbours."""
        commands = []
        for p in range(self.spec.paths):
            commands += [
                f"link add {bridge_name(p)} type bridge stp_state 0 mcast_snooping 0",
                f"link set {bridge_name(p)} up",
            ]
        fdb = []
        for h in self.hosts:
            for p, (port, ifname) in enumerate(zip(h.switch_ports, h.interfaces, strict=True)):
                mac = host_mac(h.index, p)
                commands += [
                    f"link add {port} type veth peer name {ifname} address {mac} netns {h.netns}",
                    f"link set {port} mtu {self.spec.mtu} master {bridge_name(p)} up",
                ]
                fdb.append(f"fdb replace {mac} dev {port} master static")
        system.batch("ip", self.netns, commands)
        system.batch("bridge", self.netns, fdb)
        for h in self.hosts:
            commands = []
            for p, (addr, ifname) in enumerate(zip(h.addresses, h.interfaces, strict=True)):
                commands += [
                    f"addr add {addr}/{PREFIX_LEN} dev {ifname}",
                    f"link set {ifname} mtu {self.spec.mtu} up",
                ]
                commands += [
                    f"neigh replace {host_address(other.index, p)} "
                    f"lladdr {host_mac(other.index, p)} dev {ifname} nud permanent"
                    for other in self.hosts
                    if other is not h
                ]
            system.batch("ip", h.netns, commands)

    def apply_loss(self) -> None:
        """The spec's random loss on every port's "in" direction (the nft tables made)."""
        n = loss_permille(self.spec.loss_pct)
        ports = self.ports
        permille = {(port, "in"): n for port in ports} if n else {}
        system.run(
            ["nft", "-f", "-"], netns=self.netns, input=loss_script(ports, permille, create=True)
        )

        def record(st: dict[str, Any]) -> None:
            st["loss_permille"] = {
                f"{port}/{d}": (n if d == "in" else 0) for port in ports for d in LOSS_DIRECTIONS
            }

        self._record.update(record)

    def apply_tc(self, *, force: bool = False, **tc_options: Any) -> None:
        """The dlcp.tc plan on every port (and the aggregator's uplinks);
        `tc_options` go to `TcConfig` (e.g. `rate_bps`, `queue_packets`)."""
        tc_plan, tc_apply = tc_modules()
        rate = tc_options.pop("rate_bps", self.spec.rate_bps)
        tc_options.setdefault("mtu", self.spec.mtu)
        for port in self.ports:
            plan = tc_plan.build_plan(tc_plan.TcConfig(dev=port, rate_bps=rate, **tc_options))
            tc_apply.apply_plan(plan, netns=self.netns, force=force)
        if self.spec.switch_aggregator:
            self._aggregator.shape_uplinks(tc_plan, tc_apply, rate, **tc_options)

    # --- at run time ------------------------------------------------------------------
    def tc_stats(self, host: str | int, path: int = 0) -> Any:
        """`dlcp.tc.apply.read_stats` of the switch port toward `host` on `path`."""
        _, tc_apply = tc_modules()
        return tc_apply.read_stats(self.port(host, path), netns=self.netns)

    def set_loss(
        self, host: str | int, pct: float, path: int = 0, *, direction: str = "in"
    ) -> None:
        """Random loss on one switch port: `direction="in"` drops traffic coming
        from `host` (netdev ingress, the default, as `--loss` does); "out" drops
        traffic toward `host` before the port's queue (netdev egress)."""
        self._set_loss({(self.port(host, path), direction): loss_permille(pct)})

    def set_loss_all(self, pct: float, *, direction: str = "in") -> None:
        """The same random loss on every switch port."""
        n = loss_permille(pct)
        self._set_loss({(port, direction): n for port in self.ports})

    def _set_loss(self, permille: dict[tuple[str, str], int]) -> None:
        script = loss_script(self.ports, permille, create=False)
        system.run(["nft", "-f", "-"], netns=self.netns, input=script)

        def record(st: dict[str, Any]) -> None:
            for (port, direction), n in permille.items():
                st["loss_permille"][f"{port}/{direction}"] = n

        self._record.update(record)

    def set_port(self, host: str | int, path: int, up: bool) -> None:
        """Set `host`'s switch port on `path` up or down (`ip link set`): a path
        failure as a host sees it when its link or switch port dies (no
        carrier on its interface; its datagrams and those toward it on that
        path are dropped). Recorded, so that `show` lists the ports down."""
        port = self.port(host, path)
        system.run(["ip", "-n", self.netns, "link", "set", port, "up" if up else "down"])

        def record(st: dict[str, Any]) -> None:
            down = set(st.get("ports_down", []))
            if up:
                down.discard(port)
            else:
                down.add(port)
            st["ports_down"] = sorted(down)

        self._record.update(record)

    def ports_down(self) -> list[str]:
        """The switch ports set down with `set_port` (and not up again)."""
        return list(self._record.read().get("ports_down", []))

    def loss(self) -> dict[str, dict[str, float]]:
        """Loss percent per switch port and direction, e.g. {"h0p0": {"in": 5.0, "out": 0.0}}."""
        recorded = self._record.read().get("loss_permille", {})
        return {
            port: {d: recorded.get(f"{port}/{d}", 0) / 10 for d in LOSS_DIRECTIONS}
            for port in self.ports
        }


def tc_modules() -> tuple[Any, Any]:
    """dlcp.tc's plan and apply modules (a `TestbedError` when they cannot be imported)."""
    try:
        from dlcp.tc import apply as tc_apply
        from dlcp.tc import plan as tc_plan
    except ImportError as exc:
        raise TestbedError(
            f"link shaping needs dlcp.tc, which cannot be imported ({exc}); use --rate none"
        ) from exc
    return tc_plan, tc_apply
