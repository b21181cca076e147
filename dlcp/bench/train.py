"""`dlcp bench train`: time-to-accuracy of a real model with dlcp and with Gloo.

Three (or `hosts`) training ranks, one per emulated host, train the same
model from the same seed (`--model`, `dlcp.bench.workloads`: the MLP or a CNN
on scikit-learn's digits, a byte-level transformer on the stdlib's sources;
`dlcp.bench.train_worker`): with
Gloo (DDP's default all-reduce), with Gloo marked into the top class
(gloo-prio), and through dlcp's shim and real daemons. The model is sized and
the links slowed so that the network, not the CPU, sets the pace.

TTA is the training time (from the first step, after a warm-up step) at which
the test accuracy, evaluated every few steps on rank 0, first reaches
`target_acc` (gpt: the validation loss first falls to it). Every backend
trains the same number of steps, so final accuracies are comparable. With
`overlap` the dlcp backends (not dlcp-nooverlap) run the optimizer through
`dlcp.overlap`: updates layer by layer in the next forward pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlcp.bench import cpuload
from dlcp.bench.backends import POWERSGD_RANK, TABLE, gloo_ifnames
from dlcp.bench.cluster import CONTROL_DSCP, GLOO_PRIO_DSCP, Cluster, Setup, cut_steps
from dlcp.bench.common import (
    CODECS,
    TRAIN_KEYS,
    BenchError,
    check_backends,
    format_rate,
    percentile,
    tta_from_curve,
)
from dlcp.bench.common import say as default_say
from dlcp.bench.procs import (
    STALL_S,
    RunBound,
    RunStopped,
    WorkerGroup,
    WorkerTimeout,
    worker_argv,
    worker_env,
)
from dlcp.bench.workloads import MODELS

__all__ = ["TrainOptions", "format_table", "run_train", "save"]

Say = Callable[[str], None]

_ports = iter(range(30700, 31700))


@dataclass(frozen=True)
class TrainOptions:
    setup: Setup
    # the model's target (dlcp.bench.workloads): test accuracy, or for gpt the
    # validation loss; None: the model's default
    target_acc: float | None = None
    codec: str = "fp32"
    backends: Sequence[str] = ("dlcp", "gloo", "gloo-prio")
    steps: int = 80
    batch: int | None = None  # per rank; None: the model's (32, gpt 4)
    lr: float | None = None  # None: the model's
    model: str = "mlp"  # mlp, cnn, gpt (dlcp.bench.workloads)
    overlap: bool = False  # the dlcp backends' optimizer through dlcp.overlap
    # FSDP2 (fully_shard) instead of DDP: dlcp as the process group's backend
    # (dlcp.shim.backend), Gloo's own for the gloo backends
    fsdp: bool = False
    # 5 x 512: 1.09M parameters, no weight above 1.05 MB, so no DDP bucket
    # has shards of more than ~250 packets (see BENCHMARKS.md, known issues)
    hidden: Sequence[int] = (512, 512, 512, 512, 512)
    seed: int = 0
    eval_every: int = 5
    bucket_mb: float = 1.0  # DDP bucket_cap_mb, the same for every backend
    bound: float = 0.05
    # DSCP of the dlcp backend's process-group traffic (rendezvous and the
    # shim's per-step agreement): dlcp's control class, or None to leave it
    # unmarked.
    control_dscp: str | None = CONTROL_DSCP
    round_timeout_s: float = 60.0
    stall_s: float = STALL_S  # stopped when its workers report nothing this long
    # Stop a backend's training after this many seconds (None: run every step);
    # its curve so far is kept, and a target it has not reached is reported as
    # "not within the budget" (TTA > budget).
    time_budget_s: float | None = None
    progress: bool = True
    predict: bool = True  # the cost model's step time in each record (dlcp.bench.predict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.codec not in (*CODECS, "auto"):
            raise BenchError(f"unknown codec {self.codec!r}; valid: {', '.join(CODECS)}, auto")
        if self.fsdp and self.overlap:
            raise BenchError("--fsdp trains without DDP: --overlap is DDP's (dlcp.overlap)")
        if self.fsdp and self.setup.mode != "transpose":
            raise BenchError(f"--fsdp runs dlcp's backend in mode transpose, not {self.setup.mode}")
        if self.model not in MODELS:
            raise BenchError(f"unknown model {self.model!r}; valid: {', '.join(MODELS)}")
        if self.metric == "acc" and not 0 < self.target <= 1:
            raise BenchError(f"--target must be an accuracy in (0, 1], not {self.target}")
        if not self.target > 0:
            raise BenchError(f"--target must be > 0, not {self.target}")
        if self.steps < 1 or self.per_rank_batch < 1 or self.eval_every < 1:
            raise BenchError("--steps, --batch and --eval-every must be >= 1")
        if not 0 <= self.bound <= 0.5:
            raise BenchError(f"--loss-bound must be in 0..0.5, not {self.bound}")
        if not self.hidden:
            raise BenchError("--hidden needs at least one layer width")
        check_backends(self.backends, "train")


    @property
    def target(self) -> float:
        return MODELS[self.model].target if self.target_acc is None else float(self.target_acc)

    @property
    def metric(self) -> str:
        """What the target is of: "acc" (test accuracy) or "val_loss"."""
        return MODELS[self.model].metric

    @property
    def per_rank_batch(self) -> int:
        return self.batch if self.batch is not None else (4 if self.model == "gpt" else 32)

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else MODELS[self.model].lr

    def overlaps(self, backend: str) -> bool:
        return self.overlap and backend.startswith("dlcp") and backend != "dlcp-nooverlap"


def time_to_target(opts: TrainOptions, acc: list[list[float]], loss: list[list[float]]) -> Any:
    """TTA: the first time the model's metric reaches its target (None: never)."""
    if opts.metric == "acc":
        return tta_from_curve(acc, opts.target)
    return next((float(t) for t, v in loss if v <= opts.target), None)


