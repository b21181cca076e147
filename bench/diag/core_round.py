"""CPU time of the sans-IO core for all-reduce rounds, without sockets or daemons.

    python bench/diag/core_round.py [--size 100MB] [--rounds 10] [--payload 8908] [--mac ghash-aes]
                               [--out] [--profile]

Two `Engine`s in one process (the 2-host transpose of bench/diag/veth_busbw.py)
run rounds of an fp32 bucket: each submits, the datagrams of each go to the
other in batches of up to 448 (`receive_many`, as dlcpd's receive loop hands
them on), until both have their results. No loss, no pacing; with `--out` the
results go into caller arrays, as dlcpd's go into the ranks' mapped segments.
The process takes dlcpd's allocator settings (`dlcp.daemon.memory.tune_process`).
Prints each round's wall time (both engines' work, one core), the median, and
the bus bandwidth that time would give if each engine had a core to itself
(size / (median / 2)), the ceiling the core sets on dlcpd's throughput here;
`--profile` adds a cProfile table.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.diag.veth_busbw import parse_size  # noqa: E402
from dlcp.core.engine import Engine, JobSpec, RoundComplete  # noqa: E402
from dlcp.daemon.memory import tune_process  # noqa: E402
from dlcp.wire import Codec  # noqa: E402
from dlcp.wire.mac import MAC_ALGORITHMS  # noqa: E402

RX_BATCH = 448  # datagrams per receive_many call: 64 GRO reads of 7 jumbo datagrams


def one_round(
    engines: list[Engine], lanes: np.ndarray, total: int, rnd: int, outs: list[np.ndarray] | None
) -> int:
    """Run round `rnd` to completion on both engines; returns the datagrams moved."""
    now = 0.0
    for i, e in enumerate(engines):
        e.submit(
            job=1,
            round=rnd,
            bucket=0,
            codec=Codec.FP32,
            total=total,
            lanes=lanes,
            now=now,
            out=None if outs is None else outs[i],
        )
    done = moved = 0
    while done < len(engines):
        sent = False
        for src, e in enumerate(engines):
            # as dlcpd's outbox takes them: the engine's batches, no object a datagram
            for b in e.send_batches():
                moved += len(b.datagrams)
                for i in range(0, len(b.datagrams), RX_BATCH):
                    part = b.datagrams[i : i + RX_BATCH]
                    engines[b.node].receive_many(part, now, [src] * len(part))
                    sent = True
        for e in engines:
            while (ev := e.next_event()) is not None:
                if not isinstance(ev, RoundComplete):
                    raise RuntimeError(f"round {rnd} failed: {ev}")
                done += 1
        if not sent:  # nothing in flight: let the timers run (NACKs, DONE repeats)
            now += 0.01
            for e in engines:
                e.handle_timer(now)
    return moved


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="100MB")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--payload", type=int, default=8908, help="dlcp payload (MTU 9000 - 92)")
    p.add_argument("--mac", default="ghash-aes", choices=MAC_ALGORITHMS)
    p.add_argument("--profile", action="store_true", help="print a cProfile table of the rounds")
    p.add_argument(
        "--out", action="store_true", help="results into caller arrays, as dlcpd's mapped segments"
    )
    a = p.parse_args()
    tune_process()
    total = parse_size(a.size) // 4
    engines = []
    for me in range(2):
        e = Engine()
        e.add_job(JobSpec.transpose(1, b"k" * 32, me, 2, payload=a.payload, mac=a.mac))
        engines.append(e)
    lanes = np.random.default_rng(0).standard_normal(total).astype("<f4").view(np.uint8)
    outs = [np.empty(total, np.float32) for _ in engines] if a.out else None
    one_round(engines, lanes, total, 0, outs)  # warm-up
    prof = cProfile.Profile() if a.profile else None
    times = []
    moved = 0
    for rnd in range(1, a.rounds + 1):
        if prof is not None:
            prof.enable()
        t = time.perf_counter()
        moved = one_round(engines, lanes, total, rnd, outs)
        times.append(time.perf_counter() - t)
        if prof is not None:
            prof.disable()
    med = statistics.median(times)
    print("round s:", " ".join(f"{x:.3f}" for x in times))
    print(
        f"median {med:.3f} s for {4 * total / 1e6:.0f} MB on 2 engines ({moved} datagrams, "
        f"{med / moved * 1e6:.2f} us each); one core per engine: "
        f"{4 * total * 8 / (med / 2) / 1e9:.2f} Gbit/s bus bandwidth"
    )
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
