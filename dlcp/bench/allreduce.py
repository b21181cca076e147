"""`dlcp bench allreduce`: all-reduce latency of dlcp and Gloo on one emulated cluster.

Every backend runs in the same invocation, one after the other, on the same
testbed with the same scenario (the scenario's loss, bursts or background
traffic are applied afresh for each backend run). One worker process per host
runs in the host's namespace (`dlcp.bench.ar_worker`); dlcp's workers talk to
real daemons (`dlcpd`, one per host, paced at link rate / (hosts - 1) per peer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlcp.bench import cpuload
from dlcp.bench.backends import TABLE, gloo_ifnames
from dlcp.bench.cluster import GLOO_PRIO_DSCP, Cluster, Setup
from dlcp.bench.common import (
    ALLREDUCE_KEYS,
    CODECS,
    BenchError,
    check_backends,
    format_bytes,
    format_rate,
    summarize_times,
)
from dlcp.bench.common import say as default_say
from dlcp.bench.procs import STALL_S, RunBound, RunStopped, WorkerGroup, worker_argv, worker_env
from dlcp.errors import DlcpError
from dlcp.shim.placement import ps_fields

__all__ = ["AllreduceOptions", "format_table", "run_allreduce", "run_backend"]

Say = Callable[[str], None]


@dataclass(frozen=True)
class AllreduceOptions:
    setup: Setup
    size_bytes: int = 32_000_000
    iters: int = 20
    codec: str = "fp32"
    backends: Sequence[str] = ("dlcp", "gloo", "gloo-prio")
    bound: float = 0.05  # dlcp's loss bound (not for dlcp-nobound)
    warmup: int = 2
    # dlcp submits the buffer in buckets of this size, all in flight at once,
    # as DDP does (0: one bucket).
    bucket_bytes: int = 0
    check: bool = True
    round_timeout_s: float = 60.0
    progress: bool = True
    predict: bool = True  # the cost model's prediction in each record (dlcp.bench.predict)
    extra: dict[str, Any] = field(default_factory=dict)  # copied into every record
    # a backend is stopped (its record failed) when its workers report nothing
    # for stall_s, or run past budget_s (None: `default_budget_s`)
    stall_s: float = STALL_S
    budget_s: float | None = None

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise BenchError(f"unknown codec {self.codec!r}; valid: {', '.join(CODECS)}")
        if self.iters < 1:
            raise BenchError(f"--iters must be >= 1, not {self.iters}")
        if self.size_bytes < 4:
            raise BenchError("--size must be at least 4 bytes (one float32)")
        if not 0 <= self.bound <= 0.5:
            raise BenchError(f"--loss-bound must be in 0..0.5, not {self.bound}")
        check_backends(self.backends, "allreduce")

    @property
    def elements(self) -> int:
        return self.size_bytes // 4

    @property
    def default_budget_s(self) -> float:
        """60 s (the workers' start), and per iteration (warm-up too) the
        larger of 2 s and twice the hosts' buffers through one port at the link
        rate: several times what a run at the link's pace takes, small enough
        that three backends stay within 10 minutes at 10 MB and 40 iterations
        among 3 hosts at 200 Mbit/s whatever one of them does."""
        s = self.setup
        port_s = 2 * s.hosts * self.elements * 32 / s.rate_bps if s.rate_bps else 0.0
        return 60.0 + (self.warmup + self.iters) * max(2.0, port_s)

    @property
    def run_bound(self) -> RunBound:
        """When a backend's run is stopped (`dlcp.bench.procs.RunBound`)."""
        budget = self.default_budget_s if self.budget_s is None else self.budget_s
        return RunBound(self.stall_s, budget)


_ports = iter(range(29600, 30600))


def _record(opts: AllreduceOptions, backend: str, codec: str) -> dict[str, Any]:
    s = opts.setup
    return {
        "backend": backend,
        "codec": codec,
        "scenario": s.scenario,
        "hosts": s.hosts,
        "size_bytes": opts.elements * 4,
        "iters": opts.iters,
        "times_s": [],
        "p50_s": float("nan"),
        "p99_s": float("nan"),
        "busbw_gbps": float("nan"),
        "cpu_s": float("nan"),
        "loss_frac": 0.0,
        "cpu_bound": None,  # set from the run (dlcp.bench.cpuload); None: not measured
        "rate_bps": s.rate_bps,
        "paths": s.n_paths,
        "loss_pct": s.loss_pct if s.scenario == "loss" else 0.0,
        **({"path_down": dataclasses.asdict(s.path_down)} if s.scenario == "pathdown" else {}),
        "mtu": s.mtu,
        "pacing": s.pacing,
        "gloo_ifnames": gloo_ifnames(s.n_paths),  # GLOO_SOCKET_IFNAME of the run
        **opts.extra,
    }


def run_backend(cluster: Cluster, opts: AllreduceOptions, backend: str, say: Say) -> dict[str, Any]:
    """One backend's run on `cluster`: a record (with "error" if it failed)."""
    b = TABLE[backend]
    is_dlcp = b.is_dlcp
    codec = b.codec(opts.codec)
    rec = _record(opts, backend, codec)
    tb = cluster.tb
    s = opts.setup
    bound = 0.0 if backend == "dlcp-nobound" else opts.bound
    if is_dlcp:
        rec["loss_bound"] = bound
        rec["bucket_bytes"] = opts.bucket_bytes
        rec["mode"] = s.mode
        if s.mode == "ps":
            rec.update(servers=s.servers, colocate=s.colocate)
    started = time.monotonic()
    held = contextlib.ExitStack()
    try:
        if is_dlcp:
            cluster.start_dlcp(backend, timeout_s=opts.round_timeout_s)
        elif b.prio:
            cluster.mark_tcp(GLOO_PRIO_DSCP)
        common = [
            "--world", str(s.hosts),
            "--elements", str(opts.elements),
            "--iters", str(opts.iters),
            "--warmup", str(opts.warmup),
            "--timeout", str(opts.round_timeout_s),
        ]  # fmt: skip
        if is_dlcp:
            key = secrets.token_hex(32)
            job = secrets.randbits(31)
            hosts = cluster.join_hosts(backend)
            shape = ps_fields(s.hosts, s.servers, s.colocate) if s.mode == "ps" else {}
            # the job in the switch or on the servers, as the shim's rank 0 puts it there
            held.enter_context(_held_jobs(cluster, job, key, hosts, shape))
            argvs = [
                worker_argv(
                    "dlcp.bench.ar_worker",
                    [
                        "--backend",
                        "dlcp",
                        "--rank",
                        str(h.index),
                        *common,
                        "--socket",
                        str(h.socket),
                        "--hosts",
                        json.dumps(hosts),
                        "--job",
                        str(job),
                        "--key",
                        key,
                        "--codec",
                        codec,
                        "--mode",
                        s.mode,
                        "--bound",
                        str(bound),
                        *(["--check"] if opts.check else []),
                        "--bucket-elements",
                        str(opts.bucket_bytes // 4),
                        "--shape",
                        json.dumps(shape),
                    ],
                )
                for h in cluster.train_hosts
            ]
        else:
            port = next(_ports)
            argvs = [
                worker_argv(
                    "dlcp.bench.ar_worker",
                    [
                        "--backend",
                        "gloo",
                        "--rank",
                        str(h.index),
                        *common,
                        "--master",
                        tb.address(0),
                        "--port",
                        str(port),
                        "--cast",
                        "none" if b.hook == "default" else b.hook,
                        *(["--check"] if opts.check else []),
                    ],
                )
                for h in cluster.train_hosts
            ]
        env = worker_env({"GLOO_SOCKET_IFNAME": rec["gloo_ifnames"]})
        say(f"{backend}: starting {len(argvs)} workers")
        _run_workers(cluster, opts, backend, argvs, env, rec, say)
    except BenchError as exc:
        rec["error"] = str(exc)
        if isinstance(exc, RunStopped):
            rec["stopped"] = exc.why
        if is_dlcp and cluster.daemons_running:
            tail = cluster.daemon_log_tail(3)
            if tail:
                rec["error"] += f"\ndaemon logs: {tail}"
        say(f"{backend}: FAILED: {rec['error']}")
    finally:
        held.close()
        if is_dlcp:
            cluster.stop_dlcp()
        if cluster.log_dir is not None:
            cluster.save_logs(cluster.log_dir, backend)
        if b.prio:
            cluster.mark_tcp(None)
    rec["wall_s"] = time.monotonic() - started
    return rec


@contextlib.contextmanager
def _held_jobs(
    cluster: Cluster, job: int, key: str, hosts: list[dict[str, Any]], shape: dict[str, Any]
) -> Iterator[None]:
    """Job `job` joined at the switch aggregator (its last host) or at each
    dedicated parameter server (after the training hosts) while the block
    runs: they sum only the jobs they were given."""
    from dlcp.shim.client import DaemonClient

    s = cluster.setup
    tb = cluster.tb
    if s.mode == "switch":
        if tb.switch_socket is None:
            raise BenchError("--mode switch needs the testbed's switch aggregator")
        joins = [(str(tb.switch_socket), len(hosts) - 1, "the switch aggregator")]
    else:
        servers = tb.hosts[s.hosts :] if s.mode == "ps" else ()
        joins = [(str(h.socket), h.index, f"parameter server {h.name}") for h in servers]
    with contextlib.ExitStack() as clients:
        for socket, me, what in joins:
            try:
                client = clients.enter_context(DaemonClient(socket, timeout=10.0))
                client.hello()
                client.join(job=job, key=key, hosts=hosts, me=me, mode=s.mode, **shape)
            except (OSError, DlcpError) as exc:
                raise BenchError(f"{what}: {exc}") from exc
        yield


def _run_workers(
    cluster: Cluster,
    opts: AllreduceOptions,
    backend: str,
    argvs: list[list[str]],
    env: dict[str, str],
    rec: dict[str, Any],
    say: Say,
) -> None:
    from tqdm import tqdm

    label = cluster.run_label(backend)
    is_dlcp = backend.startswith("dlcp")
    group = WorkerGroup(
        cluster.tb, argvs, log_dir=cluster.work_dir, label=label, env=env, bound=opts.run_bound
    )
    with group as g, contextlib.ExitStack() as scenario:
        g.expect("joined", 180.0)
        if opts.setup.scenario != "clean":
            say(f"{backend}: workers joined; applying scenario {opts.setup.scenario}")
        scenario.enter_context(cluster.disturbed())  # from here on, not during setup
        g.send("go")
        g.expect("warm", 60.0 + opts.warmup * opts.round_timeout_s)
        pids = cluster.daemon_pids() if is_dlcp else []
        d0 = cpuload.processes_cpu_s(pids)
        mine = pids + g.pids()
        cpu0 = cpuload.snapshot(mine)
        bar = tqdm(
            total=opts.iters,
            desc=f"{label:<22}",
            unit="it",
            file=sys.stderr,
            disable=not opts.progress,
            leave=True,
            dynamic_ncols=True,
        )

        try:
            for _ in range(opts.iters):  # each round: go to all, "iter" from all
                g.send("go")
                done = g.expect("iter", 60.0 + opts.round_timeout_s)
                bar.update(1)
                # the round's time so far (the results replace them): a run
                # stopped by its bound keeps the rounds it finished
                rec["times_s"].append(max(float(m.get("t", 0.0)) for m in done))
                bar.set_postfix_str(f"{rec['times_s'][-1]:.3f}s")
            results = g.expect("result", 60.0)
        finally:
            bar.close()
            # a stopped run too: was the machine's CPU what held it up?
            rec.update(cpuload.load(cpu0, cpuload.snapshot(mine)))
        daemon_cpu = cpuload.processes_cpu_s(pids) - d0
        g.send("go")  # every host has its results: leave
        g.wait()
    per_rank = [r["times_s"] for r in results]
    times = [max(ts) for ts in zip(*per_rank, strict=True)]
    rec["times_s"] = times
    rec.update(summarize_times(times, rec["size_bytes"], opts.setup.hosts))
    rec["cpu_s"] = sum(float(r["cpu_s"]) for r in results) + daemon_cpu
    if is_dlcp:
        rec["daemon_cpu_s"] = daemon_cpu
        lost = sum(int(r.get("lost_lanes", 0)) for r in results)
        total = sum(int(r.get("total_lanes", 0)) for r in results)
        rec["loss_frac"] = lost / total if total else 0.0
        rec["saturated"] = sum(int(r.get("saturated", 0)) for r in results)
    # relative L2 error of the mean (rank 0's check; Gloo's casts have theirs)
    errors = [float(r["error"]) for r in results if r.get("error") is not None]
    rec["result_error"] = max(errors) if errors else None


def run_allreduce(
    opts: AllreduceOptions, say: Say | None = None, *, log_dir: Path | None = None
) -> list[dict[str, Any]]:
    """Build the cluster, run every backend, remove the cluster; the records."""
    say = say or default_say
    records = []
    with Cluster(opts.setup, progress=say) as cluster:
        cluster.log_dir = log_dir
        for backend in opts.backends:
            records.append(run_backend(cluster, opts, backend, say))
    if opts.predict:  # after the runs: calibrating, if the cache lacks a codec, takes seconds
        from dlcp.bench.predict import allreduce_profile, annotate

        profile = functools.partial(allreduce_profile, opts.elements * 4, opts.bucket_bytes)
        annotate(records, profile, kind="allreduce", say=say)
    return records


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """A human table of allreduce records, with each backend's ratio to Gloo."""
    if not records:
        return "(no results)"
    gloo = {
        (r["scenario"], r.get("loss_pct", 0.0)): r
        for r in records
        if r["backend"] == "gloo" and r.get("p50_s") == r.get("p50_s")
    }
    from dlcp.bench.fair import versus

    lines = [
        f"{'scenario':<14} {'backend':<14} {'codec':<5} {'p50 s':>7} {'p99 s':>7} "
        f"{'p99/p50':>7} {'busbw':>7} {'CPU s':>6} {'mCPU s':>6} {'bound':>5} {'lost':>6} "
        f"{'error':>7} {'p50/gloo':>8} {'p99/gloo':>8}  p50/baseline"
    ]
    for r in records:
        scen = r["scenario"] + (f" {r['loss_pct']:g}%" if r.get("loss_pct") else "")
        if r.get("error"):
            why = str(r["error"]).splitlines()[0]
            lines.append(f"{scen:<14} {r['backend']:<14} {r['codec']:<5} FAILED: {why}")
            continue
        g = gloo.get((r["scenario"], r.get("loss_pct", 0.0)))

        def ratio(key: str, r: dict[str, Any] = r, g: dict[str, Any] | None = g) -> str:
            if g is None or not g.get(key):
                return "-"
            return f"{r[key] / g[key]:.2f}x"

        tail = r["p99_s"] / r["p50_s"] if r["p50_s"] else float("nan")
        err = "-" if r.get("result_error") is None else f"{r['result_error']:.2g}"
        lines.append(
            f"{scen:<14} {r['backend']:<14} {r['codec']:<5} {r['p50_s']:7.3f} {r['p99_s']:7.3f} "
            f"{tail:7.2f} {r['busbw_gbps']:7.3f} {r['cpu_s']:6.1f} "
            f"{r.get('machine_cpu_s', float('nan')):6.1f} {cpuload.mark(r):>5} "
            f"{100 * r.get('loss_frac', 0.0):5.2f}% {err:>7} {ratio('p50_s'):>8} "
            f"{ratio('p99_s'):>8}  {versus(r, records)}"
        )
    first = records[0]
    lines.append(
        f"({first['hosts']} hosts, {format_rate(first.get('rate_bps'))} links, "
        f"{format_bytes(first['size_bytes'])} buffer, {first['iters']} iterations; "
        "busbw in Gbit/s at p50; CPU s: the backend's processes, mCPU s: the whole "
        "machine's busy CPU; bound: cpu = the run was CPU-bound, net = it was not; error: "
        "relative L2 error of the mean; p50/baseline: dlcp's over the fastest baseline "
        "whose error is no larger)"
    )
    lines += cpuload.baseline_notes(
        records, lambda r: r["scenario"] + (f" {r['loss_pct']:g}%" if r.get("loss_pct") else "")
    )
    return "\n".join(lines)


def save(records: Sequence[dict[str, Any]], path: Path | str) -> None:
    from dlcp.bench.common import write_json

    write_json(path, records, ALLREDUCE_KEYS)
