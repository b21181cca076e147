"""The summary `dlcp decode` prints: counts of a capture's dlcp datagrams."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dlcp.errors import Reason

if TYPE_CHECKING:
    from dlcp.decode_cli import Datagram

__all__ = ["Summary"]

_BUCKET_COLUMNS = (
    *("job/round/bucket", "senders", "data", "retx", "done", "nack"),
    *("result", "retx", "ack", "result cover"),
)
MALFORMED_LISTED = 50  # malformed datagrams listed one by one; the rest counted


@dataclass
class _Bucket:
    """What one (job, round, bucket) showed on the wire."""

    data: int = 0
    data_retx: int = 0
    result: int = 0
    result_retx: int = 0
    done: int = 0
    nack: int = 0
    ack: int = 0
    total: int = 0
    senders: set[int] = field(default_factory=set)
    results: set[tuple[int, int]] = field(default_factory=set)  # (offset, count)

    def result_share(self) -> float | None:
        """Share of the bucket's elements that some result packet covered."""
        if not self.total:
            return None
        covered, end = 0, 0
        for off, n in sorted(self.results):
            lo, hi = max(off, end), min(off + n, self.total)
            if hi > lo:
                covered += hi - lo
            end = max(end, off + n)
        return covered / self.total


class _Tally:
    """Packets and bytes per key."""

    def __init__(self) -> None:
        self.packets: Counter[Any] = Counter()
        self.bytes: Counter[Any] = Counter()

    def add(self, key: Any, size: int) -> None:
        self.packets[key] += 1
        self.bytes[key] += size

    def rows(self) -> list[tuple[str, int, int]]:
        return [(_str(k), self.packets[k], self.bytes[k]) for k in sorted(self.packets, key=_order)]


def _order(key: Any) -> tuple[Any, ...]:
    return (0, key) if isinstance(key, int | tuple) else (1, str(key))


def _str(key: Any) -> str:
    if key is None:
        return "-"
    if isinstance(key, tuple):
        return "/".join(str(k) for k in key)
    return str(key)


class Summary:
    """Accumulates `Datagram`s (`add`), then `render`s the tables."""

    def __init__(self, *, port: int, job: int | None = None) -> None:
        self.port = port
        self.job = job  # whose MACs were checked
        self.datagrams = 0
        self.bytes = 0
        self.by_type = _Tally()
        self.by_class = _Tally()
        self.by_dscp = _Tally()
        self.by_sender = _Tally()
        self.sender_addresses: dict[int, set[str]] = {}
        self.by_round = _Tally()
        self.retransmits = _Tally()
        self.mac: Counter[str] = Counter()
        self.buckets: dict[tuple[int, int, int], _Bucket] = {}
        self.malformed: list[tuple[int, str, str, Reason, str]] = []
        self.malformed_by_reason: Counter[str] = Counter()

    def add(self, d: Datagram) -> None:
        size = len(d.data)
        self.datagrams += 1
        self.bytes += size
        if d.reject is not None:
            self.malformed_by_reason[d.reject.label] += 1
            if len(self.malformed) < MALFORMED_LISTED:
                self.malformed.append((d.frame, d.src, d.dst, d.reject, d.detail))
            return
        f = d.fields()
        ptype, flags = str(f["type"]), f["flags"]
        self.by_type.add(ptype, size)
        self.by_class.add(f["class"], size)
        self.by_dscp.add(d.dscp, size)
        self.by_sender.add(f["sender"], size)
        self.sender_addresses.setdefault(f["sender"], set()).add(d.src.rsplit(":", 1)[0])
        retx = "RETRANSMIT" in flags
        if retx:
            self.retransmits.add(ptype, size)
        if d.mac is not None:
            self.mac[d.mac] += 1
        if ptype == "CONTROL":  # daemon to daemon, in no round
            return
        self.by_round.add((f["job"], f["round"]), size)
        b = self.buckets.setdefault((f["job"], f["round"], f["bucket"]), _Bucket())
        if ptype == "DATA":
            b.data += 1
            b.data_retx += retx
            b.senders.add(f["sender"])
            b.total = max(b.total, f["total"])
        elif ptype == "RESULT":
            b.result += 1
            b.result_retx += retx
            b.total = max(b.total, f["total"])
            b.results.add((f["offset"], f["count"]))
        elif ptype == "DONE":
            b.done += 1
        elif ptype == "NACK":
            b.nack += 1
        elif ptype == "ACK":
            b.ack += 1

    def render(self, name: str, fragments: int = 0) -> str:
        bad = sum(self.malformed_by_reason.values())
        lines = [
            f"{name}: {self.datagrams} dlcp datagrams on UDP port {self.port}, "
            f"{self.bytes} bytes (UDP payload), {bad} malformed"
            + (f", {fragments} IP fragments skipped" if fragments else "")
        ]
        for title, key, tally in (
            ("by type", "type", self.by_type),
            ("by priority class", "class", self.by_class),
            ("by DSCP", "dscp", self.by_dscp),
            ("by round", "job/round", self.by_round),
        ):
            lines += _table(title, (key, "packets", "bytes"), tally.rows())
        lines += _table(
            "by sender",
            ("sender", "packets", "bytes", "from"),
            [
                (*row, ",".join(sorted(self.sender_addresses.get(int(row[0]), ()))))
                for row in self.by_sender.rows()
            ],
        )
        retx = sum(self.retransmits.packets.values())
        lines.append("")
        lines.append(
            f"retransmissions: {retx} packets, {sum(self.retransmits.bytes.values())} bytes"
            + (
                " (" + ", ".join(f"{t} {n}" for t, n, _ in self.retransmits.rows()) + ")"
                if retx
                else ""
            )
        )
        if self.job is not None:
            lines.append(
                f"MAC of job {self.job}: {self.mac['ok']} ok, {self.mac['bad']} bad"
                + (" (MAC FAILURES)" if self.mac["bad"] else "")
            )
        lines += _table(
            "per bucket (data/result: packets, of them retransmitted; result cover: share "
            "of the bucket's elements some result packet carried)",
            _BUCKET_COLUMNS,
            [
                (
                    _str(k),
                    len(b.senders),
                    b.data,
                    b.data_retx,
                    b.done,
                    b.nack,
                    b.result,
                    b.result_retx,
                    b.ack,
                    _share(b.result_share()),
                )
                for k, b in sorted(self.buckets.items())
            ],
        )
        if bad:
            lines += _table(
                "malformed (decoder reject reason)",
                ("reason", "packets"),
                sorted(self.malformed_by_reason.items()),
            )
            lines.append("")
            for frame, src, dst, reason, detail in self.malformed:
                lines.append(f"  frame {frame}  {src} > {dst}  {reason.label}: {detail}")
            if bad > len(self.malformed):
                lines.append(f"  ... and {bad - len(self.malformed)} more")
        return "\n".join(lines)


def _share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _table(title: str, head: tuple[str, ...], rows: list[tuple[Any, ...]]) -> list[str]:
    cells = [tuple(str(c) for c in head), *[tuple(str(c) for c in r) for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    out = ["", f"{title}:"]
    if not rows:
        return [*out, "  (none)"]
    for r in cells:
        out.append(
            "  "
            + "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
        )
    return out
