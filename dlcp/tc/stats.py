"""Per-class tc statistics as plain data: for `dlcp tc show` and the daemon's metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ClassStats", "format_table", "stats_as_dict", "stats_as_samples"]


@dataclass(frozen=True)
class ClassStats:
    """Counters of one priority class (HTB class 1:(0x10 + cls) and its fifo leaf).

    `drops` counts packets the class's queue refused (the leaf pfifo counts
    them, HTB counts them again on the class; the larger of the two is kept,
    never the sum). `backlog_*` is what sits in the queue now.
    """

    cls: int
    classid: str
    bytes: int
    packets: int
    drops: int
    overlimits: int
    backlog_bytes: int
    backlog_packets: int
    dscp: int | None = None  # from the class's IPv4 filter, when there is one
    queue_limit: int | None = None  # packets, from the pfifo leaf


def stats_as_dict(stats: list[ClassStats]) -> list[dict[str, Any]]:
    """One JSON-ready dict per class (the `dlcp tc show --json` format)."""
    return [asdict(s) for s in stats]


# (metric name, ClassStats field, Prometheus type, help)
_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("dlcp_tc_sent_bytes_total", "bytes", "counter", "Bytes sent by the tc class"),
    ("dlcp_tc_sent_packets_total", "packets", "counter", "Packets sent by the tc class"),
    ("dlcp_tc_dropped_packets_total", "drops", "counter", "Packets dropped by the class queue"),
    ("dlcp_tc_overlimits_total", "overlimits", "counter", "Times the class was over its rate"),
    ("dlcp_tc_backlog_bytes", "backlog_bytes", "gauge", "Bytes queued in the class now"),
    ("dlcp_tc_backlog_packets", "backlog_packets", "gauge", "Packets queued in the class now"),
)


def stats_as_samples(stats: list[ClassStats], dev: str) -> list[dict[str, Any]]:
    """Prometheus-ready samples: dicts with name, type, help, labels and value.

    Labels are `dev` and `class` (the priority class number as a string).
    Counter names end in `_total`; client_python's `CounterMetricFamily`
    accepts them as they are.
    """
    samples: list[dict[str, Any]] = []
    for name, attr, kind, text in _METRICS:
        for s in stats:
            samples.append(
                {
                    "name": name,
                    "type": kind,
                    "help": text,
                    "labels": {"dev": dev, "class": str(s.cls)},
                    "value": float(getattr(s, attr)),
                }
            )
    return samples


def format_table(stats: list[ClassStats]) -> str:
    """A human table: one line per class with DSCP, sent, dropped and backlog."""
    header = ("class", "classid", "dscp", "limit", "sent_bytes", "sent_pkts", "dropped",
              "overlimits", "backlog_b", "backlog_p")  # fmt: skip
    rows = [header]
    for s in stats:
        rows.append(
            (
                str(s.cls),
                s.classid,
                "-" if s.dscp is None else str(s.dscp),
                "-" if s.queue_limit is None else str(s.queue_limit),
                str(s.bytes),
                str(s.packets),
                str(s.drops),
                str(s.overlimits),
                str(s.backlog_bytes),
                str(s.backlog_packets),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
