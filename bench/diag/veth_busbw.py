"""All-reduce bus bandwidth of dlcp and Gloo between two namespaces on one veth.

    sudo python bench/diag/veth_busbw.py --size 100MB --iters 5 [--mtu 1500] [--pairs N]
        [--json out.json]

Both backends run in the same invocation on the same unthrottled veth pair
(no switch, no rate limit). Reports per backend: median time, bus bandwidth
(2(n-1)/n * size / time; = size / time for 2 ranks) and CPU seconds per GB
moved (all processes of the backend: Gloo's two ranks; dlcp's two daemons and
the two client ranks), and per dlcp daemon its user and system CPU seconds and
minor page faults over its whole life. `--pairs N` runs the backends N times,
alternating, and reports the median of the N ratios (the JSON has every run,
with its `pair`): one pair swings by 10-20 % on this VM.

With `--profile DIR` both daemons are sampled by py-spy (BW_IDLE=1: idle
samples too; BW_NATIVE=1: native frames too, pausing the daemon per sample)
or, with BW_PERF=1, by `perf record -g` (kernel and native frames;
DIR/d<i>.perf; BW_PERF_HZ: its sampling rate, 499 by default; BW_PERF_EVENT: an
event (e.g. page-faults) recorded at every occurrence instead of CPU time; BW_PERF=dwarf:
user-space call chains from DWARF, for code built without frame pointers).
BW_TRACE=DIR runs the daemons with their event loop traced
(bench/diag/daemon_trace.py; DIR/d<i>.trace, the last run's) and prints each one's
summary: per round, the time in receives, flushes and the round's start, per
datagram, and the median round's timeline.
`--floor` adds the UDP floor (`run_floor`) between the two.
The daemons' pacing ceiling (`[rate] ceiling_bps`, dlcpd's default 10
Gbit/s: a real link's rate) is `--ceiling`, 100 Gbit/s by default: the veth
has no rate (it reports a nominal 10 Gbit/s, and Gloo moves more than that
over it), so the ceiling is set above what the two namespaces can move, as an
operator sets it to a fast NIC's rate; `--ceiling 10e9` measures with dlcpd's
default. BW_RATE="key = value;key = value" adds settings to the daemons'
[rate] table (e.g. BW_RATE="min_rate_bps = 9e9" pins the pacing rate). BW_PIN=1 runs each
namespace's processes (Gloo's rank i, dlcp's daemon i) on CPU i only: one
core per emulated host, for both backends. BW_DAEMON_ENV="NAME=value;NAME=value" adds
variables to the daemons' environment only (e.g. glibc tunables), not Gloo's.
BW_NETWORK="key = value;..." adds settings to their [network] table (e.g.
BW_NETWORK="window_bytes = 0" turns flow control off).

The JSON has, per dlcp round, its wall time, each daemon's CPU seconds and
seconds waiting runnable for a CPU (schedstat), and the machine's idle and
softirq seconds (/proc/stat, 10 ms ticks): a round slower than its daemons'
CPU time says the daemons waited, on each other or for a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def parse_size(text: str) -> int:
    """'100MB', '32MiB', '4096' -> bytes (MB = 10**6, MiB = 2**20)."""
    t = text.strip().upper()
    for unit, mult in (
        ("GIB", 2**30),
        ("MIB", 2**20),
        ("KIB", 2**10),
        ("GB", 10**9),
        ("MB", 10**6),
        ("KB", 10**3),
        ("B", 1),
    ):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


NS = ("dlcpbw-a", "dlcpbw-b")
ADDR = ("10.78.0.1", "10.78.0.2")


def sh(*argv: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    full = ["ip", "netns", "exec", ns, *argv] if ns else list(argv)
    return subprocess.run(full, check=check, capture_output=True, text=True)


def setup(mtu: int) -> None:
    teardown()
    for ns in NS:
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", "bw0", "netns", NS[0], "type", "veth", "peer", "bw1", "netns", NS[1])
    for i, ns in enumerate(NS):
        dev = f"bw{i}"
        sh("ip", "link", "set", "lo", "up", ns=ns)
        sh("ip", "link", "set", dev, "mtu", str(mtu), "up", ns=ns)
        sh("ip", "addr", "add", f"{ADDR[i]}/24", "dev", dev, ns=ns)


def python_in(ns: int, *argv: str) -> list[str]:
    """argv running this Python in namespace NS[ns]."""
    pin = ["taskset", "-c", str(ns)] if os.environ.get("BW_PIN") else []
    return ["ip", "netns", "exec", NS[ns], *pin, sys.executable, *argv]


def trace_of(folder: str, daemon: int) -> Path:
    """Where daemon `daemon` writes its BW_TRACE trace (the last run's)."""
    return Path(folder) / f"d{daemon}.trace"


def teardown() -> None:
    for ns in NS:
        sh("ip", "netns", "del", ns, check=False)


def proc_stat(pid: int) -> tuple[float, float, int]:
    """(user CPU s, system CPU s, minor page faults) of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick, int(fields[7])


def peak_rss_mb(pid: int) -> float:
    """A process's peak resident size so far, MB (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def proc_cpu(pid: int) -> float:
    user, system, _ = proc_stat(pid)
    return user + system


def system_cpu() -> dict[str, float]:
    """Machine-wide CPU seconds by kind (/proc/stat's first line)."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        v = [int(x) / tick for x in f.readline().split()[1:8]]
    return dict(zip(("user", "nice", "system", "idle", "iowait", "irq", "softirq"), v, strict=True))


def run_delay(pid: int) -> float:
    """Seconds a process has waited runnable for a CPU so far (schedstat)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def run_time(pid: int) -> float:
    """Seconds a process's main thread has run so far (schedstat, in
    nanoseconds: finer than the clock ticks of `proc_cpu`)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def round_split(
    mark: tuple[list[float], dict[str, float], list[float], list[float]],
    pids: list[int],
    wall: float,
) -> dict:
    """One round's wall time beside each daemon's CPU (in clock ticks, and as
    run time to the nanosecond) and the machine's idle and softirq seconds in
    it (diagnostics: where a slow round's time went)."""
    cpu0, sys0, wait0, run0 = mark
    sys1 = system_cpu()
    return {
        "wall_s": wall,
        "daemon_cpu_s": [proc_cpu(p) - c for p, c in zip(pids, cpu0, strict=True)],
        "daemon_run_s": [run_time(p) - r for p, r in zip(pids, run0, strict=True)],
        "runqueue_s": [run_delay(p) - w for p, w in zip(pids, wait0, strict=True)],
        "idle_s": sys1["idle"] - sys0["idle"],
        "softirq_s": sys1["softirq"] - sys0["softirq"],
    }


def run_gloo(elements: int, iters: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": ""}
    procs = []
    for r in range(2):
        e = dict(env)
        e["GLOO_SOCKET_IFNAME"] = f"bw{r}"
        procs.append(
            subprocess.Popen(
                python_in(
                    r,
                    str(ROOT / "bench/diag/_gloo_worker.py"),
                    "--rank",
                    str(r),
                    "--world",
                    "2",
                    "--master",
                    ADDR[0],
                    "--elements",
                    str(elements),
                    "--iters",
                    str(iters),
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=e,
            )
        )
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(f"gloo worker failed: {err[-2000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    times = [max(a, b) for a, b in zip(outs[0]["times_s"], outs[1]["times_s"], strict=True)]
    return {"times_s": times, "cpu_s": sum(o["cpu_s"] for o in outs)}


def run_floor(nbytes: int, iters: int, segment: int) -> dict:
    """The UDP floor: each side sends `nbytes` to the other while receiving its
    `nbytes` (what one dlcp all-reduce of `nbytes` moves per host with 2 hosts:
    half the data out, half the results back), as fast as plain Python moves
    datagrams of `segment` bytes with UDP GSO and GRO, doing nothing else
    (bench/diag/_udp_floor_worker.py). A bound on any UDP transport in Python here."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    times, cpu, lost = [], 0.0, 0
    for it in range(iters + 1):
        procs = [
            subprocess.Popen(
                python_in(
                    i,
                    str(ROOT / "bench/diag/_udp_floor_worker.py"),
                    "--me",
                    ADDR[i],
                    "--peer",
                    ADDR[1 - i],
                    "--bytes",
                    str(nbytes),
                    "--segment",
                    str(segment),
                ),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for i in range(2)
        ]
        try:
            for pr in procs:
                assert pr.stdout is not None
                if pr.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"udp floor worker failed: {pr.stderr.read()[-2000:]}")
            for pr in procs:
                assert pr.stdin is not None
                pr.stdin.write("go\n")
                pr.stdin.flush()
            outs = []
            for pr in procs:
                out, err = pr.communicate(timeout=120)
                if pr.returncode:
                    raise RuntimeError(f"udp floor worker failed: {err[-2000:]}")
                outs.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for pr in procs:
                if pr.poll() is None:
                    pr.kill()
        if it == 0:
            continue  # warm-up
        times.append(max(o["seconds"] for o in outs))
        cpu += sum(o["user_s"] + o["sys_s"] for o in outs)
        lost += sum(nbytes - o["received"] for o in outs)
    return {"times_s": times, "cpu_s": cpu, "lost_bytes": lost}


def run_dlcp(
    elements: int,
    iters: int,
    payload: int,
    tmp: Path,
    pacing: bool = True,
    profile: str | None = None,
    mac: str | None = None,
    ceiling: float = 100e9,
) -> dict:
    from dlcp.core.layout import Layout
    from dlcp.shim.client import DaemonClient, SealedSegment, Segment
    from dlcp.wire.header import Codec, lane_bytes

    daemons = []
    spies: list[subprocess.Popen[bytes]] = []
    trace = os.environ.get("BW_TRACE")
    if trace:
        Path(trace).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for item in filter(None, os.environ.get("BW_DAEMON_ENV", "").split(";")):
        name, _, value = item.partition("=")  # the daemons' environment only, not Gloo's
        env[name] = value
    try:
        for i in range(2):
            cfg = tmp / f"d{i}.toml"
            cfg.write_text(
                f'[daemon]\nsocket = "{tmp}/d{i}.sock"\nmetrics_port = 0\nhost_index = {i}\n'
                f'[network]\naddresses = ["{ADDR[i]}"]\nudp_port = 7400\npayload = {payload}\n'
                + (f'mac = "{mac}"\n' if mac is not None else "")  # None: dlcpd's default
                + os.environ.get("BW_NETWORK", "").replace(";", "\n")
                + "\n"
                + f"[timing]\ntimeout = 60.0\n[rate]\npacing = {'true' if pacing else 'false'}\n"
                + f"ceiling_bps = {ceiling:.6g}\n"
                + os.environ.get("BW_RATE", "").replace(";", "\n")
                + "\n"
            )
            argv: tuple[str, ...] = ("-m", "dlcp.daemon")
            if trace:  # the daemon's loop traced (bench/diag/daemon_trace.py)
                argv = (
                    str(ROOT / "bench" / "diag" / "daemon_trace.py"),
                    str(trace_of(trace, i)),
                    "--",
                )
            with open(tmp / f"d{i}.log", "wb") as log:  # Popen keeps its own copy
                daemons.append(
                    subprocess.Popen(
                        python_in(i, *argv, "--config", str(cfg)),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        # `-m` puts the working directory first on sys.path:
                        # run from this checkout, so that its dlcp is the one
                        # imported even when the bench is started from another
                        cwd=ROOT,
                    )
                )
        for i in range(2):
            deadline = time.monotonic() + 30
            while not (tmp / f"d{i}.sock").exists():
                if time.monotonic() > deadline or daemons[i].poll() is not None:
                    raise RuntimeError((tmp / f"d{i}.log").read_text()[-2000:])
                time.sleep(0.05)
        if profile:  # sampling profiles of both daemons (py-spy writes them when they exit)
            Path(profile).mkdir(parents=True, exist_ok=True)
            perf = os.environ.get("BW_PERF")  # kernel and native frames too: perf, not py-spy
            spies = [
                subprocess.Popen(
                    [
                        "perf",
                        "record",
                        *(["--call-graph", "dwarf,16384"] if perf == "dwarf" else ["-g"]),
                        *(
                            ["-e", os.environ["BW_PERF_EVENT"], "-c", "1"]
                            if os.environ.get("BW_PERF_EVENT")
                            else ["-F", os.environ.get("BW_PERF_HZ", "499")]
                        ),
                        "-o",
                        f"{profile}/d{i}.perf",
                        "-p",
                        f"{d.pid}",
                    ]
                    if perf
                    else [
                        "py-spy",
                        "record",
                        # native frames need the process paused while sampled
                        *(["--native"] if os.environ.get("BW_NATIVE") else ["--nonblocking"]),
                        *(["--idle"] if os.environ.get("BW_IDLE") else []),
                        "-r",
                        os.environ.get("BW_SPY_RATE", "100"),
                        "-f",
                        "raw",
                        "-o",
                        f"{profile}/d{i}.txt",
                        "--pid",
                        str(d.pid),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for i, d in enumerate(daemons)
            ]
        nbytes = 4 * elements
        lay = Layout(elements, Codec.FP32, 2, payload)
        out_len = lane_bytes(Codec.FP32, elements, True) + 6 * lay.packets
        clients, segs = [], []
        hosts = [{"addresses": [a], "udp_port": 7400} for a in ADDR]
        key = os.urandom(32)
        x = np.random.default_rng(0).standard_normal(elements).astype(np.float32)
        for i in range(2):
            c = DaemonClient(str(tmp / f"d{i}.sock"))
            c.hello()
            kind = Segment if os.environ.get("BW_NAMED") else SealedSegment
            s = kind(f"dlcp-bw{os.getpid()}-{i}", nbytes + out_len)
            s.buf[:nbytes] = x.tobytes()
            c.segment(s)
            c.join(job=1, key=key, hosts=hosts, me=i, local_ranks=1)
            clients.append(c)
            segs.append(s)
        times = []
        pids = [d.pid for d in daemons]
        # the daemon is the child of `ip netns exec` (exec'd in place: same pid)
        cpu0 = sum(proc_cpu(p) for p in pids) + time.process_time()
        per_round = []
        for it in range(iters + 1):
            mark = (
                [proc_cpu(p) for p in pids],
                system_cpu(),
                [run_delay(p) for p in pids],
                [run_time(p) for p in pids],
            )
            t = time.perf_counter()
            futs = [
                c.submit(
                    job=1,
                    round=it,
                    bucket=0,
                    codec="fp32",
                    total=elements,
                    data=[0, nbytes],
                    out=[nbytes, out_len],
                )
                for c in clients
            ]
            for f in futs:
                f.result(300)
            wall = time.perf_counter() - t  # before the diagnostics' /proc reads
            per_round.append(round_split(mark, pids, wall))
            if it == 0:  # warm-up
                cpu0 = sum(proc_cpu(p) for p in pids) + time.process_time()
                continue
            times.append(wall)
        cpu = sum(proc_cpu(p) for p in pids) + time.process_time() - cpu0
        split = [proc_stat(p) for p in pids]
        peaks = [peak_rss_mb(p) for p in pids]
        got = np.frombuffer(segs[0].buf[nbytes : 2 * nbytes], np.float32)
        assert np.array_equal(got, x + x), "dlcp result is not the exact sum"
        stats = []
        for c in clients:  # what the rate controllers and sockets did (diagnostics)
            st = c.status()
            stats.append(
                {
                    "peers": [
                        {
                            k: p.get(k)
                            for k in (
                                "rate_bps",
                                "lost_packets",
                                "sent_packets",
                                "window_stalls",
                                "window_resets",
                                "in_flight_bytes",
                            )
                        }
                        for p in st["peers"]
                    ],
                    "paths": [
                        {k: p[k] for k in ("sendmsg_calls", "recvmsg_calls")} for p in st["paths"]
                    ],
                    "mac": st.get("mac"),
                    "counters": st["counters"],
                }
            )
        for c in clients:
            c.close()
        for s in segs:
            s.close()
        for st, (user, system, minflt), peak in zip(stats, split, peaks, strict=True):
            # whole life, warm-up included
            st.update(user_s=user, sys_s=system, minflt=minflt, peak_rss_mb=peak)
        return {"times_s": times, "cpu_s": cpu, "daemons": stats, "rounds": per_round[1:]}
    finally:
        for d in daemons:
            d.terminate()
        for d in daemons:
            try:
                d.wait(20)
            except subprocess.TimeoutExpired:
                d.kill()
        for s in spies:
            try:
                s.wait(30)
            except subprocess.TimeoutExpired:
                s.kill()


def main() -> int:
    from dlcp.daemon.config import Config
    from dlcp.wire.header import HEADER_SIZE
    from dlcp.wire.mac import MAC_ALGORITHMS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="100MB")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--payload", type=int, default=None, help="dlcp payload (default MTU - 92)")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="run Gloo and dlcp (and the floor) this many times, alternating, and report "
        "the median of the ratios: this VM's throughput drifts by 10-20 %% between runs",
    )
    p.add_argument("--no-pacing", action="store_true", help="dlcp daemons send unpaced")
    p.add_argument(
        "--ceiling",
        type=float,
        default=100e9,
        help="the daemons' pacing ceiling, bit/s ([rate] ceiling_bps; dlcpd's default is "
        "10e9, a real link's rate; the veth has none)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also run the UDP floor: the same bytes per host moved by plain Python "
        "sockets (GSO/GRO, no header, MAC or sums; bench/diag/_udp_floor_worker.py)",
    )
    p.add_argument(
        "--mac",
        default=Config().mac,
        choices=MAC_ALGORITHMS,
        help="packet MAC of the dlcp daemons (default: dlcpd's; dlcp/wire/mac.py)",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="sample the dlcp daemons with py-spy: folded stacks in DIR/d<i>.txt",
    )
    a = p.parse_args()
    if a.pairs < 1:
        p.error("--pairs must be 1 or more")
    if os.geteuid() != 0:
        print("veth_busbw: needs root (network namespaces)", file=sys.stderr)
        return 1
    size = parse_size(a.size)
    elements = size // 4
    payload = a.payload or a.mtu - 92
    tmp = Path(tempfile.mkdtemp(prefix="dlcpbw-"))
    rows = []
    try:
        setup(a.mtu)
        runs: list[tuple[str, Any]] = [("gloo", lambda: run_gloo(elements, a.iters))]
        if a.floor:  # datagrams as large as dlcp's: its header and payload
            runs.append(("udp-floor", lambda: run_floor(size, a.iters, payload + HEADER_SIZE)))
        runs.append(
            (
                "dlcp",
                lambda: run_dlcp(
                    elements, a.iters, payload, tmp, not a.no_pacing, a.profile, a.mac, a.ceiling
                ),
            )
        )
        for pair, (name, fn) in ((k, run) for k in range(a.pairs) for run in runs):
            r = fn()
            med = statistics.median(r["times_s"])
            moved_gb = size * a.iters / 1e9  # bus bytes for 2 ranks = size per iteration
            rows.append(
                {
                    "backend": name,
                    "pair": pair,
                    "size_bytes": size,
                    "iters": a.iters,
                    "mtu": a.mtu,
                    "payload": payload if name == "dlcp" else None,
                    "mac": a.mac if name == "dlcp" else None,
                    "ceiling_bps": a.ceiling if name == "dlcp" else None,
                    "times_s": r["times_s"],
                    "p50_s": med,
                    "busbw_gbps": size * 8 / med / 1e9,
                    "cpu_s": r["cpu_s"],
                    "cpu_s_per_gb": r["cpu_s"] / moved_gb,
                    **({"daemons": r["daemons"]} if "daemons" in r else {}),
                    **({"rounds": r["rounds"]} if "rounds" in r else {}),
                    **({"lost_bytes": r["lost_bytes"]} if "lost_bytes" in r else {}),
                }
            )
    finally:
        teardown()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'backend':8} {'pair':>4} {'p50 s':>8} {'busbw Gbit/s':>13} {'CPU s/GB':>9}")
    for r in rows:
        print(
            f"{r['backend']:8} {r['pair']:4d} {r['p50_s']:8.3f} {r['busbw_gbps']:13.2f} "
            f"{r['cpu_s_per_gb']:9.2f}"
        )
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["backend"], []).append(r)
    ratios = [
        d["busbw_gbps"] / g["busbw_gbps"] for g, d in zip(by["gloo"], by["dlcp"], strict=True)
    ]
    if a.pairs > 1:
        for name, rs in by.items():
            print(
                f"{name} median of {a.pairs}: "
                f"{statistics.median(r['busbw_gbps'] for r in rs):.2f} Gbit/s, "
                f"{statistics.median(r['cpu_s_per_gb'] for r in rs):.2f} CPU s/GB"
            )
        print(f"dlcp/gloo ratios: {' '.join(f'{x:.2f}' for x in ratios)}")
    print(
        f"dlcp/gloo bus bandwidth ratio: {statistics.median(ratios):.2f}"
        + (f" (median of {a.pairs} pairs)" if a.pairs > 1 else "")
    )
    if "udp-floor" in by:
        f, g, d = by["udp-floor"][-1], by["gloo"][-1], by["dlcp"][-1]
        print(
            f"udp-floor/gloo: {f['busbw_gbps'] / g['busbw_gbps']:.2f} "
            f"({f['lost_bytes']} bytes lost); dlcp/udp-floor: "
            f"{d['busbw_gbps'] / f['busbw_gbps']:.2f} (last pair)"
        )
    for i, d in enumerate(by["dlcp"][-1]["daemons"]):
        print(f"dlcp daemon {i}: {json.dumps(d)}")
    trace = os.environ.get("BW_TRACE")
    if trace:
        from bench.diag.daemon_trace import parse, summary

        for i in range(2):
            path = trace_of(trace, i)
            print(f"dlcp daemon {i}'s loop, last run ({path}):")
            print(summary(parse(path.read_text().splitlines())))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
