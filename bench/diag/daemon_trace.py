"""dlcpd with its event loop's work traced: where a round's time goes, phase by phase.

    python bench/diag/daemon_trace.py TRACE -- [dlcpd arguments]   (runs dlcpd)
    python bench/diag/daemon_trace.py --summary TRACE

As a daemon it is `dlcp.daemon`'s main with four methods wrapped; each call
appends a line to TRACE: when it ended (perf_counter seconds), which method,
how long it took (us), the datagrams it took off the sockets, of which DATA
and RESULT packets the engine accepted, the datagrams it sent, and the peers
with datagrams still queued after it. The methods: `RoundLifecycle._start_round` (a
round's local contribution is in: the policies, the engine's `submit`, the
first flush), `Engine.submit` within it, `NetworkIn._receive` (one drain of a
socket) and `Daemon._pump` (the engine's output queued and flushed; also
called within `_start_round`). A call costs about 3 us more traced (an idle
daemon's `_pump`: 2.7 us plain, 5.7 traced); a round makes a few dozen.

The summary splits the trace into rounds at each `_start_round` and, over
every round but the first (the warm-up), reports per round the time in each
method, the drains (large ones of 1000 datagrams or more apart from the rest,
DATA and RESULT apart) and the flushes (pumps that sent 1000 datagrams or
more), each per datagram; then the timeline of the median round.
`bench/diag/veth_busbw.py` runs its daemons this way with BW_TRACE=DIR.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

BIG = 1000  # datagrams: a drain or flush this large is "large"
TRACED = ("_start_round", "submit", "_receive", "_pump")


@dataclass(frozen=True)
class Event:
    end: float  # perf_counter seconds
    name: str
    us: float
    rx: int  # datagrams taken off the sockets
    data: int  # DATA packets the engine accepted
    result: int  # RESULT packets the engine accepted
    sent: int  # datagrams sent
    backlog: int  # peers with datagrams queued after the call

    @property
    def start(self) -> float:
        return self.end - self.us / 1e6


def parse(lines: Sequence[str]) -> list[Event]:
    """The events of a trace's lines (blank lines skipped); ValueError names a bad line."""
    out = []
    for i, line in enumerate(lines, 1):
        f = line.split()
        if not f:
            continue
        if len(f) != 8 or f[1] not in TRACED:
            raise ValueError(f"trace line {i}: {line.strip()!r}")
        out.append(Event(float(f[0]), f[1], float(f[2]), *map(int, f[3:])))
    return out


def rounds(events: Sequence[Event]) -> list[list[Event]]:
    """The events from each `_start_round`'s start to the next one's (by start
    time); events before the first are dropped."""
    ordered = sorted(events, key=lambda e: e.start)
    out: list[list[Event]] = []
    for e in ordered:
        if e.name == "_start_round":
            out.append([])
        if out:
            out[-1].append(e)
    return out


def _per_dg(events: Sequence[Event], count: Callable[[Event], int]) -> str:
    n = sum(count(e) for e in events)
    us = sum(e.us for e in events)
    if not events:
        return "none"
    per = f", {us * 1e3 / n:.0f} ns a datagram" if n else ""
    return f"{len(events)} calls, {n} datagrams, {us / 1e3:.2f} ms{per}"


def summary(events: Sequence[Event]) -> str:
    """What `--summary` prints (see the module's docstring)."""
    rs = rounds(events)[1:]
    if not rs:
        return "no round after the warm-up in the trace"
    k = len(rs)
    lines = [f"{k} rounds after the warm-up; per round:"]
    for name in TRACED:
        es = [e for r in rs for e in r if e.name == name]
        lines.append(
            f"  {name:13} {len(es) / k:7.1f} calls {sum(e.us for e in es) / 1e3 / k:8.2f} ms"
        )
    drains = [e for r in rs for e in r if e.name == "_receive" and e.rx]
    for kind, of in (("DATA", lambda e: e.data), ("RESULT", lambda e: e.result)):
        mine = [e for e in drains if of(e) and of(e) >= e.rx // 2]
        for big in (True, False):
            sel = [e for e in mine if (e.rx >= BIG) == big]
            label = f"{kind} drains {'>=' if big else '<'} {BIG}"
            lines.append(f"  {label:22} {_per_dg(sel, lambda e: e.rx)} (all rounds)")
    flushes = [e for r in rs for e in r if e.name == "_pump" and e.sent >= BIG]
    lines.append(
        f"  {'flushes >= ' + str(BIG):22} {_per_dg(flushes, lambda e: e.sent)} (all rounds)"
    )
    walls = [r[-1].end - r[0].start for r in rs]
    mid = rs[walls.index(statistics.median_low(walls))]
    t0 = mid[0].start
    lines.append(
        f"the median round ({statistics.median_low(walls) * 1e3:.1f} ms), ms from its start:"
    )
    for e in mid:
        what = []
        if e.rx:
            what.append(f"took {e.rx} ({e.data} DATA, {e.result} RESULT)")
        if e.sent:
            what.append(f"sent {e.sent}")
        what.append(f"backlog {e.backlog}")
        lines.append(
            f"  {(e.start - t0) * 1e3:7.2f} {e.name:13} {e.us / 1e3:7.2f} ms  {', '.join(what)}"
        )
    return "\n".join(lines)


def _sent(daemon: Any) -> int:
    return sum(sum(p.sent_packets.values()) for p in daemon.outbox.peers.values())


def install(out: TextIO) -> None:
    """Wrap the traced methods of `Daemon` and `Engine` to write to `out`."""
    from dlcp.core.engine import Engine
    from dlcp.daemon.netin import NetworkIn
    from dlcp.daemon.rounds import RoundLifecycle
    from dlcp.daemon.server import Daemon

    clock = time.perf_counter
    # the daemon's part whose engine `submit` is (one a process): each traced
    # part has the daemon's engine, counters and outbox
    owner: list[Any] = []

    def state(d: Any) -> tuple[int, int, int, int]:
        st = d.engine.stats
        return (
            d.counters["rx_packets"],
            st["data_packets_received"],
            st["result_packets_received"],
            _sent(d),
        )

    def traced(cls: type, name: str) -> None:
        fn = getattr(cls, name)

        def call(self: Any, *args: Any, **kw: Any) -> Any:
            d = owner[0] if cls is Engine else self
            if cls is not Engine and not owner:
                owner.append(self)
            before = state(d)
            t = clock()
            try:
                return fn(self, *args, **kw)
            finally:
                end = clock()
                diff = [a - b for a, b in zip(state(d), before, strict=True)]
                out.write(
                    f"{end:.6f} {name} {(end - t) * 1e6:.1f} "
                    f"{' '.join(map(str, diff))} {len(d.outbox.backlog)}\n"
                )

        setattr(cls, name, call)

    traced(RoundLifecycle, "_start_round")
    traced(NetworkIn, "_receive")
    traced(Daemon, "_pump")
    traced(Engine, "submit")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--summary"]:
        ap = argparse.ArgumentParser(prog="daemon_trace.py --summary")
        ap.add_argument("trace", type=Path)
        args = ap.parse_args(argv[1:])
        print(summary(parse(args.trace.read_text().splitlines())))
        return 0
    if len(argv) < 2 or argv[1] != "--":
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    from dlcp.daemon.__main__ import main as dlcpd

    with open(argv[0], "w", buffering=1 << 16) as out:
        install(out)
        return dlcpd(argv[2:])


if __name__ == "__main__":
    sys.exit(main())
