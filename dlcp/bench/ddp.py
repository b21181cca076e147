"""`dlcp bench ddp`: the time of a DDP step with dlcp's hook and with Gloo's default one.

One rank per emulated host trains the same MLP (`dlcp.bench.ddp_worker`,
about `grad_bytes` of fp32 gradients in `layers` layers, so DDP makes several
buckets that become ready over the backward pass) for `warmup` + `steps`
steps: with DDP's default all-reduce over Gloo, PyTorch's fp16, bf16 or
PowerSGD hooks over Gloo (`dlcp.bench.backends`), and with dlcp's hook through
real daemons. Every rank holds one model per backend and alternates their
steps, so the backends meet the same machine (on a shared host, whatever
else runs weighs on all alike); the -prio backends, whose TCP is marked into
the top class, alternate in a second worker group after the others. The
scenario (loss, bursts, background traffic) is on from the first timed step.
A step is forward, backward and the update; its time is the slowest rank's.
`cpu_bound` is each backend's own: the machine's idle share within its
steps (`step_idle_frac`, read around each step by the first rank), with the
alternated run's wait share; `idle_frac` and `machine_cpu_s` are the whole
alternated run's. dlcp's `cpu_s` adds its daemons' CPU to its ranks'. The
dlcp record also carries the shim's timeline (`dlcp.shim.timeline`): medians
per phase of where a bucket's time went between DDP handing it over and its
future completing.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlcp.bench import cpuload
from dlcp.bench.backends import POWERSGD_RANK, TABLE, gloo_ifnames
from dlcp.bench.cluster import GLOO_PRIO_DSCP, Cluster, Setup
from dlcp.bench.common import (
    CODECS,
    BenchError,
    check_backends,
    format_bytes,
    format_rate,
    percentile,
)
from dlcp.bench.common import say as default_say
from dlcp.bench.procs import STALL_S, RunBound, RunStopped, WorkerGroup, worker_argv, worker_env

__all__ = [
    "DDP_BACKENDS",
    "DDP_KEYS",
    "DdpOptions",
    "format_table",
    "run_ddp",
    "save",
    "summarize",
]

Say = Callable[[str], None]

DDP_BACKENDS: tuple[str, ...] = ("dlcp", "gloo")  # the default --backends
# Present in every record of `dlcp bench ddp --json`, in this order.
DDP_KEYS: tuple[str, ...] = (
    "backend",
    "codec",
    "scenario",
    "hosts",
    "grad_bytes",
    "params",
    "steps",
    "step_times_s",
    "p50_s",
    "p99_s",
    "cpu_s",
    "cpu_bound",
)

_ports = iter(range(31700, 32700))


@dataclass(frozen=True)
class DdpOptions:
    setup: Setup
    grad_bytes: int = 50_000_000  # fp32 gradients: grad_bytes / 4 parameters
    layers: int = 8
    batch: int = 16
    steps: int = 20
    warmup: int = 3
    codec: str = "fp32"
    backends: Sequence[str] = DDP_BACKENDS
    bucket_mb: float = 25.0  # DDP's bucket_cap_mb (its default), the same for both
    bound: float = 0.0
    with_model: bool = True  # dlcp.init(model=...): the segment sized up front
    round_timeout_s: float = 60.0
    stall_s: float = STALL_S  # stopped when its workers report nothing this long
    seed: int = 0
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise BenchError(f"unknown codec {self.codec!r}; valid: {', '.join(CODECS)}")
        check_backends(self.backends, "ddp")
        if self.grad_bytes < 4 * 1024:
            raise BenchError(f"--grad-size must be at least 4kB, not {self.grad_bytes} bytes")
        if self.steps < 1 or self.layers < 1 or self.batch < 1:
            raise BenchError("--steps, --layers and --batch must be >= 1")
        if self.warmup < 1:
            raise BenchError("--warmup must be >= 1 (the first step attaches and sizes buckets)")
        if not self.bucket_mb > 0:
            raise BenchError(f"--bucket-cap-mb must be > 0, not {self.bucket_mb}")
        if not 0 <= self.bound <= 0.5:
            raise BenchError(f"--loss-bound must be in 0..0.5, not {self.bound}")

    @property
    def params(self) -> int:
        return self.grad_bytes // 4


def _record(opts: DdpOptions, backend: str) -> dict[str, Any]:
    s = opts.setup
    codec = TABLE[backend].codec(opts.codec)
    return {
        "backend": backend,
        "codec": codec,
        "scenario": s.scenario,
        "hosts": s.hosts,
        "grad_bytes": opts.grad_bytes,
        "params": None,
        "steps": opts.steps,
        "step_times_s": [],
        "p50_s": None,
        "p99_s": None,
        "cpu_s": None,
        "cpu_bound": None,  # from the run (dlcp.bench.cpuload); None: not measured
        "rate_bps": s.rate_bps,
        "paths": s.n_paths,
        "loss_pct": s.loss_pct if s.scenario == "loss" else 0.0,
        "mtu": s.mtu,
        "gloo_ifnames": gloo_ifnames(s.n_paths),  # GLOO_SOCKET_IFNAME of the run
        **({"powersgd_rank": POWERSGD_RANK} if codec == "powersgd" else {}),
        "layers": opts.layers,
        "batch_per_rank": opts.batch,
        "bucket_mb": opts.bucket_mb,
        "warmup": opts.warmup,
        "alternated": len(phases(opts.backends)[TABLE[backend].prio]) > 1,
        "alternated_with": phases(opts.backends)[TABLE[backend].prio],
        **opts.extra,
    }


def phases(backends: Sequence[str]) -> dict[bool, list[str]]:
    """The backends alternated together, by whether their TCP is marked into
    the top class (-prio): the marking is per host, for all of a worker's
    connections, so the marked ones run in a worker group of their own."""
    out: dict[bool, list[str]] = {False: [], True: []}
    for b in backends:
        out[TABLE[b].prio].append(b)
    return out


def _argv(
    cluster: Cluster, opts: DdpOptions, rank: int, port: int, backends: Sequence[str]
) -> list[str]:
    args = [
        "--backend", ",".join(backends), "--rank", str(rank),
        "--world", str(opts.setup.hosts), "--master", cluster.tb.address(0), "--port", str(port),
        "--params", str(opts.params), "--layers", str(opts.layers),
        "--batch", str(opts.batch), "--steps", str(opts.steps), "--warmup", str(opts.warmup),
        "--seed", str(opts.seed), "--codec", opts.codec, "--bound", str(opts.bound),
        "--timeout", str(opts.round_timeout_s), "--bucket-mb", str(opts.bucket_mb),
    ]  # fmt: skip
    if not opts.with_model:
        args.append("--no-model")
    return worker_argv("dlcp.bench.ddp_worker", args)


def run_ddp(
    opts: DdpOptions, say: Say | None = None, *, log_dir: Path | None = None
) -> list[dict[str, Any]]:
    """One run on a new testbed: every rank alternates the backends' steps."""
    say = say or default_say
    records = {b: _record(opts, b) for b in opts.backends}
    uses_dlcp = any(TABLE[b].is_dlcp for b in opts.backends)
    with Cluster(opts.setup, progress=say) as cluster:
        cluster.log_dir = log_dir
        try:
            if uses_dlcp:
                cluster.start_dlcp("dlcp", timeout_s=opts.round_timeout_s)
        except BenchError as exc:
            say(f"FAILED: {exc}")
            for rec in records.values():
                rec["error"] = str(exc)
            return list(records.values())
        try:
            for prio, names in phases(opts.backends).items():
                if names:
                    _phase(cluster, opts, names, [records[b] for b in names], prio, say)
        finally:
            if uses_dlcp:
                cluster.stop_dlcp()
    return list(records.values())


