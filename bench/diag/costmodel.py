"""The cost model's predicted iteration time against measured iterations, per codec
and link rate.

    sudo python bench/diag/costmodel.py [--links 200mbit,1gbit,none] [--hosts 3]
        [--codecs "fp32;fp16;thc8;thc4;fft;sketch;sketch:keep=0.05"]
        [--rounds 3] [--iters 8] [--costs insitu|host] [--json costmodel.json]
        [--loopback] [--nice -10]

What is measured: `dlcp.costmodel.emulate` ranks (one per emulated host, in
the namespaces of `dlcp.testbed`, HTB-shaped switch ports) train the digits
MLP; their DDP-style buckets go through each codec's steps and a transpose
all-reduce over Gloo (all-to-all push, all-gather pull). That is an emulation
of dlcp's data path over TCP, not the dlcp daemon (so it can also run codecs
that have no wire codec, such as fft-sim). `--loopback` runs the ranks on
127.0.0.1 without a testbed (unthrottled only).

What is predicted, from inputs timed apart from the measured iterations, per
round (rounds interleave all runs, so load from other programs hits every
codec alike; each round is predicted from its own inputs):
  * network: bare all-to-all and all-gather of two sizes on the link (fixed
    time + bytes / goodput fit);
  * compute: forward, backward (bucket ready times) and step of the ranks
    training without communication, each iteration started by all ranks at
    once and timed as the slowest rank's (an exchange cannot start before the
    last rank's bucket is ready);
  * the ranks' skew leaving a collective: how much later than the median rank
    the last one leaves the in-step calibrations' barriers (the median over
    the round's calibrations); each exchange waits that much longer for the
    last rank (`predict`'s exit_skew_s);
  * codec costs: `dlcp.costmodel.calibrate`. `--costs insitu` (default): run by
    every rank at once, in step, just before the codec's run: each step starts
    on all ranks together and counts until the slowest is done (the median of
    `--cal-repeats` rounds), so the costs carry the machine's speed, other
    programs' load of that moment and the ranks' contention for the cores, as
    the exchange after a step waits for the last host; `--costs host`: once in
    this process, alone;
  * CPU contention of costs timed alone (`--costs host`): the emulated hosts
    run their codec steps at once on this machine's cores, so those steps are
    scaled by hosts / cores (`dlcp.costmodel.model.cpu_share_for`). In-situ
    costs carry it already (`CodecCost.together`), so they are not scaled.
The reported prediction and measurement are medians over rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dlcp.costmodel.calibrate import Calibration, CodecCost, Linear, calibrate  # noqa: E402
from dlcp.costmodel.model import (  # noqa: E402
    Network,
    cpu_share_for,
    format_rate,
    parse_link,
    predict,
)
from dlcp.costmodel.profile import Bucket, ModelProfile  # noqa: E402

DEFAULT_CODECS = "fp32;fp16;thc8;thc4;fft;sketch;sketch:keep=0.05"
PORT = 29571
Rows = list[dict[str, Any]]


def _worker_argv(rank: int, master: str, a: argparse.Namespace) -> list[str]:
    argv = [sys.executable, "-m", "dlcp.costmodel.emulate", "--rank", str(rank)]
    argv += ["--world", str(a.hosts), "--master", master, "--port", str(PORT)]
    argv += ["--codecs", a.codecs, "--iters", str(a.iters), "--warmup", str(a.warmup)]
    argv += ["--bucket-mb", str(a.bucket_mb), "--rounds", str(a.rounds)]
    argv += ["--cal-repeats", str(a.cal_repeats)]
    return argv + (["--calibrate"] if a.costs == "insitu" else [])


def _collect(procs: list[subprocess.Popen[str]], outs: list[Any], timeout: float) -> list[Rows]:
    """Wait for the ranks (their stdout goes to files, so no pipe fills up)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit("bench/diag/costmodel: ranks timed out") from None
    result: list[Rows] = []
    for p, (out, err) in zip(procs, outs, strict=True):
        out.seek(0)
        err.seek(0)
        if p.returncode != 0:
            raise SystemExit(
                f"bench/diag/costmodel: rank failed ({p.returncode}):\n{err.read()[-3000:]}"
            )
        result.append([json.loads(line) for line in out if line.startswith("{")])
    return result


