"""dlcpd's configuration: a TOML file, every key optional with the default below.

`systemd/dlcpd.toml` is the documented example; keep the two in step.
"""

from __future__ import annotations

import ipaddress
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlcp.core.layout import DEFAULT_PAYLOAD
from dlcp.core.rate import RateConfig
from dlcp.core.timing import Timing
from dlcp.daemon.flow import WINDOW_MIN
from dlcp.daemon.mtu import MIN_MTU, link_mtu, payload_for
from dlcp.errors import LocalError
from dlcp.ipc import DEFAULT_SOCKET
from dlcp.policies import DEFAULT_DSCP, check_dscp_table
from dlcp.wire.mac import MAC_ALGORITHMS, mac_state

__all__ = ["Config", "JobConfig", "PeerConfig", "load", "parse"]

# The daemon's defaults for [rate] where they differ from RateConfig's: start
# each path to a peer at 1 Gbit/s and never pace it below 20 Mbit/s (NACK bursts
# are loss signals that arrive in clumps; the floor keeps recovery traffic
# moving); balance = "adaptive" takes a path losing up to 15 % of its packets
# as random (it weighs it by its goodput, 1 - loss), more than that as
# congestion. Losses do not cut the rate (loss_backoff, see RateConfig): each
# peer's rate is capped at its share of the link (link_rate_bps, fan-in).
RATE_DEFAULTS: dict[str, Any] = {
    "initial_rate_bps": 1e9,
    "min_rate_bps": 20e6,
    "initial_rtt": 0.01,
    "loss_tolerance": 0.15,
    "loss_backoff": False,
}


@dataclass(frozen=True)
class PeerConfig:
    index: int
    addresses: tuple[str, ...]
    udp_port: int


@dataclass(frozen=True)
class JobConfig:
    """A job declared in the config (e.g. on dedicated "ps" aggregator hosts)."""

    job: int
    key: bytes
    hosts: tuple[PeerConfig, ...]
    me: int
    mode: str = "transpose"
    aggregators: tuple[int, ...] = ()
    contributors: tuple[int, ...] = ()
    shards: int | None = None  # "ps": shards dealt among the aggregators (default: one each)


@dataclass
class Config:
    # [daemon]
    socket: str = DEFAULT_SOCKET
    socket_mode: int = 0o660
    metrics_address: str = "0.0.0.0"
    metrics_port: int = 9464  # 0: no metrics endpoint
    host_index: int = 0
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    # [network]
    addresses: tuple[str, ...] = ("127.0.0.1",)
    udp_port: int = 7400
    # The links' MTU: a number, or found from the routes to the peers
    # ("auto", dlcp.daemon.mtu); None: not known (DEFAULT_PAYLOAD, a 1500-byte
    # link). `payload`, unless given, follows it.
    mtu: int | None = None
    payload: int = DEFAULT_PAYLOAD
    gso: bool = True
    gro: bool = True
    mac: str = "ghash-aes"  # packet MAC of every job (dlcp/wire/mac.py)
    # SO_RCVBUF/SO_SNDBUF asked for (the kernel doubles it). A peer may send a
    # whole leg of a bucket before this daemon reads: 50.5 MiB of the kernel's
    # accounting for a 100 MB fp32 bucket on two hosts. With 32 MiB (64 MiB
    # granted) the queue overflowed now and then on a fast veth, and the lost
    # datagrams cost NACK rounds (BENCHMARKS.md, round 26).
    socket_buffer_bytes: int = 64 << 20
    # Flow control: bytes sent to a peer that it has not yet taken from its
    # sockets (its credits say how many it has), at most (0: no limit), from
    # all the hosts that send to it in this daemon's jobs together: each gets
    # an equal share, at least WINDOW_MIN (dlcpd._size_windows); the credits
    # grant each host that sends here its share among all of them, which a
    # sender in only some of this daemon's jobs cannot count. Half of what
    # the kernel grants the socket (twice what is asked). On a veth it took a
    # 400 MB bucket from 100,000 lost datagrams a round (0.14x Gloo) to none;
    # 32 MiB windows cost a 100 MB bucket, whose 50 MB leg then no longer goes
    # at once, about 10 % (0.85x Gloo against 0.95x; BENCHMARKS.md rounds 27
    # and 28).
    window_bytes: int = 64 << 20
    # Receive moderation, as a NIC's interrupt moderation (0: none): after a
    # wake-up that found work the daemon stops watching its sockets and polls
    # them this often, taking what arrived meanwhile in one drain and sending
    # what its pacers earned in one flush, until a poll finds nothing to do. At
    # 200 Mbit/s a daemon otherwise woke about 1,300 times a second for 12-14
    # datagrams each and its Python cost per wake-up, not the bytes, took the
    # two cores; 2 ms took 17 % of its CPU off a round (BENCHMARKS-LOG.md).
    moderation_s: float = 0.002
    # Path health (dlcp/core/pathhealth.py): to a peer with two or more paths
    # each path is probed this often while there is traffic for the peer; a
    # path whose probes go unanswered carries nothing but probes until they
    # get through again (0: no probes, every path always in use). The first
    # three unanswered probes take a dead path out of use in about 80 ms.
    probe_interval_s: float = 0.01
    # At most this many probes every probe_interval_s over all peers and paths
    # (0: no bound), the most overdue first and those that decide whether a
    # path is down or back before the routine ones (dlcp/core/probeplan.py):
    # at 64 hosts on 4 paths each path is probed about every 80 ms instead of
    # 10 ms (25,200 probes a second a daemon instead of 3,200), and a dead
    # path is out of use within 140 ms (3 hosts: unchanged, within 70 ms).
    probe_budget: int = 32
    # A shard's owner sends the results of its packets whose every sender's
    # copy is in before the shard completes, this many or more at a time
    # (dlcp/core/early.py; fp32 and fp16), where [rate] link_rate_bps is
    # known (a paced link). 0: after the whole shard only.
    early_results: int = 128
    peers: tuple[PeerConfig, ...] = ()
    # [policies]
    priority: dict[str, Any] = field(default_factory=lambda: {"name": "layer_magnitude"})
    drop: dict[str, Any] = field(default_factory=lambda: {"name": "smallest_norm"})
    balance: dict[str, Any] = field(default_factory=lambda: {"name": "spray"})
    dscp: tuple[int, ...] = tuple(DEFAULT_DSCP)
    # [rate]
    pacing: bool = True
    rate: RateConfig = field(default_factory=lambda: RateConfig(**RATE_DEFAULTS))
    # [timing]
    timing: Timing = field(default_factory=Timing)
    # [tc]: read back class stats of these devices for /metrics
    tc_devices: tuple[str, ...] = ()
    # [[jobs]]
    jobs: tuple[JobConfig, ...] = ()
    path: str | None = None