def _phase(
    cluster: Cluster,
    opts: DdpOptions,
    names: Sequence[str],
    records: list[dict[str, Any]],
    prio: bool,
    say: Say,
) -> None:
    """One worker group alternating the steps of `names` (their TCP marked if `prio`)."""
    started = time.monotonic()
    label = "+".join(names)
    try:
        if prio:
            cluster.mark_tcp(GLOO_PRIO_DSCP)
        port = next(_ports)
        argvs = [_argv(cluster, opts, h.index, port, names) for h in cluster.tb.hosts]
        env = worker_env({"GLOO_SOCKET_IFNAME": records[0]["gloo_ifnames"]})
        say(f"{label}: starting {len(argvs)} workers (steps alternated)")
        _run_workers(cluster, opts, names, argvs, env, records, say)
    except BenchError as exc:
        error = str(exc)
        if "dlcp" in names and cluster.daemons_running:
            tail = cluster.daemon_log_tail(3)
            if tail:
                error += f"\ndaemon logs: {tail}"
        say(f"FAILED: {error}")
        for rec in records:
            rec["error"] = error
            if isinstance(exc, RunStopped):
                rec["stopped"] = exc.why
    finally:
        if prio:
            cluster.mark_tcp(None)
        if cluster.log_dir is not None:
            cluster.save_logs(cluster.log_dir, label)
    for rec in records:
        rec["run_wall_s"] = time.monotonic() - started


