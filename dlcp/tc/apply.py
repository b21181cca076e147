"""The thin applier: sends a tc plan through pyroute2 and reads the result back.

`apply_plan` is idempotent: it reads the device's current tc state, and when
that already equals what the plan builds it changes nothing (counters keep
running). Otherwise it removes the root qdisc and builds the plan from
scratch. It refuses to remove a root qdisc that dlcp did not make unless
`force=True`. A root qdisc counts as dlcp's when it is HTB with handle 1: and
all its classes are 1:1 or 1:10..1:17; the kernel's own default (handle 0:,
e.g. noqueue, pfifo_fast, mq) is replaced silently.

pyroute2 (0.9) quirks handled here, see DESIGN.md for the rest:
- `IPRoute(netns=name)` creates the namespace when it is missing unless
  `flags=0` is passed; we check for it first and pass `flags=0`.
- On the synchronous `IPRoute`, `tc("dump-class")`/`tc("dump-filter")` return
  async generators; `get_classes()`/`get_filters()` return tuples.
- u32 selector keys are decoded 4 bytes off; we decode them from the raw
  attribute (`_u32_keys`).
- An int HTB `rate`/`ceil` is bytes per second, not bits.
- The synchronous `IPRoute` runs its own asyncio loop, so it fails inside a
  running loop ("This event loop is already running"). The public functions
  here notice that and do their work on a helper thread (blocking the caller
  for the few milliseconds it takes); async code should still prefer
  `await asyncio.to_thread(read_stats, dev)`.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import socket
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import Any, ParamSpec, TypeVar

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl.tcmsg.common import calc_xmittime

from dlcp.errors import LocalError
from dlcp.tc.plan import (
    ETH_P_IP,
    NUM_CLASSES,
    PARENT_CLASS,
    ROOT_HANDLE,
    TC_H_ROOT,
    Op,
    class_minor,
    classid,
    format_handle,
)
from dlcp.tc.stats import ClassStats

__all__ = ["NEEDS_ROOT", "apply_plan", "clear", "is_applied", "read_stats", "root_qdisc"]

NEEDS_ROOT = "tc needs root (CAP_NET_ADMIN)"
NETNS_DIR = "/run/netns"

_OUR_CLASSES = frozenset({PARENT_CLASS, *(classid(c) for c in range(NUM_CLASSES))})
_TC_H_INGRESS_PARENT = 0xFFFFFFF1  # ingress/clsact qdiscs hang here: not ours, left alone

State = frozenset[tuple[Any, ...]]
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _off_loop(func: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run `func` on a helper thread when called from inside a running asyncio loop."""

    @functools.wraps(func)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return func(*args, **kwargs)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlcp-tc") as pool:
            return pool.submit(func, *args, **kwargs).result()

    return wrapper


# ---------------------------------------------------------------- plumbing


@contextmanager
def _rtnl(netns: str | None) -> Iterator[IPRoute]:
    """An IPRoute socket in `netns` (the current namespace when None)."""
    if netns is not None:
        path = netns if "/" in netns else os.path.join(NETNS_DIR, netns)
        if not os.path.exists(path):
            raise LocalError(f"no such network namespace: {netns}")
    try:
        ipr = IPRoute(netns=netns, flags=0) if netns is not None else IPRoute()
    except PermissionError:
        raise LocalError(NEEDS_ROOT) from None
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EACCES):
            raise LocalError(NEEDS_ROOT) from None
        raise LocalError(f"cannot open netlink in netns {netns}: {exc}") from None
    try:
        yield ipr
    finally:
        ipr.close()


def _error(exc: NetlinkError, what: str) -> LocalError:
    if exc.code in (errno.EPERM, errno.EACCES):
        return LocalError(NEEDS_ROOT)
    return LocalError(f"{what}: {os.strerror(exc.code)}")


def _index(ipr: IPRoute, dev: str, netns: str | None) -> int:
    found = ipr.link_lookup(ifname=dev)
    if not found:
        where = f" in netns {netns}" if netns is not None else ""
        raise LocalError(f"no such device: {dev}{where}")
    return int(found[0])


def _root(ipr: IPRoute, index: int) -> Any:
    for q in ipr.get_qdiscs(index):
        if q["index"] == index and q["parent"] == TC_H_ROOT:
            return q
    return None


def _ownership(ipr: IPRoute, index: int, root: Any) -> str:
    """'none' (kernel default or nothing), 'ours' or 'foreign'."""
    if root is None or root["handle"] == 0:
        return "none"
    if root.get_attr("TCA_KIND") == "htb" and root["handle"] == ROOT_HANDLE:
        handles = {c["handle"] for c in ipr.get_classes(index) if c["index"] == index}
        if handles <= _OUR_CLASSES:
            return "ours"
    return "foreign"


