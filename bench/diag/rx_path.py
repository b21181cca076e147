"""dlcpd's receive path in one process: what a daemon spends a datagram after the kernel.

    python bench/diag/rx_path.py [--size 100MB] [--rounds 8] [--budget N]

A real `Daemon` (not started: no control socket, no event loop) is node 1 of a
2-node transpose job with one `UdpPath` on loopback; its engine holds its own
contribution to a round of one fp32 bucket, as after its rank's submit. Node
0's engine (`Engine(gather=True)`, as dlcpd runs it) makes its data for node 1
(half the bucket: 35,500 datagrams of 1408 payload bytes at 100 MB), which a
second `UdpPath` sends with UDP GSO into node 1's socket (its buffer large
enough to hold them all) before the clock starts. Then `Daemon._receive` is
called, as each readable event calls it, until every datagram is taken; the
shard completes on the last one and its results are made (not sent).

Prints the median per round of: the whole receive (`_receive` calls), within
it the recvmsg calls and their splitting (`recv_gro`) and the engine's
`receive_many`; within that `decode_batch` (which holds the MAC check,
`verify`) and the runs (`_receive_run`: `on_data_run`, which holds
`_run_slots` and the lane sums, `add_runs`; and `shard_done`, the results
made when the last packet closes the shard), and the credits sent to the
sender (`credit`: one each 2 MiB taken, a sendmsg apiece); then the rest
("glue": all but recvmsg, MAC and sums) a datagram. `--budget N`: recvmsg calls a `_receive`
call (dlcpd's `_RX_BUDGET`). `--chunk N`: send N datagrams, take them, send
the next N, and so on; the receive then finds them in cache, not in memory
as when all are sent first. Each function timed adds about a microsecond a
call. Run as root (the socket buffer is set past `rmem_max`) and alternated
with another checkout (`TREE=path`), as any timing on this VM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# dlcp from TREE where given; bench.diag from this tree where TREE has none
sys.path.insert(0, os.environ.get("TREE", str(Path(__file__).resolve().parents[2])))
sys.path.append(str(Path(__file__).resolve().parents[2]))

from bench.diag.veth_busbw import parse_size
from dlcp.codecs import lanes as lane_ops
from dlcp.core import aggregate as agg_mod
from dlcp.core import receiver as receiver_mod
from dlcp.core.engine import Engine, JobSpec
from dlcp.core.layout import Layout
from dlcp.core.rounds import OpenRounds
from dlcp.daemon import netin
from dlcp.daemon.config import Config
from dlcp.daemon.jobs import HostAddr
from dlcp.daemon.memory import tune_process
from dlcp.daemon.server import Daemon
from dlcp.daemon.transport import UdpPath
from dlcp.wire import Codec, PacketType
from dlcp.wire import mac as mac_mod

PAYLOAD = 1408
TX, RX = "127.0.0.2", "127.0.0.1"


class Clock:
    """Seconds spent in the functions `wrap` replaced, per name."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)
        spent = self.spent
        spent.setdefault(label, 0.0)

        def timed(*args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[label] += time.perf_counter() - t

        setattr(owner, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="100MB")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--budget", type=int, default=None, help="recvmsg calls a _receive call")
    ap.add_argument(
        "--chunk", type=int, default=0, help="datagrams sent before each take (0: all at once)"
    )
    a = ap.parse_args()
    if a.budget is not None:
        netin._RX_BUDGET = a.budget
    tune_process()
    total = parse_size(a.size) // 4
    port = 7600
    key = os.urandom(32)
    cfg = Config(addresses=(RX,), udp_port=port, metrics_port=0, pacing=False, payload=PAYLOAD)
    d = Daemon(cfg)
    d._loop = asyncio.new_event_loop()  # its clock only: never run
    path = UdpPath(RX, port, buffer_bytes=1 << 30)
    d.paths.append(path)
    hosts = (HostAddr((TX,), port), HostAddr((RX,), port))
    job = d._make_job(
        job=1, key=key, hosts=hosts, me=1, local_ranks=1, mode="transpose", payload=PAYLOAD
    )
    d.jobs[1] = job
    d.engine.add_job(job.spec)
    sender = UdpPath(TX, port, buffer_bytes=64 << 20)
    e0 = Engine(gather=True)
    e0.add_job(JobSpec.transpose(1, key, 0, 2, payload=PAYLOAD, mac=cfg.mac))
    rng = np.random.default_rng(0)
    lanes = [rng.standard_normal(total).astype(np.float32) for _ in range(2)]
    out = np.zeros(total, np.float32)

    clock = Clock()
    clock.wrap(path, "receive_split", "recv_gro")
    clock.wrap(d.engine, "receive_many", "receive_many")
    clock.wrap(mac_mod.GhashAesKey, "verify", "verify")
    clock.wrap(lane_ops, "add_runs", "add_runs")
    clock.wrap(OpenRounds, "_shard_done", "shard_done")
    clock.wrap(receiver_mod, "decode_batch", "decode_batch")
    clock.wrap(agg_mod.ShardAggregator, "on_data_run", "on_data_run")
    clock.wrap(agg_mod, "run_slots", "_run_slots")
    clock.wrap(receiver_mod.Receiver, "_receive_run", "_receive_run")
    clock.wrap(d.netin, "_credit", "credit")  # `Credits.send`, as the drain holds it
    rows = []
    for rnd in range(a.rounds + 2):
        d.engine.submit(
            job=1,
            round=rnd,
            bucket=0,
            codec=Codec.FP32,
            total=total,
            lanes=lanes[1],
            now=0.0,
            out=out,
        )
        d.engine.send_batches()  # node 1's own sends: not this bench's
        e0.submit(
            job=1, round=rnd, bucket=0, codec=Codec.FP32, total=total, lanes=lanes[0], now=0.0
        )
        data = [
            dg
            for b in e0.send_batches()
            if b.node == 1
            for dg in b.datagrams
            if dg[3] == PacketType.DATA
        ]
        for label in clock.spent:
            clock.spent[label] = 0.0
        before = d.engine.stats["data_packets_received"]
        calls = 0
        wall = 0.0
        chunk = a.chunk or len(data)
        sent = 0
        while sent < len(data):
            end = min(sent + chunk, len(data))
            while sent < end:
                k = sender.send(data[sent : min(end, sent + 4096)], (RX, port), 0)
                if k == 0:
                    raise RuntimeError("the receiving socket's buffer is full")
                sent += k
            t = time.perf_counter()
            while True:
                d._receive(path)
                calls += 1
                if d.engine.stats["data_packets_received"] - before >= sent:
                    break
                if calls > 10 * len(data):
                    raise RuntimeError("datagrams lost on loopback")
            wall += time.perf_counter() - t
        got = d.engine.stats["data_packets_received"] - before
        if got != len(data):
            raise RuntimeError(f"{got} of {len(data)} datagrams taken")
        d.engine.send_batches()  # the results made: dropped
        e0.rounds.table.clear()
        if rnd == 0:  # node 1's shard holds the exact sums
            lo, n_lanes = Layout(total, Codec.FP32, 2, PAYLOAD).shard_range(1)
            sl = slice(lo, lo + n_lanes)
            if not np.array_equal(out[sl], lanes[0][sl] + lanes[1][sl]):
                raise RuntimeError("node 1's shard is not the exact sum")
        if rnd >= 2:  # warm-up
            rows.append({"receive": wall, "calls": calls, "n": len(data), **clock.spent})
    n = rows[0]["n"]
    for name in rows[0]:
        if name in ("n", "calls"):
            continue
        v = statistics.median(r[name] for r in rows)
        print(f"{name:14s} {1e3 * v:7.2f} ms  {1e9 * v / n:5.0f} ns a datagram")
    glue = statistics.median(
        r["receive"] - r["recv_gro"] - r["verify"] - r["add_runs"] for r in rows
    )
    print(
        f"{n} datagrams a round in {statistics.median(r['calls'] for r in rows)} calls: glue "
        f"(all but recvmsg, MAC and sums) {1e3 * glue:.2f} ms ({1e9 * glue / n:.0f} ns a datagram)"
    )
    path.close()
    sender.close()


if __name__ == "__main__":
    main()