def _record(opts: TrainOptions, backend: str, codec: str) -> dict[str, Any]:
    s = opts.setup
    return {
        "backend": backend,
        "codec": codec,
        "scenario": s.scenario,
        "target_acc": opts.target,
        "model": opts.model,
        "metric": opts.metric,
        "overlap": opts.overlaps(backend),
        "fsdp": opts.fsdp,
        "tta_s": None,
        "final_acc": None,
        "steps": opts.steps,
        "curve": [],
        "cpu_bound": None,  # set from the run (dlcp.bench.cpuload); None: not measured
        "hosts": s.hosts,
        "rate_bps": s.rate_bps,
        "paths": s.n_paths,
        "loss_pct": s.loss_pct if s.scenario == "loss" else 0.0,
        **({"path_down": dataclasses.asdict(s.path_down)} if s.scenario == "pathdown" else {}),
        "mtu": s.mtu,
        "pacing": s.pacing,
        "batch_per_rank": opts.per_rank_batch,
        "hidden": list(opts.hidden),
        "seed": opts.seed,
        "bucket_mb": opts.bucket_mb,
        "gloo_ifnames": gloo_ifnames(s.n_paths),  # GLOO_SOCKET_IFNAME of the run
        **({"powersgd_rank": POWERSGD_RANK} if codec == "powersgd" else {}),
        **opts.extra,
    }


