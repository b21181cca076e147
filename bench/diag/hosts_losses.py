"""Datagrams lost in the daemons' sockets: N daemons on loopback, one large bucket.

    python bench/diag/hosts_losses.py [--hosts 3] [--size 400MB] [--rounds 3] [--pairs]
        [--json out.json]

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

`--pairs`: instead of one job of all N hosts, N-1 jobs of two hosts each,
daemon 0 and daemon i, run at once. Daemon 0 is then sent to by N-1 peers,
each of which knows only its own job: its own share for daemon 0 is the whole
window, and only daemon 0's grant (its credits) keeps the senders' windows
together within its socket.
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.diag.veth_busbw import parse_size  # noqa: E402
from tests.daemons import Rank, hosts_of, loopback_daemons, submit  # noqa: E402

KEY = bytes(range(32))
JOB = 9


def run(hosts: int, nbytes: int, rounds: int, window: int | None, pairs: bool = False) -> dict:
    n = nbytes // 4
    # each job: (its id, its daemons by node); a rank per daemon and job
    jobs = [(JOB + i, [0, i]) for i in range(1, hosts)] if pairs else [(JOB, list(range(hosts)))]
    extra: dict[str, dict[str, object]] = {"timing": {"timeout": 120.0}}
    if window is not None:
        extra["network"] = {"window_bytes": window}
    with tempfile.TemporaryDirectory() as td, loopback_daemons(Path(td), hosts, extra) as ds:
        ranks: list[Rank] = []
        members: list[tuple[int, Rank, int]] = []  # (job, rank, shards)
        first: dict[int, Rank] = {}  # a rank of each daemon, for its status
        try:
            for job, nodes in jobs:
                for me, i in enumerate(nodes):
                    name = f"dlcp-hl{os.getpid()}-{job}-{i}"
                    r = Rank(ds[i], name, 8 * n + (16 << 20), sealed=True)
                    ranks.append(r)
                    r.join(job=job, key=KEY, hosts=hosts_of([ds[k] for k in nodes]), me=me)
                    members.append((job, r, len(nodes)))
                    first.setdefault(i, r)
            rng = np.random.default_rng(1)
            xs = [rng.standard_normal(n).astype(np.float32) for _ in range(hosts)]
            wants = {
                job: np.sum([xs[i] for i in nodes], axis=0, dtype=np.float64) for job, nodes in jobs
            }
            lanes = [xs[i] for _job, nodes in jobs for i in nodes]
            times = []
            for rnd in range(rounds):
                t = time.perf_counter()
                waits = [
                    (job, submit(r, job=job, round=rnd, bucket=0, lanes=x, shards=shards))
                    for (job, r, shards), x in zip(members, lanes, strict=True)
                ]
                for job, w in waits:
                    got = w().sums
                    if not np.allclose(got, wants[job], rtol=1e-5, atol=1e-4):
                        raise AssertionError(f"round {rnd}: the sums of job {job} are wrong")
                times.append(time.perf_counter() - t)
            daemons = []
            for i in range(hosts):
                st = first[i].client.status()
                keys = ("peer", "window_bytes", "lost_packets", "window_resets", "window_stalls")
                c = st["counters"]
                daemons.append(
                    {
                        "peers": [
                            {**{k: p[k] for k in keys}, "limit_bytes": p.get("limit_bytes")}
                            for p in st["peers"]
                        ],
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
        "jobs": [nodes for _job, nodes in jobs],
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
    ap.add_argument("--pairs", action="store_true", help="N-1 two-host jobs with daemon 0")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    if args.hosts < 2:
        ap.error("--hosts must be 2 or more")
    res = run(args.hosts, parse_size(args.size), args.rounds, args.window, args.pairs)
    print(
        f"{args.hosts} hosts{' in pairs' if args.pairs else ''}, {args.size}: rounds "
        + " ".join(f"{t:.2f}" for t in res["times_s"])
    )
    for i, d in enumerate(res["daemons"]):
        peers = ", ".join(
            f"{p['peer']} window {p['window_bytes'] >> 20} MiB"
            + (f" (limit {p['limit_bytes'] >> 20})" if p.get("limit_bytes") is not None else "")
            + f" lost {p['lost_packets']} "
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
