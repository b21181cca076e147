"""The testbed's pure parts: what gets built, named and addressed; no side effects.

A testbed named N with H hosts and P paths is one network namespace per host
(`N-h0` ...), one switch namespace (`N-sw`) with a Linux bridge per path
(`br0` ...), and per host and path a veth pair: `ethP` in the host, `hIpP` on
the switch. Host i has address 10.77.P.(i+1)/24 on path P; those addresses
exist only inside the namespaces we create. Interfaces get fixed MACs, hosts
static neighbour entries and bridges static FDB entries, so there is no ARP
and no flooding: random loss hits only the traffic under test, and a switch
port's counters see only traffic for its host.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dlcp.errors import LocalError

__all__ = [
    "BACKGROUND_KINDS",
    "BACKGROUND_PATTERNS",
    "DEFAULT_NAME",
    "DEFAULT_UDP_SHARE",
    "IPERF_BASE_PORT",
    "IPERF_MAX_SECONDS",
    "LOSS_DIRECTIONS",
    "MAX_HOSTS",
    "MAX_PATHS",
    "METRICS_PORT",
    "PREFIX_LEN",
    "UDP_PORT",
    "UNSHAPED_REFERENCE_BPS",
    "IperfFlow",
    "TestbedError",
    "TestbedSpec",
    "background_flows",
    "bridge_name",
    "check_path",
    "format_rate",
    "host_address",
    "host_ifname",
    "host_label",
    "host_mac",
    "host_netns",
    "iperf_client_argv",
    "iperf_server_argv",
    "loss_chain",
    "loss_permille",
    "loss_script",
    "owned_netns",
    "parse_host",
    "switch_address",
    "switch_mac",
    "switch_netns",
    "switch_port",
    "uplink_ifb",
    "validate_name",
]

DEFAULT_NAME = "dlcp"
UDP_PORT = 7400
METRICS_PORT = 9464
PREFIX_LEN = 24
MAX_HOSTS = 253  # host i gets .(i+1); .255 is broadcast
MAX_PATHS = 8
IPERF_BASE_PORT = 5201
IPERF_MAX_SECONDS = 86400  # iperf3's own upper bound on -t
DEFAULT_UDP_SHARE = 0.6  # background UDP per destination port, as a share of the link
UNSHAPED_REFERENCE_BPS = 1_000_000_000  # the "link" rate UDP background assumes without --rate

BACKGROUND_KINDS: tuple[str, ...] = ("none", "tcp", "udp", "both")
BACKGROUND_PATTERNS: tuple[str, ...] = ("all", "ring")
LOSS_DIRECTIONS: tuple[str, ...] = ("in", "out")

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,23}")


class TestbedError(LocalError):
    """Building, using or removing the testbed failed; the message says how."""

    __test__ = False  # not a pytest test class


def validate_name(name: str) -> str:
    if not _NAME_RE.fullmatch(name):
        raise TestbedError(
            f"bad testbed name {name!r}: use 1-24 letters, digits, '_' or '-', "
            "starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class TestbedSpec:
    """What `Testbed.up` builds. `rate_bps=None` leaves the links unshaped.

    `loss_pct` is the random loss on every switch port (traffic leaving each
    host), resolution 0.1 %. `background` starts iperf3 traffic at `up`,
    running `background_s` seconds or, when None, until `down`.

    `segmentation` is the host veths' segmentation offload, one policy for
    TCP (TSO) and UDP (GSO) alike: None (default) turns both off when the
    links are shaped, so the switch queues MTU-size packets as a ToR would
    rather than 64 KB super-packets, and on when unshaped, where the veth
    carries super-packets as a fast NIC's offloads would. Receive offload
    (GRO) is on on every host veth, as on a real NIC; the switch ports have
    neither (`segments` is the resolved setting).
    """

    __test__ = False  # not a pytest test class

    hosts: int
    paths: int = 1
    rate_bps: int | None = None
    loss_pct: float = 0.0
    background: str = "none"
    background_s: float | None = None
    background_pattern: str = "all"
    udp_rate_bps: int | None = None
    daemons: bool = False
    name: str = DEFAULT_NAME
    udp_port: int = UDP_PORT
    metrics_port: int = METRICS_PORT
    segmentation: bool | None = None
    mtu: int = 1500  # link MTU (9000: jumbo frames; the daemons' payload follows)
    # an aggregator daemon in the switch namespace (`dlcp.testbed.switchagg`)
    switch_aggregator: bool = False

    def __post_init__(self) -> None:
        validate_name(self.name)
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise TestbedError(f"--hosts must be between 1 and {MAX_HOSTS}, not {self.hosts}")
        if not 1 <= self.paths <= MAX_PATHS:
            raise TestbedError(f"--paths must be between 1 and {MAX_PATHS}, not {self.paths}")
        if self.rate_bps is not None and self.rate_bps <= 0:
            raise TestbedError(f"rate must be positive, not {self.rate_bps} bit/s")
        loss_permille(self.loss_pct)
        if not 576 <= self.mtu <= 65535:
            raise TestbedError(f"mtu must be between 576 and 65535, not {self.mtu}")
        if self.background not in BACKGROUND_KINDS:
            raise TestbedError(
                f"background must be one of {', '.join(BACKGROUND_KINDS)}, not {self.background!r}"
            )
        if self.background_pattern not in BACKGROUND_PATTERNS:
            raise TestbedError(
                f"background pattern must be 'all' or 'ring', not {self.background_pattern!r}"
            )
        if self.background_s is not None and not 0 < self.background_s <= IPERF_MAX_SECONDS:
            raise TestbedError(f"background duration must be in (0, {IPERF_MAX_SECONDS}] s")
        if self.udp_rate_bps is not None and self.udp_rate_bps <= 0:
            raise TestbedError("background UDP rate must be positive")
        for label, port in (("udp_port", self.udp_port), ("metrics_port", self.metrics_port)):
            if not 1 <= port <= 65535:
                raise TestbedError(f"{label} must be a port number, not {port}")

    @property
    def segments(self) -> bool:
        """Whether the host veths segment (TSO and UDP GSO on): `segmentation`,
        or by default only when the links are unshaped."""
        return self.segmentation if self.segmentation is not None else self.rate_bps is None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TestbedSpec:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def format_rate(bps: int | None) -> str:
    """1_000_000_000 -> "1 Gbit/s"; None -> "unshaped"."""
    if bps is None:
        return "unshaped"
    for unit, scale in (("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps} bit/s"


# --- names and addresses -------------------------------------------------------


def host_label(index: int) -> str:
    return f"h{index}"


def host_netns(name: str, index: int) -> str:
    return f"{name}-{host_label(index)}"


def switch_netns(name: str) -> str:
    return f"{name}-sw"


def host_ifname(path: int) -> str:
    return f"eth{path}"


def switch_port(index: int, path: int) -> str:
    return f"h{index}p{path}"


def bridge_name(path: int) -> str:
    return f"br{path}"


def host_mac(index: int, path: int) -> str:
    """The fixed, locally administered MAC of host `index`'s interface on `path`."""
    return f"02:77:{path:02x}:00:{index >> 8:02x}:{index & 0xFF:02x}"


