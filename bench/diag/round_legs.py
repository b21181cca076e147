"""A dlcp round's legs in virtual time: when each kind of packet was sent.

    python bench/diag/round_legs.py [--hosts 3] [--rate 200e6] [--size 5MB]
        [--loss 5] [--bound 0.01] [--iters 3]

Runs `dlcp simulate`'s dlcp rounds (the real engines and send path,
`dlcp.sim.dlcprun.DlcpRun`) and records every datagram the hosts hand to
the fabric. For each round it prints, per packet type (DATA, RESULT, NACK,
DONE, ACK), first sends apart from retransmissions and data-leg packets
apart from result-leg ones: how many were sent and when the first and the
last left, in ms from the round's start (the warm-up round not shown).
The legs' overlap (RESULT's first against DATA's last) and the gaps
between a leg and its retransmissions are what to read: where a lossy
round's time goes beyond the wire's.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from dlcp.sim import host as simhost
from dlcp.sim.dlcprun import DlcpRun
from dlcp.sim.scenario import Scenario
from dlcp.sim.settings import Settings
from dlcp.wire.header import Flags, PacketType, header_of_valid


@dataclass
class Sent:
    at: float
    ptype: PacketType
    flags: Flags


def record(log: list[Sent]) -> None:
    """Wrap the simulated hosts' path so that every datagram sent is logged."""
    send = simhost._Path.send

    def logged(
        self: simhost._Path, datagrams: Sequence[bytes], dest: tuple[str, int], tos: int
    ) -> int:
        now = self.host.fabric.loop.now
        for dg in datagrams:
            h = header_of_valid(dg)
            log.append(Sent(now, h.type, h.flags))
        return send(self, datagrams, dest, tos)

    simhost._Path.send = logged  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--rate", type=float, default=200e6, help="link rate, bit/s")
    ap.add_argument("--size", type=float, default=5e6, help="all-reduce bytes")
    ap.add_argument("--loss", type=float, default=5.0, help="% random loss (0: clean)")
    ap.add_argument("--bound", type=float, default=0.01, help="dlcp's loss bound")
    ap.add_argument("--iters", type=int, default=3)
    a = ap.parse_args(argv)
    scenario = Scenario(name="loss", loss_pct=a.loss) if a.loss else Scenario()
    s = Settings(
        hosts=a.hosts, rate_bps=a.rate, size_bytes=int(a.size), iters=a.iters, warmup=1,
        loss_bound=a.bound, scenario=scenario,
    )  # fmt: skip
    log: list[Sent] = []
    record(log)
    run = DlcpRun(s, None)
    steps = run.run()
    for i, st in enumerate(steps):
        t0, t1 = st.start, max(st.ends.values())
        rows: dict[tuple[str, bool, bool], list[float]] = {}
        for r in log:
            if t0 <= r.at <= t1:
                key = (
                    r.ptype.name,
                    bool(r.flags & Flags.RETRANSMIT),
                    bool(r.flags & Flags.RESULT_LEG),
                )
                rows.setdefault(key, []).append(r.at - t0)
        print(f"round {i} (after the warm-up): {(t1 - t0) * 1e3:.1f} ms")
        for (name, again, leg), at in sorted(rows.items(), key=lambda kv: min(kv[1])):
            what = f"{name}{' again' if again else ''}{' (result leg)' if leg else ''}"
            first, last = min(at) * 1e3, max(at) * 1e3
            print(f"  {what:28s} {len(at):7d}  first {first:7.1f} ms  last {last:7.1f} ms")


if __name__ == "__main__":
    main()