def run_backend(cluster: Cluster, opts: TrainOptions, backend: str, say: Say) -> dict[str, Any]:
    b = TABLE[backend]
    is_dlcp = b.is_dlcp
    codec = b.codec(opts.codec)
    rec = _record(opts, backend, codec)
    bound = 0.0 if backend == "dlcp-nobound" else opts.bound
    if is_dlcp:
        rec["loss_bound"] = bound
        rec["mode"] = opts.setup.mode
        if opts.setup.mode == "ps":
            rec.update(servers=opts.setup.servers, colocate=opts.setup.colocate)
        rec["control_dscp"] = opts.control_dscp
    tb = cluster.tb
    started = time.monotonic()
    try:
        if is_dlcp:
            cluster.start_dlcp(backend, timeout_s=opts.round_timeout_s)
            if opts.control_dscp:
                cluster.mark_tcp(opts.control_dscp)
        elif b.prio:
            cluster.mark_tcp(GLOO_PRIO_DSCP)
        port = next(_ports)
        argvs = [
            worker_argv(
                "dlcp.bench.train_worker",
                [
                    "--backend",
                    "dlcp" if is_dlcp else "gloo",
                    "--rank",
                    str(h.index),
                    "--world",
                    str(opts.setup.hosts),
                    "--master",
                    tb.address(0),
                    "--port",
                    str(port),
                    "--steps",
                    str(opts.steps),
                    "--batch",
                    str(opts.per_rank_batch),
                    "--lr",
                    str(opts.learning_rate),
                    "--model",
                    opts.model,
                    "--overlap",
                    "on" if opts.overlaps(backend) else "off",
                    *(["--fsdp"] if opts.fsdp else []),
                    "--hidden",
                    ",".join(map(str, opts.hidden)),
                    "--seed",
                    str(opts.seed),
                    "--eval-every",
                    str(opts.eval_every),
                    "--codec",
                    codec,
                    *(_mode_args(cluster) if is_dlcp else []),
                    "--bound",
                    str(bound),
                    "--timeout",
                    str(opts.round_timeout_s),
                    "--bucket-mb",
                    str(opts.bucket_mb),
                    *([] if is_dlcp else ["--hook", b.hook]),
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
        if is_dlcp:
            cluster.stop_dlcp()
        if cluster.log_dir is not None:
            cluster.save_logs(cluster.log_dir, backend)
        if is_dlcp or b.prio:
            cluster.mark_tcp(None)
    rec["run_wall_s"] = time.monotonic() - started
    return rec


def _mode_args(cluster: Cluster) -> list[str]:
    """The worker's dlcp mode, and in mode "ps" the servers' sockets (the
    testbed's hosts after the training hosts) and whether to co-locate."""
    s = cluster.setup
    if s.mode != "ps":
        return ["--mode", s.mode]
    sockets = ",".join(str(h.socket) for h in cluster.tb.hosts[s.hosts :])
    return ["--mode", "ps", "--servers", sockets, *(["--colocate"] if s.colocate else [])]


def _run_workers(
    cluster: Cluster,
    opts: TrainOptions,
    backend: str,
    argvs: list[list[str]],
    env: dict[str, str],
    rec: dict[str, Any],
    say: Say,
) -> None:
    from tqdm import tqdm

    label = f"train-{cluster.run_label(backend)}"
    bound = RunBound(opts.stall_s)  # the time budget is --budget's (keeping the curve)
    group = WorkerGroup(
        cluster.tb, argvs, log_dir=cluster.work_dir, label=label, env=env, bound=bound
    )
    with group as g, contextlib.ExitStack() as scenario:
        ready = g.expect("ready", 300.0)
        if opts.setup.scenario != "clean":
            say(f"{backend}: workers ready; applying scenario {opts.setup.scenario}")
        scenario.enter_context(cluster.disturbed())  # from here on, not during setup
        rec["params"] = ready[0].get("params")
        rec["acc0"] = ready[0].get("acc0")
        rec["loss0"] = ready[0].get("loss0")
        bar = tqdm(
            total=opts.steps,
            desc=f"{label:<26}",
            unit="step",
            file=sys.stderr,
            disable=not opts.progress,
            leave=True,
            dynamic_ncols=True,
        )
        # the curve starts at t = 0 with the untrained model's accuracy
        acc0 = ready[0].get("acc0")
        curve: list[list[float]] = [] if acc0 is None else [[0.0, float(acc0)]]
        loss0 = ready[0].get("loss0")
        loss_curve: list[list[float]] = [] if loss0 is None else [[0.0, float(loss0)]]
        seen = {"step": 0, "t": 0.0}
        step_ts: list[float] = []

        def on_event(rank: int, msg: dict[str, Any]) -> None:
            if msg.get("event") == "step":
                seen["step"], seen["t"] = int(msg.get("step", 0)), float(msg.get("t", 0.0))
                step_ts.append(seen["t"])
                bar.update(1)
                acc = curve[-1][1] if curve else float("nan")
                bar.set_postfix_str(f"acc {acc:.3f} t {seen['t']:.1f}s")
            elif msg.get("event") == "eval":
                curve.append([float(msg["t"]), float(msg["acc"])])
                loss_curve.append([float(msg["t"]), float(msg.get("loss", math.nan))])

        budget = opts.time_budget_s
        wait_s = 120.0 + opts.steps * opts.round_timeout_s
        results: list[dict[str, Any]] | None = None
        daemons = cluster.daemon_pids() if backend.startswith("dlcp") else []
        mine = g.pids() + daemons
        cpu0 = cpuload.snapshot(mine)
        d0 = cpuload.processes_cpu_s(daemons)
        try:
            g.send("go")
            results = g.expect_any(
                "result", wait_s if budget is None else min(budget, wait_s), on_other=on_event
            )
        except WorkerTimeout:
            if budget is None:
                raise
        finally:
            bar.close()
            rec.update(cpuload.load(cpu0, cpuload.snapshot(mine)))
            daemon_cpu = cpuload.processes_cpu_s(daemons) - d0
        if results is None:  # the time budget ran out: keep what was streamed
            g.kill()
            rec["budget_s"] = budget
            rec["stopped_at_step"] = seen["step"]
            rec["curve"] = curve
            rec["final_acc"] = curve[-1][1] if curve else None
            rec["loss_curve"] = loss_curve
            rec["tta_s"] = time_to_target(opts, curve, loss_curve)
            rec["wall_s"] = max(seen["t"], float(budget or 0.0))  # trained that long
            gaps = [b - a for a, b in zip([0.0, *step_ts], step_ts, strict=False)]
            rec["step_p50_s"] = percentile(gaps, 50) if gaps else None
            return
        g.wait()
    r0 = results[0]
    start = [] if rec.get("acc0") is None else [[0.0, float(rec["acc0"])]]
    curve = start + [[float(t), float(acc)] for t, acc in r0["curve"]]
    rec["curve"] = curve
    rec["final_acc"] = r0.get("final_acc")
    loss0 = ready_loss(rec)
    start = [] if loss0 is None else [[0.0, loss0]]
    rec["loss_curve"] = start + [[float(t), float(v)] for t, v in r0.get("loss_curve") or []]
    rec["final_loss"] = r0.get("final_loss")
    rec["tta_s"] = time_to_target(opts, curve, rec["loss_curve"])
    rec["wall_s"] = r0.get("wall_s")
    steps_t = r0.get("step_times_s") or []
    rec["step_p50_s"] = percentile(steps_t, 50) if steps_t else None
    rec["step_max_s"] = max(steps_t) if steps_t else None
    rec["step_times_s"] = steps_t
    cut = cluster.cut
    if opts.setup.scenario == "pathdown" and cut is not None and cut.down_at is not None:
        starts = r0.get("step_starts_s") or []
        if len(starts) == len(steps_t):
            rec.update({f"cut_{k}": v for k, v in cut_steps(starts, steps_t, cut.down_at).items()})
    # the ranks' own, and for dlcp its daemons' as `dlcp bench allreduce` counts them
    rec["cpu_s"] = sum(float(r.get("cpu_s", 0.0)) for r in results) + daemon_cpu
    if backend.startswith("dlcp"):
        rec["daemon_cpu_s"] = daemon_cpu
        stats = [r.get("dlcp") or {} for r in results]
        lost = sum(int(s.get("lost_lanes", 0)) for s in stats)
        total = sum(int(s.get("total_lanes", 0)) for s in stats)
        rec["loss_frac"] = lost / total if total else 0.0
        rec["fallbacks"] = sum(int(s.get("fallbacks", 0)) for s in stats)
        rec["dlcp_rounds"] = sum(int(s.get("rounds", 0)) for s in stats)
        # per rank: the agreements' count, seconds and stalls (dlcp.shim.hedge)
        rec["agreements"] = [s.get("agreements") for s in stats]
        auto = stats[0].get("auto")
        if auto:  # what codec="auto" chose (the same on every rank)
            rec["auto_codec"] = auto.get("chosen")
            rec["auto"] = auto
        errors = [s.get("last_error") for s in stats if s.get("last_error")]
        if errors:
            rec["dlcp_last_error"] = errors[0]


def ready_loss(rec: dict[str, Any]) -> float | None:
    return None if rec.get("loss0") is None else float(rec["loss0"])


def run_train(
    opts: TrainOptions, say: Say | None = None, *, log_dir: Path | None = None
) -> list[dict[str, Any]]:
    say = say or default_say
    records = []
    with Cluster(opts.setup, progress=say) as cluster:
        cluster.log_dir = log_dir
        for backend in opts.backends:
            records.append(run_backend(cluster, opts, backend, say))
    # after the runs: the MLP (the model the cost model knows) timed alone, the codecs
    # from the cache
    if opts.predict and opts.model == "mlp":
        from dlcp.bench.predict import annotate, train_profile

        profile = functools.partial(
            train_profile, opts.hidden, opts.bucket_mb, opts.per_rank_batch
        )
        annotate(records, profile, kind="train", say=say)
    return records


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """A human table of train records with TTA ratios to Gloo and gloo-prio."""
    if not records:
        return "(no results)"
    by: dict[tuple[str, float], dict[str, dict[str, Any]]] = {}
    for r in records:
        by.setdefault((r["scenario"], r.get("loss_pct", 0.0)), {})[r["backend"]] = r
    from dlcp.bench.fair import versus

    lines = [
        f"{'scenario':<14} {'backend':<18} {'codec':<8} {'TTA s':>7} {'final':>6} "
        f"{'step p50':>8} {'wall s':>7} {'bound':>5} {'lost':>6} {'gloo/TTA':>8} "
        f"{'prio/TTA':>8}  TTA/baseline"
    ]
    for r in records:
        scen = r["scenario"] + (f" {r['loss_pct']:g}%" if r.get("loss_pct") else "")
        if r.get("error"):
            why = str(r["error"]).splitlines()[0]
            lines.append(f"{scen:<14} {r['backend']:<18} {r['codec']:<8} FAILED: {why}")
            continue
        peers = by[(r["scenario"], r.get("loss_pct", 0.0))]

        def speedup(name: str, r: dict[str, Any] = r, peers: dict[str, Any] = peers) -> str:
            from dlcp.bench.report import tta_speedup

            value, bound = tta_speedup(peers.get(name), r)
            return "-" if value is None else f"{'>' if bound else ''}{value:.2f}x"

        tta = "-" if r.get("tta_s") is None else f"{r['tta_s']:.1f}"
        if r.get("tta_s") is None and r.get("wall_s"):
            tta = f">{r['wall_s']:.0f}"
        final = "-" if r.get("final_acc") is None else f"{100 * r['final_acc']:.1f}"
        step = "-" if r.get("step_p50_s") is None else f"{r['step_p50_s']:.3f}"
        wall = "-" if r.get("wall_s") is None else f"{r['wall_s']:.1f}"
        lost = f"{100 * r.get('loss_frac', 0.0):5.2f}%"
        lines.append(
            f"{scen:<14} {r['backend']:<18} {r['codec']:<8} {tta:>7} {final:>6} {step:>8} "
            f"{wall:>7} {cpuload.mark(r):>5} {lost:>6} {speedup('gloo'):>8} "
            f"{speedup('gloo-prio'):>8}  {versus(r, records)}"
        )
    first = records[0]
    target = (
        f"target validation loss {first['target_acc']:g}"
        if first.get("metric") == "val_loss"
        else f"target accuracy {100 * first['target_acc']:g} %"
    )
    lines.append(
        f"({first.get('model', 'mlp')}, {first['hosts']} ranks, "
        f"{format_rate(first.get('rate_bps'))} links, {target}, {first['steps']} steps; "
        "gloo/TTA = Gloo's TTA over this backend's: > 1 is faster than Gloo; "
        "TTA/baseline = dlcp's TTA over the fastest baseline's whose final accuracy is "
        "within 0.5 points: < 1 is faster; bound: cpu = the run was CPU-bound, net = it "
        "was not)"
    )
    lines += cpuload.baseline_notes(
        records, lambda r: r["scenario"] + (f" {r['loss_pct']:g}%" if r.get("loss_pct") else "")
    )
    return "\n".join(lines)


def save(records: Sequence[dict[str, Any]], path: Path | str) -> None:
    from dlcp.bench.common import write_json

    write_json(path, records, TRAIN_KEYS)
