"""Per-host daemon configuration for the testbed, and a small TOML writer for it."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dlcp.testbed.plan import TestbedError, TestbedSpec, host_address

__all__ = ["daemon_config", "merge_config", "to_toml"]


def daemon_config(
    spec: TestbedSpec,
    host: int,
    socket: Path | str,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The config of host `host`'s daemon: its socket, its addresses, all peers.

    `extra` is merged in (nested tables merge, other values replace).
    """
    config: dict[str, Any] = {
        "daemon": {
            "socket": str(socket),
            "metrics_port": spec.metrics_port,
            "host_index": host,
        },
        "network": {
            "addresses": [host_address(host, p) for p in range(spec.paths)],
            "udp_port": spec.udp_port,
            "peers": [
                {"index": i, "addresses": [host_address(i, p) for p in range(spec.paths)]}
                for i in range(spec.hosts)
                if i != host
            ],
        },
    }
    return merge_config(config, extra) if extra else config


def merge_config(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`base` updated by `extra`, recursing into tables both have."""
    merged = dict(base)
    for key, value in extra.items():
        old = merged.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            merged[key] = merge_config(old, value)
        else:
            merged[key] = value
    return merged


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key(key: str) -> str:
    if not isinstance(key, str):
        raise TestbedError(f"TOML keys must be strings, not {key!r}")
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _string(text: str) -> str:
    # JSON's escapes are valid TOML basic-string escapes; TOML also forbids raw DEL.
    return json.dumps(text).replace("\x7f", "\\u007f")


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str | Path):
        return _string(str(value))
    if isinstance(value, Mapping):
        inner = ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items())
        return f"{{{inner}}}" if inner else "{}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TestbedError(f"cannot write {value!r} ({type(value).__name__}) as TOML")


def _table(prefix: list[str], table: Mapping[str, Any], out: list[str]) -> None:
    scalars = [(k, v) for k, v in table.items() if not isinstance(v, Mapping)]
    tables = [(k, v) for k, v in table.items() if isinstance(v, Mapping)]
    if prefix and (scalars or not tables):
        if out:
            out.append("")
        out.append("[" + ".".join(_key(k) for k in prefix) + "]")
    out.extend(f"{_key(k)} = {_value(v)}" for k, v in scalars)
    for key, sub in tables:
        _table([*prefix, key], sub, out)


def to_toml(data: Mapping[str, Any]) -> str:
    """Render nested mappings of str/int/float/bool/list values as TOML.

    Lists of tables are written as arrays of inline tables.
    """
    out: list[str] = []
    _table([], data, out)
    return "\n".join(out) + "\n"
