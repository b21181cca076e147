"""Multipath all-reduce throughput: flow vs spray, and adaptive around a lossy path.

    sudo python bench/diag/multipath.py [--rate 25mbit] [--size 2MB] [--iters 5]
        [--loss 10] [--repeat 3] [--oracle-pacing] [--set rate.initial_rtt=0.02]
        [--json out.json]

Builds its own testbed (2 hosts, 2 paths, every switch port HTB-limited to
--rate with dlcp's tc layout) and runs, in one invocation so that ratios are
taken on the same machine state, each scenario with a fresh pair of daemons:

- flow:        balance = "flow" (one path per peer, the ECMP-like baseline)
- spray:       balance = "spray" (round robin per packet over both paths)
- adaptive:    balance = "adaptive", --loss % random loss on path 1
- spray-lossy: balance = "spray" with the same loss (what adaptive avoids)

Each all-reduce moves --size bytes of fp32 between the two hosts (one
contribution per host, loss bound 0: every byte is recovered and the sums are
checked exact). Throughput = size * 8 / p50 time (algorithm bandwidth; with 2
hosts also the bus bandwidth). Ratios, per repetition and their median:

- spray_over_flow: target >= 1.8 on two equal paths;
- adaptive_over_line: adaptive's throughput over one path's line rate in
  payload bits (rate * 1408 / 1514), i.e. the share of the healthy path's
  capacity it keeps (target >= 0.9); adaptive_over_flow against flow's
  measured throughput on one healthy path.

Pick --rate so that the network, not the CPU, is the bottleneck: dlcpd is
CPU-bound at a few hundred Mbit/s on an idle 2-core machine and at about
100 Mbit/s when other work shares it (an unshaped 4 MB all-reduce took
0.2-0.4 s with a load average of 10), while spray over two 25 Mbit/s paths
needs 47 Mbit/s. Each row records the load average it ran under.

--oracle-pacing pins each scenario's pacing rate (rate.link_rate_bps,
initial and min rate, per path) to what its paths can carry, as a rate
control that knew the bottleneck would; it separates the load balancing from
the daemon's rate control (per path since results-multipath.md; see the
`retransmits` and `path_rates_bps` fields). --set passes any daemon setting
to every scenario.
Writes a JSON list with one object per scenario and repetition (times_s,
p50_s, throughput_bps, packets per path and path weights/loss rates/pacing
rates from the daemons' status, retransmits, the config used, and the
summary); the logs of a failed scenario are saved under --logs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dlcp.core.layout import Layout  # noqa: E402
from dlcp.errors import DlcpError  # noqa: E402
from dlcp.shim.client import DaemonClient, Segment  # noqa: E402
from dlcp.tc.plan import parse_rate  # noqa: E402
from dlcp.testbed import Testbed, TestbedSpec  # noqa: E402
from dlcp.wire.header import Codec, lane_bytes  # noqa: E402

WIRE_OVERHEAD = 64 + 8 + 20 + 14  # dlcp header, UDP, IPv4, Ethernet: what HTB counts


def parse_size(text: str) -> int:
    """'8MB', '32MiB', '4096' -> bytes (MB = 10**6, MiB = 2**20)."""
    t = text.strip().upper()
    for unit, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9),
                       ("MB", 10**6), ("KB", 10**3), ("B", 1)):  # fmt: skip
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_pids(tb: Testbed) -> list[int]:
    return [p["pid"] for p in tb.processes() if p["role"] == "daemon"]


def run_scenario(
    tb: Testbed,
    *,
    balance: str,
    elements: int,
    iters: int,
    job: int,
    extra: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """Fresh daemons with `balance`; one warm-up and `iters` timed all-reduces."""
    config: dict[str, dict[str, Any]] = {
        "policies": {"balance": balance},
        "timing": {"timeout": 120.0},
        "daemon": {"metrics_port": 0},
    }
    for section, values in extra.items():
        config[section] = {**config.get(section, {}), **values}
    tb.start_daemons(config)
    nbytes = 4 * elements
    lay = Layout(elements, Codec.FP32, 2)
    out_len = lane_bytes(Codec.FP32, elements, True) + 6 * lay.packets
    hosts = [{"addresses": list(h.addresses), "udp_port": h.udp_port} for h in tb.hosts]
    key = os.urandom(32)
    rng = np.random.default_rng(job)
    xs = [rng.standard_normal(elements).astype(np.float32) for _ in tb.hosts]
    want = xs[0] + xs[1]
    clients: list[DaemonClient] = []
    segs: list[Segment] = []
    try:
        for i, h in enumerate(tb.hosts):
            c = DaemonClient(str(h.socket))
            c.hello()
            clients.append(c)
            s = Segment(f"dlcp-mp{os.getpid()}-{job}-{i}", nbytes + out_len)
            segs.append(s)
            s.buf[:nbytes] = xs[i].tobytes()
            c.segment(s)
            c.join(job=job, key=key, hosts=hosts, me=i, local_ranks=1)
        pids = daemon_pids(tb)
        times: list[float] = []
        sent0: list[list[int]] = []
        cpu0 = 0.0
        for it in range(iters + 1):
            if it == 1:  # after the warm-up
                sent0 = [path_sent(c.status()) for c in clients]
                cpu0 = sum(proc_cpu(p) for p in pids) + time.process_time()
            t = time.perf_counter()
            futs = [
                c.submit(job=job, round=it, bucket=0, codec="fp32", total=elements,
                         data=[0, nbytes], out=[nbytes, out_len])
                for c in clients
            ]  # fmt: skip
            for f in futs:
                f.result(300)
            if it:
                times.append(time.perf_counter() - t)
            for s in segs:
                got = np.frombuffer(s.buf, np.float32, elements, nbytes)
                if not np.array_equal(got, want):
                    raise RuntimeError(f"{balance}: round {it}: result is not the exact sum")
        cpu = sum(proc_cpu(p) for p in pids) + time.process_time() - cpu0
        status = [c.status() for c in clients]
    finally:
        for c in clients:
            c.close()
        for s in segs:
            s.close()
    sent = [path_sent(st) for st in status]
    per_path = [sum(s[p] - s0[p] for s, s0 in zip(sent, sent0, strict=True)) for p in range(2)]
    peers = [st["peers"][0] for st in status]
    counters = [st["counters"] for st in status]
    p50 = statistics.median(times)
    return {
        "backend": "dlcp",
        "codec": "fp32",
        "balance": balance,
        "hosts": len(tb.hosts),
        "paths": 2,
        "size_bytes": nbytes,
        "iters": iters,
        "times_s": [round(t, 6) for t in times],
        "p50_s": round(p50, 6),
        "p99_s": round(float(np.percentile(times, 99)), 6),
        "throughput_bps": round(nbytes * 8 / p50),
        "busbw_gbps": round(nbytes * 8 / p50 / 1e9, 6),  # 2 hosts: bus = algorithm bandwidth
        "cpu_s": round(cpu, 3),
        "packets_per_path": per_path,
        "path_weights": [[round(p["weight"], 4) for p in peer["paths"]] for peer in peers],
        "path_loss_rates": [[round(p["loss_rate"], 4) for p in peer["paths"]] for peer in peers],
        "path_rates_bps": [[round(p.get("rate_bps", 0)) for p in peer["paths"]] for peer in peers],
        "retransmits": sum(
            c.get("data_retransmits", 0) + c.get("result_retransmits", 0) for c in counters
        ),
        "nacks_sent": sum(
            c.get("data_nacks_sent", 0) + c.get("result_nacks_sent", 0) for c in counters
        ),
    }


def parse_sets(items: list[str]) -> dict[str, dict[str, Any]]:
    """["timing.nack_delay=0.3", ...] -> {"timing": {"nack_delay": 0.3}}."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, sep, text = item.partition("=")
        section, dot, key = name.partition(".")
        if not sep or not dot or not section or not key:
            raise ValueError(f"--set wants SECTION.KEY=VALUE, not {item!r}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        out.setdefault(section, {})[key] = value
    return out


def path_sent(status: dict[str, Any]) -> list[int]:
    (peer,) = status["peers"]
    return [int(p["sent"]) for p in peer["paths"]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rate", default="25mbit", help="rate of every switch port (default 25mbit)")
    p.add_argument("--size", default="2MB", help="all-reduce size in bytes (default 2MB)")
    p.add_argument("--iters", type=int, default=5, help="timed all-reduces per scenario")
    p.add_argument("--loss", type=float, default=10.0, help="loss %% on the lossy path")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="daemon config for every scenario, e.g. timing.nack_delay=0.3 or "
                   "rate.initial_rtt=0.02 (repeatable; values are JSON or strings)")  # fmt: skip
    p.add_argument("--scenarios", default="flow,spray,adaptive,spray-lossy")
    p.add_argument("--repeat", type=int, default=1,
                   help="run all scenarios this many times; the summary is the median")  # fmt: skip
    p.add_argument(
        "--oracle-pacing",
        action="store_true",
        help="cap each scenario's pacing at what its paths carry (see oracle_rate)",
    )
    p.add_argument(
        "--queue",
        type=int,
        default=None,
        metavar="PKTS",
        help="queue length of the switch ports' classes (default: dlcp tc's)",
    )
    p.add_argument(
        "--logs",
        default=f"/tmp/dlcp-mp-logs-{os.getpid()}",
        help="where the daemons' logs of a failed scenario are saved",
    )
    p.add_argument("--name", default="pol-bench-mp", help="testbed name")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args()
    if os.geteuid() != 0:
        print("multipath: needs root (network namespaces)", file=sys.stderr)
        return 1
    rate = parse_rate(a.rate)
    elements = parse_size(a.size) // 4
    try:
        extra = parse_sets(a.set)
    except ValueError as exc:
        print(f"multipath: {exc}", file=sys.stderr)
        return 1
    scenarios = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    balance_of = {"flow": "flow", "spray": "spray", "adaptive": "adaptive",
                  "spray-lossy": "spray"}  # fmt: skip
    unknown = [s for s in scenarios if s not in balance_of]
    if unknown:
        print(f"multipath: unknown scenarios {unknown}; known: {list(balance_of)}", file=sys.stderr)
        return 1
    root = Path(tempfile.mkdtemp(prefix="dlcp-mp-", dir="/tmp"))
    rows: list[dict[str, Any]] = []
    line = rate * 1408 / (1408 + WIRE_OVERHEAD)  # one path's capacity in fp32 payload bits
    tb = Testbed.up(TestbedSpec(name=a.name, hosts=2, paths=2, rate_bps=rate), state_root=root)
    try:
        if a.queue is not None:
            tb.apply_tc(queue_packets=a.queue)
        for rep in range(a.repeat):
            for n, scenario in enumerate(scenarios):
                row = run_one(tb, scenario, balance_of[scenario], a, rate, elements, extra,
                              job=500 + 16 * rep + n)  # fmt: skip
                row["repeat"] = rep
                rows.append(row)
            print("ratios:", format_ratios(ratios(rows, rep, line)), flush=True)
    finally:
        tb.down()
        shutil.rmtree(root, ignore_errors=True)

    per_rep = [ratios(rows, rep, line) for rep in range(a.repeat)]
    summary: dict[str, float] = {"one_path_line_bps": round(line)}
    for key in sorted({k for r in per_rep for k in r}):
        values = [r[key] for r in per_rep if key in r]
        summary[key] = round(statistics.median(values), 4)
    summary["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    for row in rows:
        row["summary"] = summary
    if a.repeat > 1:
        print(f"median over {a.repeat} repeats:", format_ratios(summary))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def run_one(
    tb: Testbed,
    scenario: str,
    balance: str,
    a: argparse.Namespace,
    rate: int,
    elements: int,
    extra: dict[str, dict[str, Any]],
    *,
    job: int,
) -> dict[str, Any]:
    lossy = scenario in ("adaptive", "spray-lossy")
    for h in range(2):  # loss on path 1, both directions (what each host sends)
        tb.set_loss(h, a.loss if lossy else 0.0, path=1)
    base = {
        "scenario": scenario,
        "balance": balance,
        "path_rate_bps": rate,
        "loss_pct": [0.0, a.loss if lossy else 0.0],
        "daemon_config": extra,
        "queue_packets": a.queue,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    if a.oracle_pacing:
        # pace each peer at what the balancer's paths can carry, as a rate
        # control that knew the bottleneck would: isolates the balancing
        cap = oracle_rate(scenario, rate)
        extra = {
            **extra,
            "rate": {
                **extra.get("rate", {}),
                "link_rate_bps": cap,
                "initial_rate_bps": cap,
                "min_rate_bps": 0.8 * cap,
            },
        }
        base["daemon_config"] = extra
    try:
        row = run_scenario(tb, balance=balance, elements=elements, iters=a.iters, job=job,
                           extra=extra)  # fmt: skip
    except (DlcpError, RuntimeError, TimeoutError) as exc:
        saved = save_logs(tb, a.logs, f"{scenario}-{job}")
        print(f"{scenario:12s} FAILED: {type(exc).__name__}: {exc} (logs: {saved})", flush=True)
        return {**base, "error": f"{type(exc).__name__}: {exc}", "logs": str(saved)}
    row.update(base)
    mbit = row["throughput_bps"] / 1e6
    print(
        f"{scenario:12s} p50 {row['p50_s']:.3f} s  {mbit:7.1f} Mbit/s"
        f"  packets/path {row['packets_per_path']}  retransmits {row['retransmits']}"
        f"  cpu {row['cpu_s']:.1f} s  load {base['loadavg_1m']}",
        flush=True,
    )
    return row


def oracle_rate(scenario: str, rate: int) -> float:
    """The pacing rate of each path (UDP payload bits/s) that fills it (the
    rate controller then stays between 80 and 100 % of it), 3 % below the
    line rate for the pacer's bursts. The daemon paces every path on its own,
    so it is the same for every scenario."""
    return rate * (1408 + 64) / (1408 + WIRE_OVERHEAD) * 0.97


def save_logs(tb: Testbed, where: str, label: str) -> Path:
    """Copy the daemons' logs and a status snapshot out of the testbed (removed at the end)."""
    out = Path(where) / label
    out.mkdir(parents=True, exist_ok=True)
    for h in tb.hosts:
        if h.log.exists():
            shutil.copy(h.log, out / f"{h.name}.log")
        try:
            c = DaemonClient(str(h.socket))
            try:
                (out / f"{h.name}.status.json").write_text(json.dumps(c.status(), indent=2))
            finally:
                c.close()
        except (DlcpError, OSError) as exc:
            (out / f"{h.name}.status.json").write_text(json.dumps({"error": str(exc)}))
    return out


def ratios(rows: list[dict[str, Any]], rep: int, line: float) -> dict[str, float]:
    """The ratios of one repetition (scenarios that failed are left out)."""
    by = {r["scenario"]: r for r in rows if r.get("repeat") == rep and "error" not in r}
    out: dict[str, float] = {}
    if "flow" in by:
        flow = by["flow"]["throughput_bps"]
        out["flow_over_line"] = flow / line
        if "spray" in by:
            out["spray_over_flow"] = by["spray"]["throughput_bps"] / flow
        for name in ("adaptive", "spray-lossy"):
            if name in by:
                key = name.replace("-", "_")
                out[f"{key}_over_flow"] = by[name]["throughput_bps"] / flow
                out[f"{key}_over_line"] = by[name]["throughput_bps"] / line
    return out


def format_ratios(r: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in r.items() if k not in ("one_path_line_bps",))


if __name__ == "__main__":
    sys.exit(main())
