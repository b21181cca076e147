"""What every benchmark shares: sizes and rates, percentiles, the JSON records.

Pure: no namespaces, no processes. The JSON formats are the public surface of
DESIGN.md "Public surfaces" (a list with one object per backend run); the
keys listed there are always present, more keys are added after them.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dlcp.bench.backends import TABLE as BACKEND_TABLE
from dlcp.errors import LocalError

__all__ = [
    "ALLREDUCE_KEYS",
    "BACKENDS",
    "CODECS",
    "SCENARIOS",
    "TRAIN_KEYS",
    "BenchError",
    "busbw_gbps",
    "check_backends",
    "format_bytes",
    "format_rate",
    "parse_backends",
    "parse_rate",
    "parse_size",
    "percentile",
    "read_json",
    "say",
    "summarize_times",
    "tta_from_curve",
    "write_json",
]

SCENARIOS: tuple[str, ...] = ("clean", "loss", "burst", "congested", "multipath", "pathdown")
CODECS: tuple[str, ...] = ("fp32", "fp16", "thc8", "thc4", "fft")
CODECS += ("sketch",)  # two rounds a bucket: the index union, then the cells
# Backends of `--backends`: dlcp, the PyTorch baselines, dlcp's ablations
# (dlcp.bench.backends says how each runs).
BACKENDS: tuple[str, ...] = tuple(BACKEND_TABLE)

ALLREDUCE_KEYS: tuple[str, ...] = (
    "backend",
    "codec",
    "scenario",
    "hosts",
    "size_bytes",
    "iters",
    "times_s",
    "p50_s",
    "p99_s",
    "busbw_gbps",
    "cpu_s",
    "loss_frac",
    "cpu_bound",
)
TRAIN_KEYS: tuple[str, ...] = (
    "backend",
    "codec",
    "scenario",
    "target_acc",
    "tta_s",
    "final_acc",
    "steps",
    "curve",
    "cpu_bound",
)


_T0 = time.monotonic()


def say(message: str) -> None:
    """A progress line on stderr, with the seconds since the program started."""
    print(f"dlcp bench [{time.monotonic() - _T0:5.0f}s]: {message}", file=sys.stderr, flush=True)


class BenchError(LocalError):
    """A benchmark could not run; the message says why (one line)."""


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
}


def parse_size(text: str) -> int:
    """'32MB' -> 32_000_000, '32MiB' or '32M' -> 33_554_432, '4096' -> 4096 bytes."""
    m = _SIZE_RE.match(text.lower())
    if m is None or m.group(2) not in _SIZE_UNITS:
        raise BenchError(f"bad size {text!r}: expected e.g. 32MB, 32MiB, 4096")
    value = round(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
    if value <= 0:
        raise BenchError(f"bad size {text!r}: must be positive")
    return value


def parse_rate(text: str) -> int | None:
    """'none' -> None (unshaped links); '1gbit', '200mbit', ... -> bit/s."""
    if text.strip().lower() == "none":
        return None
    from dlcp.tc.plan import parse_rate as tc_parse_rate

    try:
        return int(tc_parse_rate(text))
    except LocalError as exc:
        raise BenchError(str(exc)) from None


def format_rate(bps: float | None) -> str:
    """1e9 -> '1gbit', 2e8 -> '200mbit', None -> 'none'."""
    if bps is None:
        return "none"
    for unit, div in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= div:
            v = bps / div
            return f"{v:g}{unit}" if v == round(v, 3) else f"{v:.3g}{unit}"
    return f"{bps:g}bit"


def format_bytes(n: float) -> str:
    """32_000_000 -> '32MB' (decimal units, as `--size` reads them)."""
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            v = n / div
            return f"{v:g}{unit}" if v == round(v, 2) else f"{v:.3g}{unit}"
    return f"{int(n)}B"


def parse_backends(text: str) -> list[str]:
    """'dlcp,gloo' -> ['dlcp', 'gloo'] (order kept, repeats dropped)."""
    out: list[str] = []
    for part in text.split(","):
        name = part.strip().lower()
        if not name:
            continue
        if name not in BACKENDS:
            raise BenchError(f"unknown backend {name!r}; valid backends: {', '.join(BACKENDS)}")
        if name not in out:
            out.append(name)
    if not out:
        raise BenchError("--backends names no backend")
    return out


def check_backends(names: Sequence[str], bench: str) -> None:
    """A BenchError naming the first of `names` that `bench` cannot run, and why."""
    if not names:
        raise BenchError("--backends names no backend")
    for name in names:
        b = BACKEND_TABLE.get(name)
        if b is None:
            raise BenchError(f"unknown backend {name!r}; valid backends: {', '.join(BACKENDS)}")
        why = b.refused.get(bench)
        if why:
            raise BenchError(f"bench {bench} cannot run {name}: {why}")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default).

    NaN for no values.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    xs = sorted(float(v) for v in values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    frac = pos - lo
    return xs[lo] + (xs[hi] - xs[lo]) * frac


def busbw_gbps(size_bytes: int, hosts: int, seconds: float) -> float:
    """All-reduce bus bandwidth, Gbit/s: 2(n-1)/n of the buffer per `seconds`
    (NCCL's definition; a ring moves that much through every host's link)."""
    if seconds <= 0 or not math.isfinite(seconds) or hosts < 2:
        return math.nan
    return 2 * (hosts - 1) / hosts * size_bytes * 8 / seconds / 1e9


def summarize_times(times_s: Sequence[float], size_bytes: int, hosts: int) -> dict[str, float]:
    """p50_s, p99_s, mean_s, max_s and busbw_gbps (at the median) of iteration times."""
    p50 = percentile(times_s, 50)
    return {
        "p50_s": p50,
        "p99_s": percentile(times_s, 99),
        "mean_s": sum(times_s) / len(times_s) if times_s else math.nan,
        "max_s": max(times_s) if times_s else math.nan,
        "busbw_gbps": busbw_gbps(size_bytes, hosts, p50),
    }


def tta_from_curve(curve: Iterable[Sequence[float]], target: float) -> float | None:
    """The first time of a [t, acc] curve at which acc >= target, else None."""
    for t, acc in curve:
        if acc >= target:
            return float(t)
    return None


def _clean(value: Any) -> Any:
    """JSON-safe: NaN and infinities become null (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write_json(path: Path | str, records: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> None:
    """Write `records` as a JSON list, each with `keys` first (checked present).

    Written to a temporary file and renamed, so a reader never sees half a file.
    """
    rows = []
    for i, rec in enumerate(records):
        missing = [k for k in keys if k not in rec]
        if missing:
            raise BenchError(f"record {i} lacks {', '.join(missing)}")
        ordered = {k: rec[k] for k in keys}
        ordered.update({k: v for k, v in rec.items() if k not in ordered})
        rows.append(_clean(ordered))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rows, indent=2) + "\n")
    tmp.replace(path)


def read_json(path: Path | str) -> list[dict[str, Any]]:
    """A benchmark JSON file (a list of records)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise BenchError(f"{path}: not a list of benchmark records")
    return data
