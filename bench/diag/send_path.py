"""dlcpd's send path in one process: what a daemon spends a datagram before the kernel.

    python bench/diag/send_path.py [--size 100MB] [--rounds 12] [--classes 1] [--paths 1]
        [--queue] [--rate BITS] [--profile FILE]

Node 0 of a 2-node job submits one fp32 bucket a round (`Engine(gather=True)`,
as dlcpd runs it); its data for node 1 (half the bucket: 35,500 datagrams of
1408 payload bytes at 100 MB) is queued with `Outbox.push_many` and flushed
over a real `UdpPath` on loopback, unpaced, to a socket with UDP_GRO that is
never read (the kernel drops what its buffer does not hold). Prints the
median per round of each phase: `submit` (headers, MAC-ready datagrams),
`push`, `flush` and within it the send calls (MAC seal, iovecs, the kernel),
and the datagrams' freeing; then the glue (all but the send calls) per
datagram. `--classes K`: the packets of a bucket spread over K priority
classes at random (as magnitude classes spread them), instead of one.
`--paths P`: the peer has P paths (127.0.0.1, .2, ...: one local
socket each, sprayed by the balancer, the multipath `_send`). `--profile
BITS`: the peer is paced at BITS bit/s (e.g. 200e6) and each flush comes
PACING_QUANTUM later on a clock of its own, as dlcpd's paced flushes: a few
dozen datagrams a flush, so the per-flush and per-batch glue show (the
bench's case at 200 Mbit/s); without it one flush sends 4 MB at once.
`--profile FILE`: the timed rounds under cProfile, its stats written to FILE (call
counts per datagram are what to read from it). `--queue`: the receiving
socket's buffer holds a whole round (as a peer dlcpd's does while it is
flushing too) and is drained after each round, untimed; the kernel then
keeps every datagram, in pages of its own, where without it it drops most
and reuses their memory at once (run as root: SO_RCVBUFFORCE).

The engine's round state is dropped between rounds (its private tables):
this times the send path only. Run it alternated with another checkout
(`TREE=path`), as any timing on this VM.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

# dlcp from TREE where given; bench.diag from this tree where TREE has none
sys.path.insert(0, os.environ.get("TREE", str(Path(__file__).resolve().parents[2])))
sys.path.append(str(Path(__file__).resolve().parents[2]))

from bench.diag.veth_busbw import parse_size
from dlcp.core.engine import Engine, JobSpec
from dlcp.core.layout import Layout
from dlcp.core.rate import RateConfig
from dlcp.daemon.memory import tune_process
from dlcp.daemon.outbox import Outbox
from dlcp.daemon.sending import PACING_QUANTUM
from dlcp.daemon.transport import UdpPath
from dlcp.policies import from_config
from dlcp.wire import Codec

UDP_GRO = 104
SO_RCVBUFFORCE = 33
PAYLOAD = 1408


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="100MB")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--classes", type=int, default=1)
    ap.add_argument("--paths", type=int, default=1)
    ap.add_argument("--queue", action="store_true", help="the receiver keeps a whole round")
    ap.add_argument("--rate", type=float, default=0.0, help="pace the peer at this bit/s")
    ap.add_argument("--profile", default="", help="write cProfile stats of the rounds here")
    a = ap.parse_args()
    tune_process()
    total = parse_size(a.size) // 4
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("0.0.0.0" if a.paths > 1 else "127.0.0.1", 0))
    rx.setsockopt(socket.SOL_UDP, UDP_GRO, 1)
    if a.queue:
        rx.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 256 << 20)
        rx.setblocking(False)
    paths = [UdpPath(f"127.0.0.{1 + p}", 0) for p in range(a.paths)]
    for path in paths:
        path.send = _timed(path.send)  # type: ignore[method-assign]

    ob = Outbox(
        paths,
        dscp=(48, 40, 34, 26, 18, 10, 0, 8),
        rate=RateConfig(link_rate_bps=a.rate, initial_rate_bps=a.rate) if a.rate else RateConfig(),
        pacing=a.rate > 0,
        balancer_factory=lambda: from_config("balance", "spray"),
    )
    addrs = tuple(f"127.0.0.{1 + p}" for p in range(a.paths))
    peer = ob.peer(addrs, rx.getsockname()[1], 0.0)
    e = Engine(gather=True)
    e.add_job(JobSpec.transpose(1, os.urandom(32), 0, 2, payload=PAYLOAD, mac="ghash-aes"))
    lanes = np.random.default_rng(0).standard_normal(total).astype(np.float32)
    packets = Layout(total, Codec.FP32, 2, PAYLOAD).packets
    classes = None
    if a.classes > 1:
        classes = np.random.default_rng(1).integers(1, 1 + a.classes, packets).astype(np.uint8)
    rows = []
    prof = cProfile.Profile() if a.profile else None
    cpu0 = time.process_time()
    clock = 0.0
    for rnd in range(a.rounds):
        if prof is not None and rnd == 2:
            prof.enable()
        _SEND[0] = 0.0
        t0 = time.perf_counter()
        e.submit(
            job=1,
            round=rnd,
            bucket=0,
            codec=Codec.FP32,
            total=total,
            lanes=lanes,
            now=0.0,
            classes=classes,
        )
        t1 = time.perf_counter()
        n = 0
        for b in e.send_batches():
            if b.node == 1:
                ob.push_many(peer, b.datagrams, b.priorities)
                n += len(b.datagrams)
        t2 = time.perf_counter()
        flushes = 0
        while ob.backlog:
            if a.rate:  # the next flush a pacing quantum later
                clock += PACING_QUANTUM
            ob.flush(clock)
            flushes += 1
        t3 = time.perf_counter()
        e.rounds.table.clear()
        t4 = time.perf_counter()
        if a.queue:  # what the peer's reads would do, untimed
            while True:
                try:
                    rx.recv(1 << 16)
                except BlockingIOError:
                    break
        if rnd >= 2:  # warm-up
            rows.append((t1 - t0, t2 - t1, t3 - t2, _SEND[0], t4 - t3, n, flushes))
        else:
            cpu0 = time.process_time()
    cpu = time.process_time() - cpu0
    if prof is not None:
        prof.disable()
        prof.dump_stats(a.profile)
    names = ("submit", "push", "flush", "  send calls", "free")
    for i, name in enumerate(names):
        print(f"{name:14s} {1e3 * statistics.median(r[i] for r in rows):7.2f} ms")
    n = rows[0][5]
    glue = statistics.median(r[0] + r[1] + r[2] - r[3] + r[4] for r in rows)
    sends = statistics.median(r[3] for r in rows)
    print(
        f"{n} datagrams a round: glue {1e3 * glue:.2f} ms ({1e9 * glue / n:.0f} ns a datagram), "
        f"send calls {1e9 * sends / n:.0f} ns a datagram"
    )
    per = 1e9 * cpu / (n * len(rows))
    if a.rate:
        print(f"{rows[0][6]} flushes a round (paced at {a.rate:g} bit/s)")
    print(f"process CPU {per:.0f} ns a datagram (user + system, timed rounds)")


_SEND = [0.0]  # seconds in the send calls this round


def _timed(send: Callable[[list[bytes], tuple[str, int], int], int]) -> Callable[..., int]:
    """`send`, its time added to `_SEND`."""

    def timed(dgs: list[bytes], dest: tuple[str, int], tos: int) -> int:
        t = time.perf_counter()
        n = send(dgs, dest, tos)
        _SEND[0] += time.perf_counter() - t
        return n

    return timed


if __name__ == "__main__":
    main()