def _run_workers(
    cluster: Cluster,
    opts: DdpOptions,
    names: Sequence[str],
    argvs: list[list[str]],
    env: dict[str, str],
    records: list[dict[str, Any]],
    say: Say,
) -> None:
    from tqdm import tqdm

    label = f"ddp-{cluster.run_label('+'.join(names))}"
    bound = RunBound(opts.stall_s)
    group = WorkerGroup(
        cluster.tb, argvs, log_dir=cluster.work_dir, label=label, env=env, bound=bound
    )
    with group as g, contextlib.ExitStack() as scenario:
        ready = g.expect("ready", 300.0 + opts.warmup * opts.round_timeout_s)
        if opts.setup.scenario != "clean":
            say(f"{label}: workers ready; applying scenario {opts.setup.scenario}")
        scenario.enter_context(cluster.disturbed())  # from here on, not during setup
        bar = tqdm(
            total=opts.steps,
            desc=f"{label:<20}",
            unit="step",
            file=sys.stderr,
            disable=not opts.progress,
            leave=True,
            dynamic_ncols=True,
        )

        def on_event(rank: int, msg: dict[str, Any]) -> None:
            if msg.get("event") == "step":
                bar.update(1)

        daemons = cluster.daemon_pids()
        mine = g.pids() + daemons
        cpu0 = cpuload.snapshot(mine)
        d0 = cpuload.processes_cpu_s(daemons)
        try:
            g.send("go")
            wait_s = 120.0 + opts.steps * len(names) * opts.round_timeout_s
            results = g.expect_any("result", wait_s, on_other=on_event)
        finally:
            bar.close()
            load = cpuload.load(cpu0, cpuload.snapshot(mine))
            daemon_cpu = cpuload.processes_cpu_s(daemons) - d0
        g.wait()
    for rec in records:
        rec["params"] = ready[0].get("params")
        rec["width"] = ready[0].get("width")
        rec.update(load)  # the machine's, over the whole alternated run
        runs = [r["runs"][rec["backend"]] for r in results]
        summarize(rec, runs, daemon_cpu if TABLE[rec["backend"]].is_dlcp else None)
        step_bound(rec, runs)


def step_bound(rec: dict[str, Any], runs: Sequence[dict[str, Any]]) -> None:
    """Whether this backend's own steps were CPU-bound: the machine's idle
    share within them (the first rank's readings around each of its steps),
    not over the alternated run, whose idle share is every backend's at once
    (dlcp's steps saturating the cores while Gloo's left them idle read as
    one figure for both). The run's wait share still counts."""
    spans = [r["machine_s"] for r in runs if r.get("machine_s")]
    if not spans:
        return
    busy, idle = (float(v) for v in spans[0])
    rec["run_idle_frac"] = rec.get("idle_frac")
    rec.update(cpuload.window_bound(busy, idle))
    wait = float(rec.get("runq_wait_frac") or 0.0)
    rec["cpu_bound"] = cpuload.bound(rec["step_idle_frac"], wait)


