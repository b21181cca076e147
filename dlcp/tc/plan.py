"""The tc plan: a pure list of operations that builds dlcp's egress queueing.

Layout (DESIGN.md "tc layout"), for class i in 0..7 (0 is the highest):

    root qdisc  1:       htb, default = minor of the default class
    class       1:1      htb rate = ceil = link rate
    class       1:1i     htb parent 1:1, prio i, rate = tiny, ceil = link rate
    leaf qdisc  1i:      pfifo limit N (short for droppable classes)
    filter      parent 1:, protocol ip, prio i+1, u32 TOS byte & 0xfc == DSCP << 2
                -> flowid 1:1i

Handles are written the way `tc` writes them, in hex: class i has classid
1:(0x10 + i) ("1:10" .. "1:17") and its leaf qdisc has handle (0x10 + i):0
("10:" .. "17:"). Every class may borrow up to the link rate, and HTB lends
spare bandwidth by `prio`, so excess bandwidth is served in strict priority.

No IO here: `build_plan` is a function of `TcConfig`, testable without root.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from dlcp.errors import LocalError

__all__ = [
    "DEFAULT_DSCP",
    "DSCP_NAMES",
    "ETH_P_IP",
    "ETH_P_IPV6",
    "NUM_CLASSES",
    "PARENT_CLASS",
    "ROOT_HANDLE",
    "TC_H_ROOT",
    "Op",
    "TcConfig",
    "build_plan",
    "class_minor",
    "classid",
    "format_handle",
    "leaf_handle",
    "parse_dscp",
    "parse_dscp_list",
    "parse_rate",
]

NUM_CLASSES = 8

# class 0..7 -> DSCP: CS6 control, CS5 top gradient, AF41, AF31, AF21, AF11,
# CS0 best effort (the tc default class: unmarked/background traffic),
# CS1 scavenger (droppable).
DEFAULT_DSCP: tuple[int, ...] = (48, 40, 34, 26, 18, 10, 0, 8)

DSCP_NAMES: dict[str, int] = {
    **{f"cs{i}": 8 * i for i in range(8)},
    **{f"af{c}{d}": 8 * c + 2 * d for c in range(1, 5) for d in range(1, 4)},
    "ef": 46,
    "va": 44,
    "le": 1,
    "be": 0,
}

ETH_P_IP = 0x0800  # u32 `protocol` is an ethertype, not AF_INET (a pyroute2 trap)
ETH_P_IPV6 = 0x86DD
TC_H_ROOT = 0xFFFFFFFF
ROOT_HANDLE = 0x10000  # "1:"
PARENT_CLASS = 0x10001  # "1:1"
_CLASS_MINOR_BASE = 0x10

_MTU = 1600  # bytes; what tc and pyroute2 assume for burst arithmetic


def class_minor(cls: int) -> int:
    """HTB minor number of priority class `cls` (0x10 + cls)."""
    return _CLASS_MINOR_BASE + cls


def classid(cls: int) -> int:
    """Full HTB classid of priority class `cls`: 1:(0x10 + cls)."""
    return (ROOT_HANDLE & 0xFFFF0000) | class_minor(cls)


def leaf_handle(cls: int) -> int:
    """Handle of the fifo qdisc under class `cls`: (0x10 + cls):0."""
    return class_minor(cls) << 16


def format_handle(handle: int) -> str:
    """Write a 32-bit tc handle as `tc` does: "1:10", "10:", "root"."""
    if handle == TC_H_ROOT:
        return "root"
    major, minor = handle >> 16, handle & 0xFFFF
    return f"{major:x}:{minor:x}" if minor else f"{major:x}:"


# ---------------------------------------------------------------- parsing

_RATE_UNITS: dict[str, float] = {
    "": 1,
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "kibit": 1024,
    "mibit": 1024**2,
    "gibit": 1024**3,
    "tibit": 1024**4,
    "bps": 8,  # tc: "bps" is bytes per second
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
    "tbps": 8e12,
    "kibps": 8 * 1024,
    "mibps": 8 * 1024**2,
    "gibps": 8 * 1024**3,
    "tibps": 8 * 1024**4,
}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$")


def parse_rate(text: str) -> int:
    """Parse a rate the way `tc` does and return bits per second.

    "1gbit" -> 1_000_000_000, "200mbit", "100kbit", "10000000" (bits/s);
    "bps"-suffixed units are bytes per second as in tc(8).
    """
    m = _RATE_RE.match(text.lower())
    if m is None or m.group(2) not in _RATE_UNITS:
        raise LocalError(
            f"bad rate {text!r}: expected a number with an optional unit "
            "(bit, kbit, mbit, gbit, tbit, bps, kbps, mbps, gbps), e.g. 1gbit"
        )
    value = round(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    if value <= 0:
        raise LocalError(f"bad rate {text!r}: must be positive")
    return value


def parse_dscp(text: str) -> int:
    """Parse one DSCP value: a number 0..63 (decimal or 0x..) or a name (cs5, af41, ef)."""
    t = text.strip().lower()
    if t in DSCP_NAMES:
        return DSCP_NAMES[t]
    try:
        value = int(t, 0)
    except ValueError:
        raise LocalError(
            f"bad DSCP {text!r}: expected 0..63 or a name like cs5, af41, ef"
        ) from None
    if not 0 <= value <= 63:
        raise LocalError(f"bad DSCP {text!r}: must be in 0..63")
    return value


def parse_dscp_list(text: str) -> tuple[int, ...]:
    """Parse a comma-separated class -> DSCP table, e.g. "48,40,34,26,18,10,0,8"."""
    return tuple(parse_dscp(part) for part in text.split(","))


# ---------------------------------------------------------------- config

_IFNAME_RE = re.compile(r"^[^\s/:]{1,15}$")


@dataclass(frozen=True)
class TcConfig:
    """What to build on one device. Validated on construction (LocalError)."""

    dev: str
    rate_bps: int  # link rate: HTB ceil of every class and rate of the parent class
    dscp: tuple[int, ...] = DEFAULT_DSCP  # class i -> DSCP value; 8 entries
    default_class: int = 6  # class for traffic no filter matches (unmarked, non-IP)
    droppable_classes: frozenset[int] = frozenset({7})
    queue_packets: int = 1000  # pfifo limit of normal classes
    short_queue_packets: int = 16  # pfifo limit of droppable classes
    min_rate_bps: int | None = None  # guaranteed rate per class; default max(8 kbit, rate/1000)
    match_ipv6: bool = False  # also classify IPv6 by its traffic class (8 more filters)
    mtu: int = 1500  # largest packet on the device: HTB bursts hold at least two

    def __post_init__(self) -> None:
        # Normalise list/set arguments so the config stays hashable and comparable.
        object.__setattr__(self, "dscp", tuple(self.dscp))
        object.__setattr__(self, "droppable_classes", frozenset(self.droppable_classes))
        _validate(self)

    @property
    def min_rate(self) -> int:
        """The guaranteed rate of each class in bits per second."""
        if self.min_rate_bps is not None:
            return self.min_rate_bps
        return max(8000, self.rate_bps // 1000)


def _validate(cfg: TcConfig) -> None:
    if not isinstance(cfg.dev, str) or not _IFNAME_RE.match(cfg.dev):
        raise LocalError(f"bad device name {cfg.dev!r}")
    if isinstance(cfg.rate_bps, bool) or not isinstance(cfg.rate_bps, int) or cfg.rate_bps < 8:
        raise LocalError(f"bad rate {cfg.rate_bps!r}: must be a positive number of bits/s (>= 8)")
    if len(cfg.dscp) != NUM_CLASSES:
        raise LocalError(f"dscp table needs {NUM_CLASSES} values (class 0..7), got {len(cfg.dscp)}")
    for value in cfg.dscp:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 63:
            raise LocalError(f"bad DSCP {value!r} in dscp table: must be an integer 0..63")
    if len(set(cfg.dscp)) != NUM_CLASSES:
        dups = sorted({v for v in cfg.dscp if cfg.dscp.count(v) > 1})
        raise LocalError(f"dscp table has duplicate values {dups}: each class needs its own")
    if not _is_class(cfg.default_class):
        raise LocalError(f"default_class {cfg.default_class!r} out of range 0..7")
    bad = sorted(c for c in cfg.droppable_classes if not _is_class(c))
    if bad:
        raise LocalError(f"droppable_classes {bad} out of range 0..7")
    for name in ("queue_packets", "short_queue_packets"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LocalError(f"{name} must be a positive integer, got {value!r}")
    m = cfg.min_rate_bps
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 8):
        raise LocalError(f"min_rate_bps must be a positive number of bits/s (>= 8), got {m!r}")
    if cfg.min_rate * NUM_CLASSES > cfg.rate_bps:
        raise LocalError(
            f"guaranteed rates ({NUM_CLASSES} x {cfg.min_rate} bit/s) exceed the link rate "
            f"{cfg.rate_bps} bit/s; lower min_rate_bps"
        )


def _is_class(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < NUM_CLASSES


# ---------------------------------------------------------------- operations


@dataclass(frozen=True)
class Op:
    """One tc operation with the exact pyroute2 arguments.

    `kind` is "qdisc", "class" or "filter"; `action` is "add" (the applier
    derives pyroute2's command, e.g. "add-class"); `tc_kind` is the kernel
    module ("htb", "pfifo", "u32"); `options` are the remaining keyword
    arguments for `IPRoute.tc`, in the units pyroute2 expects (HTB rates in
    bytes per second, bursts in bytes). `str(op)` is the equivalent `tc` line.
    """

    kind: str
    action: str
    dev: str
    tc_kind: str
    handle: int
    parent: int
    options: tuple[tuple[str, Any], ...] = field(default=())

    @property
    def command(self) -> str:
        """pyroute2's command name: "add", "add-class", "add-filter", ..."""
        return self.action if self.kind == "qdisc" else f"{self.action}-{self.kind}"

    def option(self, name: str, default: Any = None) -> Any:
        """The value of one option, or `default`."""
        return dict(self.options).get(name, default)

    def tc_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `IPRoute.tc(op.command, op.tc_kind, index, **kwargs)`."""
        kwargs: dict[str, Any] = {"handle": self.handle, "parent": self.parent}
        for key, value in self.options:
            kwargs[key] = list(value) if isinstance(value, tuple) else value
        return kwargs

    def __str__(self) -> str:
        words = ["tc", self.kind, self.action, "dev", self.dev]
        if self.parent == TC_H_ROOT:
            words.append("root")
        else:
            words += ["parent", format_handle(self.parent)]
        opts = dict(self.options)
        if self.kind == "qdisc":
            words += ["handle", format_handle(self.handle), self.tc_kind]
            if self.tc_kind == "htb":
                words += ["default", f"{opts['default']:x}"]
            elif "limit" in opts:
                words += ["limit", str(opts["limit"])]
        elif self.kind == "class":
            words += ["classid", format_handle(self.handle), self.tc_kind]
            words += ["rate", _bit(opts["rate"]), "ceil", _bit(opts["ceil"])]
            words += ["burst", f"{opts['burst']}b", "cburst", f"{opts['cburst']}b"]
            if "prio" in opts:
                words += ["prio", str(opts["prio"])]
        else:
            proto = {ETH_P_IP: "ip", ETH_P_IPV6: "ipv6"}.get(opts["protocol"])
            words += ["protocol", proto or f"0x{opts['protocol']:04x}"]
            words += ["prio", str(opts["prio"]), self.tc_kind]
            for key in opts.get("keys", ()):
                words += ["match", *_describe_key(key, opts["protocol"])]
            words += ["flowid", format_handle(opts["target"])]
        return " ".join(words)


def _bit(bytes_per_s: int) -> str:
    return f"{bytes_per_s * 8}bit"


def _describe_key(key: str, protocol: int) -> list[str]:
    value, _, rest = key.partition("/")
    mask, _, offset = rest.partition("+")
    v, m, off = int(value, 0), int(mask, 0), int(offset or "0", 0)
    if protocol == ETH_P_IP and m == 0xFC and off == 1:
        return ["ip", "dsfield", f"0x{v:02x}", f"0x{m:02x}"]
    if protocol == ETH_P_IPV6 and m == 0x0FC00000 and off == 0:
        return ["ip6", "priority", f"0x{v >> 20:02x}", f"0x{m >> 20:02x}"]
    return ["u32", f"0x{v:08x}", f"0x{m:08x}", "at", str(off)]


def _burst(rate_bytes: int, mtu: int = _MTU - 100) -> int:
    """Bucket size for a rate: about 1 ms of traffic, at least two MTU-sized packets."""
    return max(2 * (mtu + 100), rate_bytes // 1000)


def build_plan(cfg: TcConfig) -> list[Op]:
    """The operations that build cfg's layout from a device with no root qdisc.

    Order: root qdisc, parent class, one class per priority, its fifo leaf,
    then the filters (so no filter points at a class that does not exist yet).
    """
    dev = cfg.dev
    link = cfg.rate_bps // 8  # pyroute2 takes an int HTB rate in bytes per second
    tiny = max(1, cfg.min_rate // 8)
    plan = [
        Op("qdisc", "add", dev, "htb", ROOT_HANDLE, TC_H_ROOT,
           (("default", class_minor(cfg.default_class)),)),  # the minor as an int
        Op("class", "add", dev, "htb", PARENT_CLASS, ROOT_HANDLE,
           (("rate", link), ("ceil", link), ("burst", _burst(link, cfg.mtu)),
            ("cburst", _burst(link, cfg.mtu)))),
    ]  # fmt: skip
    for cls in range(NUM_CLASSES):
        plan.append(
            Op("class", "add", dev, "htb", classid(cls), PARENT_CLASS,
               (("rate", tiny), ("ceil", link), ("burst", _burst(tiny, cfg.mtu)),
                ("cburst", _burst(link, cfg.mtu)), ("prio", cls)))
        )  # fmt: skip
        limit = cfg.short_queue_packets if cls in cfg.droppable_classes else cfg.queue_packets
        plan.append(Op("qdisc", "add", dev, "pfifo", leaf_handle(cls), classid(cls),
                       (("limit", limit),)))  # fmt: skip
    for cls, dscp in enumerate(cfg.dscp):
        plan.append(
            Op("filter", "add", dev, "u32", 0, ROOT_HANDLE,
               (("protocol", ETH_P_IP), ("prio", cls + 1), ("target", classid(cls)),
                ("keys", (f"0x{dscp << 2:02x}/0xfc+1",))))
        )  # fmt: skip
    if cfg.match_ipv6:
        for cls, dscp in enumerate(cfg.dscp):
            plan.append(
                Op("filter", "add", dev, "u32", 0, ROOT_HANDLE,
                   (("protocol", ETH_P_IPV6), ("prio", NUM_CLASSES + cls + 1),
                    ("target", classid(cls)), ("keys", (f"0x{dscp << 22:08x}/0x0fc00000+0",))))
            )  # fmt: skip
    return plan