_SECTIONS = {
    "daemon": {
        "socket",
        "socket_mode",
        "metrics_address",
        "metrics_port",
        "host_index",
        "drain_timeout_s",
        "log_level",
    },
    "network": {
        "addresses",
        "udp_port",
        "mtu",
        "payload",
        "gso",
        "gro",
        "mac",
        "socket_buffer_bytes",
        "window_bytes",
        "moderation_s",
        "probe_interval_s",
        "probe_budget",
        "early_results",
        "peers",
    },
    "policies": {"priority", "drop", "balance", "dscp"},
    "rate": None,  # RateConfig.from_dict checks keys; plus "pacing"
    "timing": None,
    "tc": {"devices"},
    "jobs": None,
}


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise LocalError(msg)


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    _need(
        isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi,
        f"{name} must be an integer in {lo}..{hi}, got {v!r}",
    )
    return int(v)


def _address(v: Any, name: str) -> str:
    try:
        return str(ipaddress.IPv4Address(v))
    except (ValueError, TypeError):
        raise LocalError(f"{name}: {v!r} is not an IPv4 address") from None


def _addresses(v: Any, name: str) -> tuple[str, ...]:
    _need(isinstance(v, list) and 1 <= len(v) <= 8, f"{name} must be a list of 1..8 addresses")
    return tuple(_address(a, name) for a in v)


def _policy(v: Any, name: str) -> dict[str, Any]:
    if isinstance(v, str):
        return {"name": v}
    _need(isinstance(v, dict) and isinstance(v.get("name"), str), f"{name} needs a name")
    return dict(v)


def _peer(v: Any, name: str, default_port: int) -> PeerConfig:
    _need(isinstance(v, dict), f"{name} must be a table")
    unknown = set(v) - {"index", "addresses", "udp_port"}
    _need(not unknown, f"{name}: unknown keys {sorted(unknown)}")
    return PeerConfig(
        index=_int(v.get("index", 0), f"{name}.index", 0, 65535),
        addresses=_addresses(v.get("addresses"), f"{name}.addresses"),
        udp_port=_int(v.get("udp_port", default_port), f"{name}.udp_port", 1, 65535),
    )