def summarize(
    rec: dict[str, Any], runs: Sequence[dict[str, Any]], daemon_cpu: float | None
) -> None:
    """Fill `rec` from the ranks' runs of its backend: a step takes as long as
    its slowest rank; dlcp's CPU includes its daemons' (idle in Gloo's steps)."""
    per_rank = [[float(t) for t in r.get("step_times_s") or []] for r in runs]
    n = min((len(t) for t in per_rank), default=0)
    steps = [max(t[i] for t in per_rank) for i in range(n)]
    stats = [r.get("stats") or {} for r in runs]
    rec["step_times_s"] = steps
    rec["p50_s"] = percentile(steps, 50) if steps else None
    rec["p99_s"] = percentile(steps, 99) if steps else None
    rec["mean_s"] = sum(steps) / len(steps) if steps else None
    rec["first_step_s"] = max(float(s.get("first_step_s") or 0.0) for s in stats)
    rec["cpu_s"] = sum(float(r.get("cpu_s", 0.0)) for r in runs) + (daemon_cpu or 0.0)
    if daemon_cpu is None:
        return
    rec["daemon_cpu_s"] = daemon_cpu
    lost = sum(int(s.get("lost_lanes", 0)) for s in stats)
    total = sum(int(s.get("total_lanes", 0)) for s in stats)
    rec["loss_frac"] = lost / total if total else 0.0
    rec["fallbacks"] = sum(int(s.get("fallbacks", 0)) for s in stats)
    rec["dlcp_rounds"] = sum(int(s.get("rounds", 0)) for s in stats)
    rec["segment_grows"] = sum(int(s.get("segment_grows", 0)) for s in stats)
    rec["first_segment_grows"] = sum(int(s.get("first_segment_grows") or 0) for s in stats)
    # per rank: the shim's timeline (medians per phase, dlcp.shim.timeline), the
    # first step's, and the step cut at its buckets (forward and backward to the
    # first bucket, the buckets, the rest); per host the daemon's counters; per
    # rank the agreements' count, seconds and stalls (dlcp.shim.hedge)
    keys = ("timeline", "first_timeline", "spans", "first_spans", "daemon_counters", "agreements")
    for key in keys:
        rec[key] = [s.get(key) for s in stats]
    errors = [s.get("last_error") for s in stats if s.get("last_error")]
    if errors:
        rec["dlcp_last_error"] = errors[0]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.1f}"


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """Step times per backend, dlcp's ratio to Gloo's, and dlcp's timeline."""
    if not records:
        return "(no results)"
    gloo = next((r for r in records if r["backend"] == "gloo" and r.get("p50_s")), None)
    from dlcp.bench.fair import versus

    lines = [
        f"{'backend':<14} {'codec':<8} {'p50 ms':>8} {'p99 ms':>8} {'first ms':>9} "
        f"{'cpu s':>7} {'bound':>5} {'/gloo':>6}  /baseline"
    ]
    for r in records:
        if r.get("error"):
            why = str(r["error"]).splitlines()[0]
            lines.append(f"{r['backend']:<14} {r['codec']:<8} FAILED: {why}")
            continue
        ratio = "-"
        if gloo is not None and r.get("p50_s"):
            ratio = f"{r['p50_s'] / gloo['p50_s']:.2f}x"
        cpu = "-" if r.get("cpu_s") is None else f"{r['cpu_s']:.1f}"
        lines.append(
            f"{r['backend']:<14} {r['codec']:<8} {_ms(r.get('p50_s')):>8} "
            f"{_ms(r.get('p99_s')):>8} {_ms(r.get('first_step_s')):>9} {cpu:>7} "
            f"{cpuload.mark(r):>5} {ratio:>6}  {versus(r, records)}"
        )
    for r in records:
        for rank, tl in enumerate(r.get("timeline") or []):
            if not tl:
                continue
            phases = ", ".join(f"{k} {_ms(v)}" for k, v in tl["phases"].items())
            step = ", ".join(
                f"{k} {v:.0f}" if k == "in_flight" and v is not None else f"{k} {_ms(v)}"
                for k, v in tl["step"].items()
            )
            lines.append(f"dlcp rank {rank} bucket medians ms: {phases}")
            lines.append(f"dlcp rank {rank} step medians ms: {step}")
            spans = (r.get("spans") or [None] * (rank + 1))[rank]
            if spans:
                cut = ", ".join(f"{k} {_ms(v)}" for k, v in spans.items())
                lines.append(f"dlcp rank {rank} step cut at its buckets, ms: {cut}")
    first = records[0]
    lines.append(
        f"({first['hosts']} ranks, {format_rate(first.get('rate_bps'))} links, "
        f"{format_bytes(first['grad_bytes'])} of gradients in {first['layers']} layers, "
        f"DDP buckets of {first['bucket_mb']:g} MB, {first['steps']} steps; /gloo = this "
        "step p50 over Gloo's: <= 1 is as fast; /baseline = dlcp's over the fastest "
        "baseline whose codec is no less precise (significant bits on the wire); bound: cpu = the "
        "run was CPU-bound)"
    )
    lines += cpuload.baseline_notes(records, lambda r: r["scenario"])
    return "\n".join(lines)


def save(records: Sequence[dict[str, Any]], path: Path | str) -> None:
    from dlcp.bench.common import write_json

    write_json(path, records, DDP_KEYS)
