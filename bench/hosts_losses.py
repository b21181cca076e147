"""Datagrams lost in the daemons' sockets: N daemons on loopback, one large bucket.

    python bench/hosts_losses.py [--hosts 3] [--size 400MB] [--rounds 3] [--json out.json]

No root: the daemons listen on 127.0.0.1..N (tests/daemons.py). Every round
all-reduces the same bucket (transpose, one shard a host); the result is
checked against numpy's sum. Reports each round's wall time and, per daemon
and peer, its flow-control window, the datagrams the peer reported lost (its
NACKs: what this daemon's socket dropped on the way to it), probes
(`window_resets`) and stalls, and the datagrams sent again. A loss figure,
not a speed comparison: each host's sockets are sent to by N-1 peers at once,
which is what the windows (`[network] window_bytes`, shared among a peer's
senders) must keep within the socket's buffer. `--window` sets
`window_bytes` (0: flow control off).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.veth_busbw import parse_size  # noqa: E402
from tests.daemons import Rank, hosts_of, loopback_daemons, submit  # noqa: E402

KEY = bytes(range(32))
JOB = 9


def run(hosts: int, nbytes: int, rounds: int, window: int | None) -> dict:
    n = nbytes // 4
    extra: dict[str, dict[str, object]] = {"timing": {"timeout": 120.0}}
    if window is not None:
        extra["network"] = {"window_bytes": window}
    with tempfile.TemporaryDirectory() as td, loopback_daemons(Path(td), hosts, extra) as ds:
        ranks = []
        try:
            for i, d in enumerate(ds):
                name = f"dlcp-hl{os.getpid()}-{i}"
                ranks.append(Rank(d, name, 8 * n + (16 << 20), sealed=True))
            for i, r in enumerate(ranks):
                r.join(job=JOB, key=KEY, hosts=hosts_of(ds), me=i)
            rng = np.random.default_rng(1)
            xs = [rng.standard_normal(n).astype(np.float32) for _ in ranks]
            want = np.sum(xs, axis=0, dtype=np.float64)
            times = []
            for rnd in range(rounds):
                t = time.perf_counter()
                waits = [
                    submit(r, job=JOB, round=rnd, bucket=0, lanes=x, shards=hosts)
                    for r, x in zip(ranks, xs, strict=True)
                ]
                for w in waits:
                    got = w().sums
                    if not np.allclose(got, want, rtol=1e-5, atol=1e-4):
                        raise AssertionError(f"round {rnd}: the sums are wrong")
                times.append(time.perf_counter() - t)
            daemons = []
            for r in ranks:
                st = r.client.status()
                keys = ("peer", "window_bytes", "lost_packets", "window_resets", "window_stalls")
                c = st["counters"]
                daemons.append(
                    {
                        "peers": [{k: p[k] for k in keys} for p in st["peers"]],
                        "data_retransmits": c.get("data_retransmits", 0),
                        "result_retransmits": c.get("result_retransmits", 0),
                        "credits_sent": c.get("credits_sent", 0),
                    }
                )
        finally:
            for r in ranks:
                r.close()
    lost = sum(p["lost_packets"] for d in daemons for p in d["peers"])
    return {
        "hosts": hosts,
        "bytes": nbytes,
        "window_bytes": window,
        "times_s": times,
        "lost_packets": lost,
        "daemons": daemons,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--size", default="400MB", help="bucket size (fp32), e.g. 400MB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=int, default=None, help="window_bytes (default: dlcpd's)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    if args.hosts < 2:
        ap.error("--hosts must be 2 or more")
    res = run(args.hosts, parse_size(args.size), args.rounds, args.window)
    print(
        f"{args.hosts} hosts, {args.size}: rounds " + " ".join(f"{t:.2f}" for t in res["times_s"])
    )
    for i, d in enumerate(res["daemons"]):
        peers = ", ".join(
            f"{p['peer']} window {p['window_bytes'] >> 20} MiB lost {p['lost_packets']} "
            f"probes {p['window_resets']} stalls {p['window_stalls']}"
            for p in d["peers"]
        )
        print(f"daemon {i}: {peers}; sent again {d['data_retransmits'] + d['result_retransmits']}")
    print(f"datagrams lost in all: {res['lost_packets']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