def _u32_keys(sel: Any) -> tuple[tuple[int, int, int, int], ...]:
    """(mask, value, off, offmask) of each key, decoded from the raw TCA_U32_SEL bytes.

    pyroute2 decodes the keys from the wrong offset, so we read them ourselves:
    nla header (4 bytes), tc_u32_sel (16 bytes, nkeys at byte 2), then
    tc_u32_key {__be32 mask, __be32 val, int off, int offmask} each.
    """
    data = bytes(sel.data[sel.offset : sel.offset + sel.length])
    nkeys = data[4 + 2]
    keys = []
    for k in range(nkeys):
        base = 4 + 16 + 16 * k
        mask, val = struct.unpack_from("!II", data, base)
        off, offmask = struct.unpack_from("=ii", data, base + 8)
        keys.append((mask, val, off, offmask))
    return tuple(keys)


def _read_state(ipr: IPRoute, index: int) -> State:
    """What tc objects dlcp's layout consists of on the device, normalised."""
    items: set[tuple[Any, ...]] = set()
    for q in ipr.get_qdiscs(index):
        if q["index"] != index or q["parent"] == _TC_H_INGRESS_PARENT or q["handle"] == 0:
            continue
        kind = q.get_attr("TCA_KIND")
        opts = q.get_attr("TCA_OPTIONS")
        if kind == "htb":
            params: tuple[Any, ...] = (("default", opts.get_attr("TCA_HTB_INIT")["defcls"]),)
        elif kind in ("pfifo", "bfifo"):
            params = (("limit", opts["limit"]),)
        else:
            params = ("?",)
        items.add(("qdisc", q["handle"], q["parent"], kind, params))
    for c in ipr.get_classes(index):
        if c["index"] != index:
            continue
        kind = c.get_attr("TCA_KIND")
        if kind != "htb":
            items.add(("class", c["handle"], c["parent"], kind))
            continue
        opts = c.get_attr("TCA_OPTIONS")
        p = opts.get_attr("TCA_HTB_PARMS")
        rate = opts.get_attr("TCA_HTB_RATE64") or p["rate"]
        ceil = opts.get_attr("TCA_HTB_CEIL64") or p["ceil"]
        prio = p["prio"] if p["level"] == 0 else None  # inner classes report no prio
        # a class right under the qdisc is dumped with parent "root", not 1:
        parent = ROOT_HANDLE if c["parent"] == TC_H_ROOT else c["parent"]
        items.add(("class", c["handle"], parent, "htb",
                   prio, rate, ceil, p["buffer"], p["cbuffer"]))  # fmt: skip
    for parent in _filter_parents(items):
        for f in ipr.get_filters(index=index, parent=parent):
            opts = f.get_attr("TCA_OPTIONS")
            if f["index"] != index or opts is None:
                continue
            kind = f.get_attr("TCA_KIND")
            prio, protocol = f["info"] >> 16, socket.ntohs(f["info"] & 0xFFFF)
            if kind != "u32":
                items.add(("filter", parent, protocol, prio, kind))
                continue
            sel = opts.get_attr("TCA_U32_SEL")
            if sel is None:  # the hash table u32 makes for each prio
                continue
            items.add(("filter", parent, protocol, prio, opts.get_attr("TCA_U32_CLASSID"),
                       _u32_keys(sel)))  # fmt: skip
    return frozenset(items)


def _filter_parents(items: set[tuple[Any, ...]]) -> list[int]:
    return sorted(
        {it[1] for it in items if it[0] == "qdisc" and it[1] >> 16 == ROOT_HANDLE >> 16}
        | {it[1] for it in items if it[0] == "class" and it[1] >> 16 == ROOT_HANDLE >> 16}
    )


def _key_tuples(key: str) -> tuple[tuple[int, int, int, int], ...]:
    """A pyroute2 u32 key string ("0xb8/0xfc+1") as the kernel then stores it.

    This mirrors pyroute2's packing: leading zero mask bytes move the offset,
    each covered byte goes to the next offset, and a 32-bit key starts at the
    first covered byte, even when that is not 4-byte aligned (tc would align).
    """
    value_s, _, rest = key.partition("/")
    mask_s, _, off_s = rest.partition("+")
    offset = int(off_s or "0", 0)
    if mask_s.startswith("0x"):
        digits = mask_s[2:]
        while digits.startswith("00"):
            offset += 1
            digits = digits[2:]
    value, mask = int(value_s, 0), int(mask_s, 0)
    header: dict[int, tuple[int, int]] = {}
    for shift in (24, 16, 8, 0):
        bmask = (mask >> shift) & 0xFF
        if bmask:
            header[offset] = ((value >> shift) & bmask, bmask)
            offset += 1
    keys = []
    pos = 0
    for pos_ in sorted(header):
        if pos_ < pos:
            continue
        kmask = kval = 0
        for i in range(4):
            bval, bmask = header.get(pos_ + i, (0, 0))
            kmask |= bmask << (24 - 8 * i)
            kval |= bval << (24 - 8 * i)
        keys.append((kmask, kval, pos_, 0))
        pos = pos_ + 4
    return tuple(keys)