def run_ranks(bps: float | None, a: argparse.Namespace) -> list[Rows]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with contextlib.ExitStack() as stack:
        outs = [
            (
                stack.enter_context(tempfile.TemporaryFile("w+")),
                stack.enter_context(tempfile.TemporaryFile("w+")),
            )
            for _ in range(a.hosts)
        ]
        if a.loopback:
            procs = [
                subprocess.Popen(
                    _worker_argv(r, "127.0.0.1", a), env=env, stdout=o, stderr=e, text=True
                )
                for r, (o, e) in enumerate(outs)
            ]
            return _collect(procs, outs, a.timeout)
        from dlcp.testbed.plan import TestbedSpec
        from dlcp.testbed.testbed import Testbed

        rate = None if bps is None else int(bps)
        with Testbed.up(TestbedSpec(hosts=a.hosts, rate_bps=rate, name="dlcpcm")) as tb:
            master = tb.address(0)
            procs = []
            for r, (o, e) in enumerate(outs):
                env_r = {**env, "GLOO_SOCKET_IFNAME": tb.host(r).interfaces[0]}
                argv = _worker_argv(r, master, a)
                procs.append(tb.popen(r, argv, env=env_r, stdout=o, stderr=e, text=True))
            return _collect(procs, outs, a.timeout)


def _rows(ranks: list[Rows], kind: str, rnd: int, codec: str | None = None) -> Rows:
    return [
        r
        for rows in ranks
        for r in rows
        if r["kind"] == kind and r["round"] == rnd and (codec is None or r.get("codec") == codec)
    ]


def _pooled(rows: Rows, key: str) -> float:
    """Median over every iteration of every rank."""
    return statistics.median(v for r in rows for v in r[key + "_all"])


def _network(rows: Rows, hosts: int, bps: float | None) -> Network:
    sizes = rows[0]["rows"]
    merged = [
        {
            "bytes": sizes[i]["bytes"],
            "push_s": statistics.median(r["rows"][i]["push_s"] for r in rows),
            "pull_s": statistics.median(r["rows"][i]["pull_s"] for r in rows),
        }
        for i in range(len(sizes))
    ]
    return Network.fit(merged, hosts, bps)


def _profile(rows: Rows) -> ModelProfile:
    fwd, bwd, step = (_pooled(rows, k) for k in ("forward_s", "backward_s", "step_s"))
    iters = [it for r in rows for it in r["ready_s"]]
    ready = [statistics.median(it[i] for it in iters) for i in range(len(iters[0]))]
    buckets = tuple(Bucket(n, min(t, bwd)) for n, t in zip(rows[0]["buckets"], ready, strict=True))
    return ModelProfile("digits-mlp", buckets, fwd, bwd, step)


def _jitter(rows: Rows) -> float:
    """Spread of the ranks' compute (forward + backward) per iteration, seconds: a
    robust standard deviation (1.4826 x the median absolute deviation)."""
    xs = [f + b for r in rows for f, b in zip(r["forward_s_all"], r["backward_s_all"], strict=True)]
    if len(xs) < 2:
        return 0.0
    mid = statistics.median(xs)
    return 1.4826 * statistics.median(abs(x - mid) for x in xs)


def _median_cost(costs: list[CodecCost]) -> CodecCost:
    """Field-wise median of the ranks' calibrations of one codec."""

    def med(get: Any) -> float:
        return statistics.median(get(c) for c in costs)

    def lin(name: str) -> Linear:
        return Linear(
            med(lambda c: getattr(c, name).fixed_s), med(lambda c: getattr(c, name).per_value_s)
        )

    first = costs[0]
    return CodecCost(
        spec=first.spec,
        push=first.push,
        pull=first.pull,
        encode=lin("encode"),
        aggregate=lin("aggregate"),
        decode=lin("decode"),
        rel_error=med(lambda c: c.rel_error),
        hosts=first.hosts,
        together=min(c.together for c in costs),
    )