def switch_address(path: int) -> str:
    """The switch aggregator's address on `path` (its bridge's): .254, which
    no host has (hosts are .1 to .253)."""
    if not 0 <= path < MAX_PATHS:
        raise TestbedError(f"no switch address on path {path}")
    return f"10.77.{path}.254"


def switch_mac(path: int) -> str:
    """The fixed MAC of the bridge of `path` (where the switch aggregator listens)."""
    return f"02:77:{path:02x}:ff:ff:fe"


def uplink_ifb(index: int, path: int) -> str:
    """The ifb device that shapes host `index`'s traffic into the switch
    aggregator on `path` (its uplink, at the port's rate)."""
    return f"up{index}p{path}"


def host_address(index: int, path: int) -> str:
    if not 0 <= index < MAX_HOSTS or not 0 <= path < MAX_PATHS:
        raise TestbedError(f"no address for host {index} on path {path}")
    return f"10.77.{path}.{index + 1}"


def owned_netns(name: str, existing: Iterable[str]) -> list[str]:
    """The namespaces among `existing` that a testbed called `name` would make."""
    pattern = re.compile(rf"{re.escape(name)}-(?:h\d+|sw)")
    return sorted(ns for ns in existing if pattern.fullmatch(ns))


def parse_host(host: str | int, hosts: int) -> int:
    """'h1', '1' or 1 -> 1, checked against the number of hosts."""
    text = str(host).strip()
    match = re.fullmatch(r"h?(\d+)", text)
    if match is None:
        raise TestbedError(f"bad host {host!r}: use a name like 'h0' or an index like '0'")
    index = int(match.group(1))
    if index >= hosts:
        raise TestbedError(f"no host {text!r}: the testbed has h0..h{hosts - 1}")
    return index


def check_path(path: int, paths: int) -> int:
    """`path`, checked against the testbed's number of paths."""
    if not 0 <= path < paths:
        raise TestbedError(f"no path {path}: the testbed has paths 0..{paths - 1}")
    return path


# --- random loss (nftables) ---------------------------------------------------


def loss_permille(pct: float) -> int:
    """Loss percent -> the N of `numgen random mod 1000 < N` (0.1 % steps, rounded)."""
    if not isinstance(pct, int | float) or math.isnan(pct) or not 0 <= pct <= 100:
        raise TestbedError(f"loss must be a percentage between 0 and 100, not {pct!r}")
    return round(pct * 10)


NFT_TABLE = "dlcp_testbed"


def loss_chain(port: str, direction: str) -> str:
    return f"{direction}_{port}"