def _expected_state(plan: list[Op]) -> State:
    items: set[tuple[Any, ...]] = set()
    for op in plan:
        opts = dict(op.options)
        if op.kind == "qdisc":
            if op.tc_kind == "htb":
                params: tuple[Any, ...] = (("default", opts["default"]),)
            else:
                params = (("limit", opts["limit"]),)
            items.add(("qdisc", op.handle, op.parent, op.tc_kind, params))
        elif op.kind == "class":
            rate, ceil = opts["rate"], opts["ceil"]
            prio = opts.get("prio", 0) if op.parent != ROOT_HANDLE else None
            items.add(("class", op.handle, op.parent, op.tc_kind, prio, rate, ceil,
                       calc_xmittime(rate, opts["burst"]),
                       calc_xmittime(ceil, opts["cburst"])))  # fmt: skip
        else:
            keys = tuple(k for key in opts["keys"] for k in _key_tuples(key))
            items.add(("filter", op.parent, opts["protocol"], opts["prio"], opts["target"], keys))
    return frozenset(items)


def _check_plan(plan: list[Op]) -> str:
    if not plan:
        raise LocalError("empty tc plan")
    devs = {op.dev for op in plan}
    if len(devs) != 1:
        raise LocalError(f"a tc plan must be for one device, got {sorted(devs)}")
    first = plan[0]
    if first.kind != "qdisc" or first.parent != TC_H_ROOT or first.handle != ROOT_HANDLE:
        raise LocalError("a tc plan must start with the root qdisc 1:")
    return first.dev


def _delete_root(ipr: IPRoute, index: int, dev: str) -> None:
    try:
        ipr.tc("del", index=index, handle=0, parent=TC_H_ROOT)
    except NetlinkError as exc:
        if exc.code not in (errno.ENOENT, errno.EINVAL):
            raise _error(exc, f"tc qdisc del dev {dev} root") from None


# ---------------------------------------------------------------- public API


@_off_loop
def root_qdisc(dev: str, *, netns: str | None = None) -> tuple[str, str] | None:
    """(kind, handle) of the device's root qdisc, e.g. ("htb", "1:"); None if none."""
    with _rtnl(netns) as ipr:
        index = _index(ipr, dev, netns)
        root = _root(ipr, index)
        if root is None:
            return None
        return str(root.get_attr("TCA_KIND")), format_handle(root["handle"])


@_off_loop
def is_applied(plan: list[Op], *, netns: str | None = None) -> bool:
    """Whether the device's tc state is exactly what `plan` builds."""
    dev = _check_plan(plan)
    with _rtnl(netns) as ipr:
        index = _index(ipr, dev, netns)
        try:
            return _read_state(ipr, index) == _expected_state(plan)
        except NetlinkError as exc:
            raise _error(exc, f"reading tc state of {dev}") from None


@_off_loop
def apply_plan(plan: list[Op], *, netns: str | None = None, force: bool = False) -> None:
    """Make the device's tc state what `plan` builds (idempotent).

    Raises LocalError when the device has a root qdisc dlcp did not make
    (unless `force`), when the device or namespace is missing, without
    CAP_NET_ADMIN, or when the kernel rejects an operation (the partial
    layout is removed again).
    """
    dev = _check_plan(plan)
    expected = _expected_state(plan)
    with _rtnl(netns) as ipr:
        index = _index(ipr, dev, netns)
        try:
            if _read_state(ipr, index) == expected:
                return
            root = _root(ipr, index)
            owner = _ownership(ipr, index, root)
        except NetlinkError as exc:
            raise _error(exc, f"reading tc state of {dev}") from None
        if owner == "foreign" and not force:
            kind, handle = root.get_attr("TCA_KIND"), format_handle(root["handle"])
            raise LocalError(
                f"{dev} already has a root qdisc {kind} {handle} that dlcp did not make; "
                "use --force (force=True) to replace it"
            )
        if owner != "none":
            _delete_root(ipr, index, dev)
        for op in plan:
            try:
                ipr.tc(op.command, op.tc_kind, index, **op.tc_kwargs())
            except NetlinkError as exc:
                err = _error(exc, str(op))
                with suppress(LocalError):
                    _delete_root(ipr, index, dev)
                raise err from None


