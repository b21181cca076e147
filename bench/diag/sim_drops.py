"""Where and when a `dlcp simulate` run drops packets, and host 0's pacing rates.

    python bench/diag/sim_drops.py [dlcp simulate arguments]
    e.g. python bench/diag/sim_drops.py --hosts 16 --rate 10gbit --size 10MB \
        --iters 2 --warmup 1 --backends dlcp

Runs `dlcp simulate` in process with the ports' `offer` wrapped: every drop
is counted by the port's tier (host-up, host-down, leaf-up, spine-down) and
class, and by the half-millisecond of virtual time it happened in. Prints the
rounds' times, the drops by tier and class, the drops per 0.5 ms bin, and at
each round's end on host 0 its peers' pacing rates (the first path's, Gbit/s).
Drops at exact multiples of the receive moderation period (2 ms) are the
hosts' polls in lockstep; drops at each round's start are its first bursts.
Diagnosis only: nothing here is a product figure.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if not os.environ.get("PYTHONPATH"):  # else the checkout PYTHONPATH names
    sys.path.insert(0, str(ROOT))

import dlcp.sim.cli as cli  # noqa: E402
import dlcp.sim.dlcprun as dlcprun  # noqa: E402
from dlcp.sim import port  # noqa: E402
from dlcp.sim.run import simulate  # noqa: E402

BIN_S = 0.0005


def main() -> None:
    by_place: Counter[tuple[str, int]] = Counter()
    by_time: Counter[int] = Counter()
    offer = port.Port.offer

    def counted(self: port.Port, pkt: port.Packet) -> None:
        before = self.drops[pkt.cls]
        offer(self, pkt)
        if self.drops[pkt.cls] > before:
            by_place[(self.tier, pkt.cls)] += 1
            by_time[int(self.loop.now / BIN_S)] += 1

    on_event = dlcprun.DlcpRun._on_event

    def rates(self: dlcprun.DlcpRun, host: Any, ev: Any, now: float) -> None:
        if host.me == 0:
            r = [round(p.rate.paths[0].rate_bps / 1e9, 3) for p in host.peers.values()]
            print(
                f"t={now * 1e3:.2f} ms round {ev.round} on host 0: peers' rates Gbit/s {r}"
            )
        on_event(self, host, ev, now)

    port.Port.offer = counted  # type: ignore[method-assign]
    dlcprun.DlcpRun._on_event = rates  # type: ignore[method-assign]
    ap = argparse.ArgumentParser()
    cli.register(ap.add_subparsers())
    s, backends = cli.settings_of(ap.parse_args(["simulate", *sys.argv[1:]]))
    for rec in simulate(s, backends):
        times = ", ".join(f"{t * 1e3:.1f}" for t in rec["times_s"])
        print(f"{rec['backend']}: rounds (ms) {times}; lanes lost {rec.get('loss_frac', 0):.3%}")
    print(
        "drops by tier and class:",
        ", ".join(f"{t} {c}: {n}" for (t, c), n in sorted(by_place.items())),
    )
    print(
        "drops per 0.5 ms (ms: drops):",
        ", ".join(f"{k * BIN_S * 1e3:g}: {by_time[k]}" for k in sorted(by_time)),
    )


if __name__ == "__main__":
    main()