def _timeline_only(
    profile: ModelProfile,
    cost: CodecCost,
    network: Network,
    hosts: int,
    share: float,
    measured_steps: dict[str, float],
) -> float:
    """The timeline fed with this run's own measured step totals (costs and network
    scaled to match them): what is left is the error of the timeline itself
    (overlap with backward, order of steps), not of the calibrated inputs."""
    base = predict(profile, cost, network, hosts, cpu_share=share).steps

    def f(step: str) -> float:
        return measured_steps[step] / base[step] if base[step] > 0 else 1.0

    scaled = replace(
        cost,
        encode=cost.encode.scaled(f("encode")),
        aggregate=cost.aggregate.scaled(f("aggregate")),
        decode=cost.decode.scaled(f("decode")),
    )
    net = Network(
        network.push_bytes_s / f("push"),
        network.pull_bytes_s / f("pull"),
        network.push_s * f("push"),
        network.pull_s * f("pull"),
        network.bps,
    )
    return predict(profile, scaled, net, hosts, cpu_share=share).iteration_s


def analyse(
    ranks: list[Rows],
    bps: float | None,
    specs: list[str],
    a: argparse.Namespace,
    host_cal: Calibration | None,
) -> list[dict[str, Any]]:
    # the emulated hosts encode, aggregate and decode at once on this machine's cores
    alone_share = a.cpu_share or cpu_share_for(a.hosts)
    results = []
    for spec in specs:
        per_round: list[dict[str, Any]] = []
        for rnd in range(a.rounds):
            rows = _rows(ranks, "codec", rnd, spec)
            if not rows:
                continue
            network = _network(_rows(ranks, "netcal", rnd), a.hosts, bps)
            compute = _rows(ranks, "compute", rnd)
            # the last rank's readiness where measured (runs before that: the median rank's)
            profile = _profile(_rows(ranks, "compute_in_step", rnd) or compute)
            jitter = a.jitter if a.jitter is not None else _jitter(compute)
            # how far the ranks leave a collective out of step (in-step calibrations)
            skews = [
                r["exit_skew_s"] for r in _rows(ranks, "calibration", rnd) if "exit_skew_s" in r
            ]
            exit_skew = statistics.median(skews) if skews and not a.no_exit_skew else 0.0
            if host_cal is not None:
                cost = host_cal[spec]
            else:
                cals = _rows(ranks, "calibration", rnd, spec)
                cost = _median_cost([CodecCost.from_json(r["cost"]) for r in cals])
            # costs timed by all hosts at once carry their contention already
            share = 1.0 if cost.together >= a.hosts and not a.cpu_share else alone_share
            pred = predict(
                profile,
                cost,
                network,
                a.hosts,
                cpu_share=share,
                jitter_s=jitter,
                exit_skew_s=exit_skew,
            )
            measured_steps = {k: statistics.median(r["steps"][k] for r in rows) for k in pred.steps}
            per_round.append(
                {
                    "round": rnd,
                    "predicted_s": pred.iteration_s,
                    "measured_s": _pooled(rows, "iteration_s"),
                    "predicted_steps": pred.steps,
                    "measured_steps": measured_steps,
                    "timeline_only_s": _timeline_only(
                        profile, cost, network, a.hosts, share, measured_steps
                    ),
                    "compute_s": profile.compute_s,
                    "cpu_share": share,
                    "jitter_s": jitter,
                    "exit_skew_s": exit_skew,
                    "network": {
                        "push_bytes_s": network.push_bytes_s,
                        "pull_bytes_s": network.pull_bytes_s,
                        "push_s": network.push_s,
                        "pull_s": network.pull_s,
                    },
                    "wire_bytes": pred.wire_bytes,
                    "cost": cost.to_json(),
                    "iterations": [v for r in rows for v in r["iteration_s_all"]],
                }
            )
        if not per_round:
            continue
        predicted = statistics.median(r["predicted_s"] for r in per_round)
        measured = statistics.median(r["measured_s"] for r in per_round)
        timeline = statistics.median(r["timeline_only_s"] for r in per_round)
        results.append(
            {
                "link": format_rate(bps),
                "codec": spec,
                "hosts": a.hosts,
                "costs": a.costs,
                "cpu_share": statistics.median(r["cpu_share"] for r in per_round),
                "predicted_s": predicted,
                "measured_s": measured,
                "error": predicted / measured - 1.0,
                "timeline_only_error": timeline / measured - 1.0,
                "round_errors": [r["predicted_s"] / r["measured_s"] - 1.0 for r in per_round],
                "rounds": per_round,
            }
        )
    return results


