"""Soak: many all-reduce rounds through the emulated cluster under loss and background traffic.

    sudo python bench/diag/soak.py --rounds 1000 --loss 5 --background both --json soak.json

Builds a testbed (one namespace per host, 200 Mbit/s switch ports by default),
starts one dlcpd per host, and runs `--rounds` fp32 all-reduce rounds of
`--lanes` lanes with loss bound `--bound` while every switch port drops
`--loss` % of the packets entering it and iperf3 TCP+UDP flows congest every
link. Per round it checks:

- replicas identical: every rank's result bytes (sums and contributor counts)
  hash the same;
- non-droppable loss zero: every packet the drop policy did not mark droppable
  (all ranks pass the same per-packet norms, so the droppable set is known)
  holds every host's contribution;
- exactness: packets with every contribution equal the fp32 sum exactly.

It samples each daemon's RSS (VmRSS in /proc/PID/status) as it goes and
reports the value after warm-up and at the end; it also reports the completed
rounds' times (submits to the last reply: p50, p90, p99, max) and each
daemon's counters at the end. `soak()` runs on an existing
testbed (tests/test_reliability.py uses it); `main()` builds and removes one.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dlcp.core.layout import Layout  # noqa: E402
from dlcp.policies import from_config  # noqa: E402
from dlcp.shim.client import DaemonClient, Segment  # noqa: E402
from dlcp.wire.header import Codec  # noqa: E402

__all__ = ["droppable_mask", "main", "rss_kib", "soak"]


def rss_kib(pid: int) -> int | None:
    """VmRSS of a process in KiB (None when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def droppable_mask(
    norms: np.ndarray, lay: Layout, bound: float, drop: dict[str, Any] | None = None
) -> np.ndarray:
    """The packets the daemon's drop policy marks droppable (per shard, as dlcpd does)."""
    policy = from_config("drop", drop or {"name": "smallest_norm"})
    counts = lay.packet_counts()
    out = np.zeros(lay.packets, dtype=bool)
    if bound <= 0:
        return out
    for s in range(lay.shards):
        r = lay.shard_packets(s)
        if len(r):
            out[r.start : r.stop] = policy.droppable(
                norms=norms[r.start : r.stop], counts=counts[r.start : r.stop], bound=bound
            )
    return out


class _Rank:
    def __init__(self, socket: str, name: str, size: int) -> None:
        self.client = DaemonClient(socket)
        self.info = self.client.hello()
        self.seg = Segment(name, size)
        self.client.segment(self.seg)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        self.seg.close()


def _submit(
    rank: _Rank, job: int, rnd: int, x: np.ndarray, meta: bytes, lay: Layout, bound: float
) -> Callable[[float], tuple[np.ndarray, np.ndarray, dict[str, Any]]]:
    raw = x.view(np.uint8)
    buf = rank.seg.buf
    buf[0 : raw.size] = raw.tobytes()
    m_off = raw.size
    buf[m_off : m_off + len(meta)] = meta
    o_off = m_off + len(meta)
    sb = 4 * lay.total
    fut = rank.client.submit(
        job=job,
        round=rnd,
        bucket=0,
        codec="fp32",
        total=lay.total,
        data=[0, raw.size],
        meta=[m_off, len(meta)],
        out=[o_off, sb + 6 * lay.packets],
        bound=bound,
    )

    def wait(timeout: float) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
        reply = fut.result(timeout)
        sums = np.frombuffer(bytes(buf[o_off : o_off + sb]), "<f4")
        contrib = np.frombuffer(bytes(buf[o_off + sb : o_off + sb + 2 * lay.packets]), "<u2")
        return sums, contrib, reply

    return wait


def soak(
    tb: Any,
    *,
    rounds: int,
    lanes: int = 1 << 16,
    bound: float = 0.05,
    loss_pct: float = 5.0,
    background: str = "both",
    udp_rate_bps: int | None = None,
    job: int = 0x50AC,
    seed: int = 0,
    warmup: int | None = None,
    samples: int = 20,
    round_timeout: float = 120.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the soak on testbed `tb` (daemons running); returns the figures."""
    H = tb.spec.hosts
    hosts = [{"addresses": [tb.address(i)], "udp_port": tb.spec.udp_port} for i in range(H)]
    key = os.urandom(32)
    warmup = max(1, rounds // 10) if warmup is None else warmup
    pids = [p["pid"] for p in sorted(tb.processes("daemon"), key=lambda p: p["host"])]
    ranks: list[_Rank] = []
    rng = np.random.default_rng(seed)
    fig: dict[str, Any] = {
        "rounds": rounds,
        "lanes": lanes,
        "hosts": H,
        "bound": bound,
        "loss_pct": loss_pct,
        "background": background,
        "rate_bps": tb.spec.rate_bps,
        "completed": 0,
        "failed": [],
        "replica_mismatches": 0,
        "nondroppable_lost_packets": 0,
        "inexact_full_packets": 0,
        "droppable_lost_packets": 0,
        "lost_lanes": 0,
        "total_lanes": 0,
        "lossy_rounds": 0,
        "rss_kib": {},
    }
    rss: dict[int, list[tuple[int, int]]] = {pid: [] for pid in pids}
    t0 = time.monotonic()
    try:
        for i in range(H):
            r = _Rank(str(tb.hosts[i].socket), f"dlcp-soak{os.getpid()}-{job}-{i}", 16 << 20)
            ranks.append(r)
            r.client.join(job=job, key=key.hex(), hosts=hosts, me=i, local_ranks=1)
        payload = ranks[0].info["payload"]
        lay = Layout(lanes, Codec.FP32, H, payload)
        P = lay.packets
        # the same per-packet norms on every rank: a known droppable set
        norms = rng.permutation(np.linspace(0.01, 10.0, P)).astype(np.float32)
        meta = np.zeros(P, "<u2").tobytes() + norms.astype("<f4").tobytes()
        drop = droppable_mask(norms.astype(np.float64), lay, bound)
        fig["droppable_packets_per_round"] = int(drop.sum())
        fig["packets_per_round"] = P
        if loss_pct:
            tb.set_loss_all(loss_pct)
        if background != "none":
            tb.start_background(background, udp_rate_bps=udp_rate_bps)
        every = max(1, rounds // samples)
        round_s: list[float] = []
        for rnd in range(rounds):
            xs = [rng.standard_normal(lanes).astype(np.float32) for _ in range(H)]
            t_round = time.monotonic()  # from the submits: not the inputs' making
            waits = [
                _submit(r, job, rnd, x, meta, lay, bound) for r, x in zip(ranks, xs, strict=True)
            ]
            try:
                results = [w(round_timeout) for w in waits]
            except Exception as exc:
                fig["failed"].append(f"round {rnd}: {type(exc).__name__}: {exc}"[:300])
                for w in waits:  # collect the other replies before going on
                    with contextlib.suppress(Exception):
                        w(round_timeout)
                continue
            fig["completed"] += 1
            round_s.append(time.monotonic() - t_round)
            digests = {hashlib.sha256(s.tobytes() + c.tobytes()).hexdigest() for s, c, _ in results}
            if len(digests) != 1:
                fig["replica_mismatches"] += 1
            sums, contrib, reply = results[0]
            short = contrib < H
            fig["nondroppable_lost_packets"] += int((short & ~drop).sum())
            fig["droppable_lost_packets"] += int((short & drop).sum())
            full = np.repeat(contrib == H, lay.per_packet)[:lanes]
            expected = xs[0].copy()
            for x in xs[1:]:
                expected += x
            fig["inexact_full_packets"] += int((sums[full] != expected[full]).any())
            fig["lost_lanes"] += int(reply["lost_lanes"])
            fig["total_lanes"] += int(reply["total_lanes"])
            fig["lossy_rounds"] += bool(reply["lost_lanes"])
            if rnd % every == 0 or rnd == rounds - 1:
                for pid in pids:
                    v = rss_kib(pid)
                    if v is not None:
                        rss[pid].append((rnd, v))
                if progress is not None:
                    progress(f"round {rnd + 1}/{rounds}, {len(fig['failed'])} failed")
        if round_s:
            q = np.percentile(round_s, [50, 90, 99])
            fig["round_s"] = {"p50": q[0], "p90": q[1], "p99": q[2], "max": max(round_s)}
        fig["daemon_counters"] = [r.client.status().get("counters", {}) for r in ranks]
    finally:
        fig["seconds"] = round(time.monotonic() - t0, 1)
        with contextlib.suppress(Exception):
            tb.stop_background()
        with contextlib.suppress(Exception):
            tb.set_loss_all(0.0)
        for r in ranks:
            r.close()
    for host, pid in enumerate(pids):
        pts = rss[pid]
        after = [v for rnd, v in pts if rnd >= warmup] or [v for _, v in pts]
        fig["rss_kib"][f"h{host}"] = {
            "first": pts[0][1] if pts else None,
            "after_warmup": after[0] if after else None,
            "end": pts[-1][1] if pts else None,
            "max_after_warmup": max(after) if after else None,
            "samples": pts,
        }
    fig["loss_frac"] = fig["lost_lanes"] / fig["total_lanes"] if fig["total_lanes"] else 0.0
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    from dlcp.tc.plan import parse_rate
    from dlcp.testbed import Testbed, TestbedSpec

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--rate", default="200mbit", help="switch port rate, or 'none'")
    p.add_argument("--rounds", type=int, default=1000)
    p.add_argument("--lanes", type=int, default=1 << 16)
    p.add_argument("--bound", type=float, default=0.05)
    p.add_argument("--loss", type=float, default=5.0, help="percent, every switch port")
    p.add_argument("--background", default="both", choices=("none", "tcp", "udp", "both"))
    p.add_argument("--timeout", type=float, default=20.0, help="daemon round timeout (s)")
    p.add_argument("--name", default="rel-soak")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rate = None if args.rate == "none" else parse_rate(args.rate)
    root = Path(tempfile.mkdtemp(prefix="dlcp-soak-", dir="/tmp"))
    spec = TestbedSpec(hosts=args.hosts, rate_bps=rate, name=args.name)
    tb = Testbed.up(spec, state_root=root)
    try:
        tb.start_daemons({"timing": {"timeout": args.timeout}, "daemon": {"metrics_port": 0}})
        fig = soak(
            tb,
            rounds=args.rounds,
            lanes=args.lanes,
            bound=args.bound,
            loss_pct=args.loss,
            background=args.background,
            progress=lambda m: print(m, file=sys.stderr, flush=True),
        )
    finally:
        tb.down()
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(fig, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    ok = (
        not fig["failed"]
        and fig["replica_mismatches"] == 0
        and fig["nondroppable_lost_packets"] == 0
        and fig["inexact_full_packets"] == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