def loss_script(
    ports: Sequence[str],
    permille: dict[tuple[str, str], int],
    *,
    create: bool,
) -> str:
    """An `nft -f` script that sets the drop rule of each (port, direction) chain.

    With `create`, it first makes the netdev table and one ingress ("in": traffic
    from the host) and one egress ("out": toward the host, before the port's
    queue) chain per port; chains of ports not in `permille` are left empty.
    """
    lines: list[str] = []
    if create:
        lines.append(f"table netdev {NFT_TABLE} {{")
        for port in ports:
            for direction, hook in (("in", "ingress"), ("out", "egress")):
                lines += [
                    f"  chain {loss_chain(port, direction)} {{",
                    f'    type filter hook {hook} device "{port}" priority 0; policy accept;',
                    "  }",
                ]
        lines.append("}")
    for (port, direction), n in sorted(permille.items()):
        if direction not in LOSS_DIRECTIONS:
            raise TestbedError(f"loss direction must be 'in' or 'out', not {direction!r}")
        chain = loss_chain(port, direction)
        lines.append(f"flush chain netdev {NFT_TABLE} {chain}")
        if n > 0:
            lines.append(
                f"add rule netdev {NFT_TABLE} {chain} numgen random mod 1000 < {n} counter drop"
            )
    return "\n".join(lines) + "\n"


# --- background traffic (iperf3) ------------------------------------------------


@dataclass(frozen=True)
class IperfFlow:
    """One iperf3 client in host `src` to a server of its own in host `dst`."""

    kind: str  # "tcp" or "udp"
    src: int
    dst: int
    path: int
    port: int
    rate_bps: int | None  # UDP only

    @property
    def label(self) -> str:
        return f"{self.kind}-h{self.src}-h{self.dst}-p{self.path}"


def background_flows(
    hosts: int,
    paths: Sequence[int],
    kind: str,
    *,
    link_bps: int | None,
    udp_rate_bps: int | None = None,
    pattern: str = "all",
) -> list[IperfFlow]:
    """The iperf3 flows of background traffic `kind` on `paths`.

    Pattern "all": every ordered host pair, so every switch egress port
    carries traffic from all other hosts; "ring": host i to host i+1 only
    (fewer processes on small machines; still one flow per kind into every
    port). `udp_rate_bps` is the UDP load offered to each destination port in
    total (default 60 % of the link, or of 1 Gbit/s when unshaped), split
    evenly over the flows into it.
    """
    if kind not in BACKGROUND_KINDS:
        raise TestbedError(f"background must be one of {', '.join(BACKGROUND_KINDS)}")
    if pattern not in BACKGROUND_PATTERNS:
        raise TestbedError(f"background pattern must be 'all' or 'ring', not {pattern!r}")
    kinds = {"none": (), "tcp": ("tcp",), "udp": ("udp",), "both": ("tcp", "udp")}[kind]
    if hosts < 2 or not kinds:
        return []
    if udp_rate_bps is None:
        udp_rate_bps = round(DEFAULT_UDP_SHARE * (link_bps or UNSHAPED_REFERENCE_BPS))
    senders = hosts - 1 if pattern == "all" else 1
    per_flow = max(1, udp_rate_bps // senders)
    flows = []
    for k in kinds:
        for path in paths:
            for dst in range(hosts):
                for src in range(hosts):
                    if src != dst and (pattern == "all" or src == (dst - 1) % hosts):
                        port = IPERF_BASE_PORT + 2 * src + (1 if k == "udp" else 0)
                        rate = per_flow if k == "udp" else None
                        flows.append(IperfFlow(k, src, dst, path, port, rate))
    return flows


# Background traffic stands for other tenants' hosts: on the emulated
# cluster it shares the benchmarked processes' cores, so it runs at the
# lowest CPU priority. At normal priority its three iperf3 clients took a core
# of two in the congested scenario, and the ranks and daemons under test
# waited for the CPU, not for the network.
BACKGROUND_NICE = ["nice", "-n", "19"]


def iperf_server_argv(flow: IperfFlow) -> list[str]:
    return [
        *BACKGROUND_NICE,
        "iperf3",
        "--server",
        "--bind",
        host_address(flow.dst, flow.path),
        "--port",
        str(flow.port),
        "--forceflush",
    ]


def iperf_client_argv(flow: IperfFlow, *, duration_s: float | None, parallel: int = 1) -> list[str]:
    seconds = IPERF_MAX_SECONDS if duration_s is None else max(1, math.ceil(duration_s))
    argv = [
        *BACKGROUND_NICE,
        "iperf3",
        "--client",
        host_address(flow.dst, flow.path),
        "--bind",
        host_address(flow.src, flow.path),
        "--port",
        str(flow.port),
        "--time",
        str(seconds),
        "--forceflush",
    ]
    if parallel > 1:
        argv += ["--parallel", str(parallel)]
    if flow.kind == "udp":
        argv += ["--udp", "--bitrate", str(flow.rate_bps)]
    return argv