def _report(results: list[dict[str, Any]]) -> None:
    print(
        f"{'link':>8} {'codec':>18} {'predicted':>10} {'measured':>10} {'error':>7} "
        f"{'timeline':>9}  rounds"
    )
    for r in results:
        rounds = " ".join(f"{e * 100:+.0f}%" for e in r["round_errors"])
        print(
            f"{r['link']:>8} {r['codec']:>18} {r['predicted_s'] * 1e3:8.1f}ms "
            f"{r['measured_s'] * 1e3:8.1f}ms {r['error'] * 100:+6.1f}% "
            f"{r['timeline_only_error'] * 100:+8.1f}%  {rounds}"
        )
    print("\nper iteration, predicted / measured ms (median round):")
    for r in results:
        mid = sorted(r["rounds"], key=lambda x: x["measured_s"])[len(r["rounds"]) // 2]
        cells = "  ".join(
            f"{k} {mid['predicted_steps'][k] * 1e3:.1f}/{mid['measured_steps'][k] * 1e3:.1f}"
            for k in mid["predicted_steps"]
        )
        print(f"{r['link']:>8} {r['codec']:>18}  {cells}")
    within = sum(abs(r["error"]) <= 0.2 for r in results)
    print(f"\n{within}/{len(results)} within 20 % (load average {os.getloadavg()[0]:.1f})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--links", default="200mbit,1gbit,none")
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--codecs", default=DEFAULT_CODECS, help="codec specs separated by ';'")
    p.add_argument("--rounds", type=int, default=3, help="interleaved cycles through the codecs")
    p.add_argument("--iters", type=int, default=8, help="iterations per codec and round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--costs", choices=("insitu", "host"), default="insitu")
    p.add_argument("--cal-repeats", type=int, default=5, help="in-situ calibration rounds")
    p.add_argument("--cpu-share", type=float, default=None, help="override the CPU share")
    p.add_argument(
        "--jitter",
        type=float,
        default=None,
        help="hosts' compute jitter in seconds (default: measured in the compute runs)",
    )
    p.add_argument(
        "--no-exit-skew",
        action="store_true",
        help="leave out the ranks' measured skew leaving a collective (see predict)",
    )
    p.add_argument("--reanalyse", default=None, help="predict again from a --json file's raw data")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--loopback", action="store_true", help="no testbed: 127.0.0.1, unthrottled")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="niceness increment for this run and its ranks (negative needs root)",
    )
    a = p.parse_args()
    if a.nice:
        os.nice(a.nice)
    specs = [s.strip() for s in a.codecs.split(";") if s.strip()]
    host_cal = None
    raw: dict[str, list[Rows]] = {}
    loads: list[float] = []
    if a.reanalyse:
        old = json.loads(Path(a.reanalyse).read_text())
        raw, loads = old["raw"], old["load_avg_after_each_link"]
        for key in ("hosts", "costs", "rounds"):
            setattr(a, key, old[key])
        specs = old["codecs"]
        if old["host_calibration"]:
            host_cal = Calibration.from_json(old["host_calibration"])
    elif a.costs == "host":
        print(f"calibrating {len(specs)} codecs in this process ...", file=sys.stderr)
        host_cal = calibrate(specs, hosts=a.hosts)
    if not a.reanalyse:
        links = [None] if a.loopback else [parse_link(x) for x in a.links.split(",")]
        for bps in links:
            print(f"link {format_rate(bps)}: {a.hosts} ranks ...", file=sys.stderr)
            t = time.monotonic()
            raw[format_rate(bps)] = run_ranks(bps, a)
            loads.append(os.getloadavg()[0])
            print(f"  done in {time.monotonic() - t:.0f} s", file=sys.stderr)
    results: list[dict[str, Any]] = []
    for link, ranks in raw.items():
        results += analyse(ranks, parse_link(link), specs, a, host_cal)
    _report(results)
    if a.json:
        doc = {
            "hosts": a.hosts,
            "costs": a.costs,
            "rounds": a.rounds,
            "codecs": specs,
            "nice": a.nice,
            "cpus": os.cpu_count(),
            "load_avg_after_each_link": loads,
            "host_calibration": host_cal.to_json() if host_cal else None,
            "results": results,
            "raw": raw,
        }
        Path(a.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