def _job(v: Any, i: int, default_port: int) -> JobConfig:
    name = f"jobs[{i}]"
    _need(isinstance(v, dict), f"{name} must be a table")
    unknown = set(v) - {
        "job",
        "key",
        "hosts",
        "me",
        "mode",
        "aggregators",
        "contributors",
        "shards",
    }
    _need(not unknown, f"{name}: unknown keys {sorted(unknown)}")
    try:
        key = bytes.fromhex(str(v.get("key", "")))
    except ValueError:
        raise LocalError(f"{name}.key must be hex") from None
    _need(16 <= len(key) <= 64, f"{name}.key must be 16..64 bytes")
    hosts = v.get("hosts")
    _need(isinstance(hosts, list) and bool(hosts), f"{name}.hosts must be a non-empty list")
    mode = v.get("mode", "transpose")
    _need(mode in ("transpose", "ps", "switch"), f"{name}.mode must be transpose, ps or switch")
    return JobConfig(
        job=_int(v.get("job"), f"{name}.job", 0, 2**32 - 1),
        key=key,
        hosts=tuple(
            _peer({"index": k, **h}, f"{name}.hosts[{k}]", default_port)
            for k, h in enumerate(hosts)
        ),
        me=_int(v.get("me"), f"{name}.me", 0, len(hosts) - 1),
        mode=mode,
        aggregators=tuple(
            _int(a, f"{name}.aggregators", 0, 65535) for a in v.get("aggregators", [])
        ),
        contributors=tuple(
            _int(a, f"{name}.contributors", 0, 65535) for a in v.get("contributors", [])
        ),
        shards=_int(v["shards"], f"{name}.shards", 1, 65535) if "shards" in v else None,
    )