@_off_loop
def clear(dev: str, *, netns: str | None = None, force: bool = False) -> None:
    """Remove dlcp's root qdisc (the kernel puts its default back); no error if none.

    Raises LocalError, leaving it in place, when the root qdisc is one dlcp did
    not make, unless `force`.
    """
    with _rtnl(netns) as ipr:
        index = _index(ipr, dev, netns)
        try:
            root = _root(ipr, index)
            owner = _ownership(ipr, index, root)
        except NetlinkError as exc:
            raise _error(exc, f"reading tc state of {dev}") from None
        if owner == "none":
            return
        if owner == "foreign" and not force:
            kind, handle = root.get_attr("TCA_KIND"), format_handle(root["handle"])
            raise LocalError(
                f"{dev} has a root qdisc {kind} {handle} that dlcp did not make; "
                "use --force (force=True) to remove it"
            )
        _delete_root(ipr, index, dev)


@_off_loop
def read_stats(dev: str, *, netns: str | None = None) -> list[ClassStats]:
    """Per-class counters of dlcp's layout on `dev`, class 0 first; [] when it has none.

    Drops come from the class and from its leaf fifo (where pfifo counts them);
    the larger of the two is reported.
    """
    with _rtnl(netns) as ipr:
        index = _index(ipr, dev, netns)
        try:
            classes = [c for c in ipr.get_classes(index) if c["index"] == index]
            leaves = {
                q["parent"]: q
                for q in ipr.get_qdiscs(index)
                if q["index"] == index and q["parent"] >> 16 == ROOT_HANDLE >> 16
            }
            dscp = _dscp_by_class(ipr, index) if classes else {}
        except NetlinkError as exc:
            raise _error(exc, f"reading tc stats of {dev}") from None
    by_minor = {class_minor(c): c for c in range(NUM_CLASSES)}
    out: list[ClassStats] = []
    for c in classes:
        handle = c["handle"]
        if handle >> 16 != ROOT_HANDLE >> 16 or (handle & 0xFFFF) not in by_minor:
            continue
        cls = by_minor[handle & 0xFFFF]
        basic, queue = _stats2(c)
        leaf = leaves.get(handle)
        leaf_drops, limit = 0, None
        if leaf is not None:
            leaf_drops = _stats2(leaf)[1].get("drops", 0)
            opts = leaf.get_attr("TCA_OPTIONS")
            if leaf.get_attr("TCA_KIND") == "pfifo" and opts is not None:
                limit = int(opts["limit"])
        out.append(
            ClassStats(
                cls=cls,
                classid=format_handle(handle),
                bytes=int(basic.get("bytes", 0)),
                packets=int(basic.get("packets", 0)),
                drops=int(max(queue.get("drops", 0), leaf_drops)),
                overlimits=int(queue.get("overlimits", 0)),
                backlog_bytes=int(queue.get("backlog", 0)),
                backlog_packets=int(queue.get("qlen", 0)),
                dscp=dscp.get(handle),
                queue_limit=limit,
            )
        )
    out.sort(key=lambda s: s.cls)
    return out


def _stats2(msg: Any) -> tuple[dict[str, int], dict[str, int]]:
    """(basic, queue) counters from a tc message's TCA_STATS2."""
    stats = msg.get_attr("TCA_STATS2")
    if stats is None:
        return {}, {}
    basic = stats.get_attr("TCA_STATS_BASIC") or {}
    queue = stats.get_attr("TCA_STATS_QUEUE") or {}
    return dict(basic), dict(queue)


def _dscp_by_class(ipr: IPRoute, index: int) -> dict[int, int]:
    """classid -> DSCP, from IPv4 u32 filters on 1: that match the TOS byte with mask 0xfc."""
    out: dict[int, int] = {}
    for f in ipr.get_filters(index=index, parent=ROOT_HANDLE):
        opts = f.get_attr("TCA_OPTIONS")
        if f.get_attr("TCA_KIND") != "u32" or opts is None:
            continue
        sel = opts.get_attr("TCA_U32_SEL")
        target = opts.get_attr("TCA_U32_CLASSID")
        if sel is None or target is None or socket.ntohs(f["info"] & 0xFFFF) != ETH_P_IP:
            continue
        keys = _u32_keys(sel)
        if len(keys) == 1 and keys[0][0] == 0xFC000000 and keys[0][2] == 1:
            out.setdefault(target, keys[0][1] >> 26)
    return out
