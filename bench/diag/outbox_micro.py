"""Per-packet Python cost of the outbox (dlcp/daemon/outbox.py), no sockets.

Pushes the DATA datagrams of one jumbo shard and flushes them through fake
paths: unpaced over 1 path, paced at 1 Gbit/s over 1 path (driven by
tests/test_outbox_paths.run_paced), sprayed over 2 paths, and (trickle) as a
busy daemon does: 7 packets pushed and flushed at a time, paced at 10 Gbit/s. Prints the median
over `--reps` repetitions of push and flush CPU microseconds per packet (process
time: what the daemon's core pays, less sensitive to a loaded machine).
`--baseline FILE` times another outbox.py (say main's) in the same process,
alternating repetitions with this one, so that both see the same load.
Run from the repository root under `flock -x /tmp/dlcp-bench.lock`.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from types import ModuleType
from typing import Any

sys.path.insert(0, ".")

from dlcp.core.layout import Layout
from dlcp.core.rate import RateConfig
from dlcp.daemon import outbox as this_outbox
from dlcp.policies import from_config
from dlcp.wire.header import Codec
from tests import test_outbox_paths as t


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("outbox_baseline", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def make(mod: ModuleType, n_paths: int, rate: RateConfig | None) -> tuple[Any, Any]:
    paths = [t.FakePath(f"10.0.{p}.1") for p in range(n_paths)]
    ob = mod.Outbox(
        paths,
        dscp=(48, 40, 34, 26, 18, 10, 0, 8),
        rate=rate if rate is not None else RateConfig(),
        pacing=rate is not None,
        balancer_factory=lambda: from_config("balance", "spray"),
    )
    peer = ob.peer(tuple(f"10.0.{p}.2" for p in range(n_paths)), 7400, 0.0)
    return ob, peer


def push_all(ob: Any, peer: Any, dgs: list[bytes], batch: bool) -> None:
    """Queue `dgs` in class 2: with one `push_many`, or `push` per datagram."""
    if batch:
        ob.push_many(peer, dgs, [2] * len(dgs))
    else:
        for dg in dgs:
            ob.push(peer, dg, 2)


def trickle(mod: ModuleType, dgs: list[bytes], batch: bool) -> tuple[float, float]:
    """As in a busy daemon: a few packets at a time (`TRICKLE`), each lot
    pushed and flushed at once by a pacer at 10 Gbit/s, the clock moving on by
    their time on the wire."""
    ob, peer = make(mod, 1, RateConfig(initial_rate_bps=1e10, min_rate_bps=1e6))
    clock = time.process_time
    push = flush = 0.0
    now = 0.0
    for i in range(0, len(dgs), TRICKLE):
        lot = dgs[i : i + TRICKLE]
        t0 = clock()
        push_all(ob, peer, lot, batch)
        t1 = clock()
        ob.flush(now)
        t2 = clock()
        push += t1 - t0
        flush += t2 - t1
        now += sum(map(len, lot)) * 8 / 1e10
    t.run_paced(ob)
    assert ob.queued() == 0
    return push / len(dgs) * 1e6, flush / len(dgs) * 1e6


TRICKLE = 7  # packets per lot: one GSO batch of jumbo datagrams


def one(mod: ModuleType, case: str, dgs: list[bytes], batch: bool) -> tuple[float, float]:
    if case == "trickle":
        return trickle(mod, dgs, batch)
    rate = RateConfig(initial_rate_bps=1e9, min_rate_bps=1e6) if case == "paced" else None
    ob, peer = make(mod, 2 if case == "spray2" else 1, rate)
    clock = time.process_time
    t0 = clock()
    push_all(ob, peer, dgs, batch)
    t1 = clock()
    if case == "paced":
        t.run_paced(ob)
    else:
        ob.flush(0.0)
    t2 = clock()
    assert ob.queued() == 0
    return (t1 - t0) / len(dgs) * 1e6, (t2 - t1) / len(dgs) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--packets", type=int, default=450)
    ap.add_argument("--baseline", help="another outbox.py to time alongside (push only)")
    args = ap.parse_args()
    lay = Layout(2_000_000 * args.packets // 450, Codec.FP32, 2, 8908)
    dgs = t.data_packets(lay, 1)
    variants: list[tuple[str, ModuleType, bool]] = []
    if args.baseline:
        variants.append(("baseline push", load(args.baseline), False))
    variants.append(("push", this_outbox, False))
    if hasattr(this_outbox.Outbox, "push_many"):
        variants.append(("push_many", this_outbox, True))
    for case in ("unpaced", "paced", "spray2", "trickle"):
        res: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in variants}
        for _ in range(args.reps):  # alternate the variants: the same load for each
            for name, mod, batch in variants:
                res[name].append(one(mod, case, dgs, batch))
        for name, _, _ in variants:
            push = statistics.median(r[0] for r in res[name])
            flush = statistics.median(r[1] for r in res[name])
            print(f"{case:8s} {name:14s} n={len(dgs)} push {push:.2f} us/pkt  "
                  f"flush {flush:.2f} us/pkt  total {push + flush:.2f} us/pkt")  # fmt: skip


if __name__ == "__main__":
    main()