def parse(data: dict[str, Any], path: str | None = None) -> Config:
    """A validated Config from parsed TOML; LocalError names the bad key."""
    for section, value in data.items():
        _need(section in _SECTIONS, f"unknown section [{section}]")
        keys = _SECTIONS[section]
        if keys is not None:
            _need(isinstance(value, dict), f"[{section}] must be a table")
            unknown = set(value) - keys
            _need(not unknown, f"[{section}]: unknown keys {sorted(unknown)}")
    d = data.get("daemon", {})
    n = data.get("network", {})
    p = data.get("policies", {})
    r = dict(data.get("rate", {}))
    t = data.get("timing", {})
    cfg = Config(path=path)
    if "socket" in d:
        _need(isinstance(d["socket"], str) and bool(d["socket"]), "daemon.socket must be a path")
        cfg.socket = d["socket"]
    if "socket_mode" in d:
        mode = d["socket_mode"]
        if isinstance(mode, str):
            try:
                mode = int(mode, 8)
            except ValueError:
                raise LocalError(f"daemon.socket_mode {mode!r} is not octal") from None
        cfg.socket_mode = _int(mode, "daemon.socket_mode", 0, 0o777)
    if "metrics_address" in d:
        cfg.metrics_address = _address(d["metrics_address"], "daemon.metrics_address")
    cfg.metrics_port = _int(
        d.get("metrics_port", cfg.metrics_port), "daemon.metrics_port", 0, 65535
    )
    cfg.host_index = _int(d.get("host_index", 0), "daemon.host_index", 0, 65535)
    drain = d.get("drain_timeout_s", cfg.drain_timeout_s)
    _need(isinstance(drain, int | float) and drain >= 0, "daemon.drain_timeout_s must be >= 0")
    cfg.drain_timeout_s = float(drain)
    level = d.get("log_level", cfg.log_level)
    _need(level in ("debug", "info", "warning", "error"), f"daemon.log_level {level!r}")
    cfg.log_level = level
    if "addresses" in n:
        cfg.addresses = _addresses(n["addresses"], "network.addresses")
    cfg.udp_port = _int(n.get("udp_port", cfg.udp_port), "network.udp_port", 1, 65535)
    for flag in ("gso", "gro"):
        if flag in n:
            _need(isinstance(n[flag], bool), f"network.{flag} must be true or false")
            setattr(cfg, flag, n[flag])
    mac = n.get("mac", cfg.mac)
    _need(mac in MAC_ALGORITHMS, f"network.mac {mac!r}: one of {', '.join(MAC_ALGORITHMS)}")
    try:
        mac_state(bytes(32), mac)  # fails now, not at the first join, without its library
    except ValueError as exc:
        raise LocalError(f"network.mac: {exc}") from None
    cfg.mac = mac
    cfg.socket_buffer_bytes = _int(
        n.get("socket_buffer_bytes", cfg.socket_buffer_bytes),
        "network.socket_buffer_bytes",
        1 << 16,
        1 << 30,
    )
    cfg.window_bytes = _int(
        n.get("window_bytes", cfg.window_bytes), "network.window_bytes", 0, 1 << 30
    )
    _need(
        cfg.window_bytes == 0 or cfg.window_bytes >= WINDOW_MIN,
        f"network.window_bytes must be 0 (no flow control) or at least {WINDOW_MIN} "
        "(4 credit steps)",
    )
    moderation = n.get("moderation_s", cfg.moderation_s)
    _need(
        isinstance(moderation, int | float)
        and not isinstance(moderation, bool)
        and 0 <= moderation <= 0.1,
        f"network.moderation_s must be a number of seconds in [0, 0.1], got {moderation!r}",
    )
    cfg.moderation_s = float(moderation)
    probe = n.get("probe_interval_s", cfg.probe_interval_s)
    _need(
        isinstance(probe, int | float) and not isinstance(probe, bool) and 0 <= probe <= 1,
        f"network.probe_interval_s must be a number of seconds in [0, 1], got {probe!r}",
    )
    cfg.probe_interval_s = float(probe)
    budget = n.get("probe_budget", cfg.probe_budget)
    _need(
        isinstance(budget, int) and not isinstance(budget, bool) and 0 <= budget <= 1_000_000,
        f"network.probe_budget must be an integer in [0, 1000000], got {budget!r}",
    )
    cfg.probe_budget = budget
    early = n.get("early_results", cfg.early_results)
    _need(
        isinstance(early, int) and not isinstance(early, bool) and 0 <= early <= 1_000_000,
        f"network.early_results must be an integer in [0, 1000000], got {early!r}",
    )
    cfg.early_results = early
    peers = n.get("peers", [])
    _need(isinstance(peers, list), "network.peers must be a list of tables")
    cfg.peers = tuple(_peer(v, f"network.peers[{i}]", cfg.udp_port) for i, v in enumerate(peers))
    _link_size(cfg, n)
    for kind in ("priority", "drop", "balance"):
        if kind in p:
            setattr(cfg, kind, _policy(p[kind], f"policies.{kind}"))
    if "dscp" in p:
        cfg.dscp = tuple(check_dscp_table(p["dscp"]))
    if "pacing" in r:
        _need(isinstance(r["pacing"], bool), "rate.pacing must be true or false")
        cfg.pacing = r.pop("pacing")
    cfg.rate = RateConfig.from_dict({**RATE_DEFAULTS, **r})
    # The controller's delay rule needs RTT samples of the data's own classes;
    # the daemon takes none (its acknowledgements carry no timestamps and its
    # probes ride the control class, ahead of any queued data), so the setting
    # would be silently ignored.
    _need(
        cfg.rate.delay_target is None,
        "rate.delay_target is not supported by dlcpd: it takes no RTT samples of its "
        "data classes (probes ride the control class), so delay would never cut a rate",
    )
    known = set(Timing.__dataclass_fields__)
    unknown = set(t) - known
    _need(not unknown, f"[timing]: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    for k, v in t.items():
        _need(
            isinstance(v, int | float)
            and not isinstance(v, bool)
            and (v > 0 or k in ("ack_wait", "reorder")),
            f"timing.{k} must be a positive number",
        )
    cfg.timing = Timing(**{k: float(v) for k, v in t.items()})
    devs = data.get("tc", {}).get("devices", [])
    _need(isinstance(devs, list) and all(isinstance(x, str) for x in devs), "tc.devices: names")
    cfg.tc_devices = tuple(devs)
    jobs = data.get("jobs", [])
    _need(isinstance(jobs, list), "[[jobs]] must be an array of tables")
    cfg.jobs = tuple(_job(v, i, cfg.udp_port) for i, v in enumerate(jobs))
    # validate the policies now, so a typo fails at start and not at the first round
    from dlcp.policies import from_config

    for kind in ("priority", "drop", "balance"):
        from_config(kind, getattr(cfg, kind))
    return cfg


def _link_size(cfg: Config, n: dict[str, Any]) -> None:
    """`mtu` (given, or "auto": from the routes to the peers) and the payload,
    given or following the MTU (`dlcp.daemon.mtu`)."""
    mtu = n.get("mtu", "auto")
    if mtu == "auto":
        cfg.mtu = link_mtu(a for peer in cfg.peers for a in peer.addresses)
    else:
        cfg.mtu = _int(mtu, "network.mtu", MIN_MTU, 65535)
    if "payload" in n:
        cfg.payload = _int(n["payload"], "network.payload", 64, 65443)
    elif cfg.mtu is not None:
        cfg.payload = payload_for(cfg.mtu, cfg.addresses[0])


def load(path: str | Path) -> Config:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise LocalError(f"cannot read config {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise LocalError(f"{path}: {exc}") from None
    return parse(data, str(path))
