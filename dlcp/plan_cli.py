"""`dlcp plan`: predicted iteration time per codec for a model, link and cluster.

    dlcp plan --model digits-mlp --link 200mbit --hosts 3
    dlcp plan --model spec.json --link 1gbit --link none --hosts 8 --json

The model is `digits-mlp` (measured on this host now) or a JSON spec (file or
inline; see `dlcp.costmodel.profile`). Codec costs come from the calibration
cache, made on first use (`--recalibrate` to redo it).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dlcp.errors import LocalError

__all__ = ["register", "run"]

DIGITS = "digits-mlp"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="predict the iteration time of each codec (cost model)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=DIGITS, help="digits-mlp, a JSON spec file or inline JSON")
    p.add_argument(
        "--link",
        action="append",
        default=None,
        help="link rate per host: 200mbit, 1gbit, none (unthrottled); repeatable",
    )
    p.add_argument("--hosts", type=int, default=3, help="hosts in the job (default 3)")
    p.add_argument(
        "--codecs",
        default=None,
        help="codec specs separated by ';' (default fp32;fp16;thc8;thc4;fft;sketch)",
    )
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket cap (digits-mlp)")
    p.add_argument("--batch", type=int, default=32, help="batch per rank (digits-mlp)")
    p.add_argument("--cpu-share", type=float, default=1.0, help="share of a core per host")
    p.add_argument(
        "--sharing",
        type=int,
        default=None,
        help="processes running codec steps at once on this machine's cores (emulated "
        "hosts, daemons): sets --cpu-share to cores / N (dlcp.costmodel.model.cpu_share_for)",
    )
    p.add_argument(
        "--jitter-ms", type=float, default=0.0, help="hosts' compute jitter (straggler waits)"
    )
    p.add_argument(
        "--exit-skew-ms",
        type=float,
        default=0.0,
        help="how much later than the median host the last leaves an exchange (hosts "
        "contending for cores; each exchange waits for it)",
    )
    p.add_argument("--calibration", default=None, help="calibration JSON file (cache)")
    p.add_argument("--recalibrate", action="store_true", help="time the codecs again")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _calibration(args: argparse.Namespace, specs: list[str]) -> Any:
    from dlcp.costmodel.calibrate import Calibration, calibrate, default_cache

    path = args.calibration or default_cache(args.hosts)
    cal = None
    if not args.recalibrate:
        try:
            cal = Calibration.load(path)
        except LocalError:
            cal = None
    missing = [s for s in specs if cal is None or s not in cal.codecs]
    if missing:
        print(f"dlcp plan: calibrating {', '.join(missing)} on this host ...", file=sys.stderr)
        fresh = calibrate(missing, hosts=args.hosts)
        if cal is None:
            cal = fresh
        else:
            cal.codecs.update(fresh.codecs)
        cal.save(path)
    return cal


def run(args: argparse.Namespace) -> int:
    from dlcp.costmodel.calibrate import DEFAULT_CODECS
    from dlcp.costmodel.model import Network, choose_codec, format_rate, parse_link, predict_all
    from dlcp.costmodel.profile import load_profile

    if args.hosts < 1:
        raise LocalError(f"--hosts must be >= 1, got {args.hosts}")
    for name in ("jitter_ms", "exit_skew_ms"):
        value = getattr(args, name)
        if not value >= 0:  # NaN too
            raise LocalError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    links = [parse_link(x) for x in (args.link or ["1gbit"])]
    specs = [s.strip() for s in (args.codecs or ";".join(DEFAULT_CODECS)).split(";") if s.strip()]
    if args.model == DIGITS:
        from dlcp.costmodel.digits import digits_profile

        profile = digits_profile(bucket_mb=args.bucket_mb, batch=args.batch)
    else:
        profile = load_profile(args.model)
    cal = _calibration(args, specs)
    out: list[dict[str, Any]] = []
    if args.sharing is not None:
        from dlcp.costmodel.model import cpu_share_for

        args.cpu_share = cpu_share_for(args.sharing)
    for bps in links:
        net = Network.from_rate(bps)
        preds = predict_all(
            profile,
            cal,
            net,
            args.hosts,
            specs=specs,
            cpu_share=args.cpu_share,
            jitter_s=args.jitter_ms / 1e3,
            exit_skew_s=args.exit_skew_ms / 1e3,
        )
        auto = choose_codec(
            profile,
            bps,
            hosts=args.hosts,
            calibration=cal,
            candidates=specs,
            cpu_share=args.cpu_share,
            jitter_s=args.jitter_ms / 1e3,
            exit_skew_s=args.exit_skew_ms / 1e3,
        )
        base = next((p.iteration_s for p in preds if p.codec == "fp32"), None)
        out.append(
            {
                "link": format_rate(bps),
                "hosts": args.hosts,
                "model": profile.name,
                "compute_s": profile.compute_s,
                "auto": auto,
                "codecs": [
                    {
                        "codec": p.codec,
                        "iteration_s": p.iteration_s,
                        "speedup_vs_fp32": (base / p.iteration_s) if base else None,
                        "codec_cpu_s": p.encode_s,
                        "network_s": p.network_s,
                        "wire_bytes": p.wire_bytes,
                        "ratio": cal[p.codec].ratio,
                        "rel_error": p.rel_error,
                    }
                    for p in preds
                ],
            }
        )
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    mb = profile.numel * 4 / 1e6
    print(
        f"{profile.name}: {profile.numel:,} values ({mb:.1f} MB fp32) in {len(profile.buckets)} "
        f"buckets, compute {profile.compute_s * 1e3:.1f} ms/iteration, {args.hosts} hosts"
    )
    for block in out:
        print(f"\nlink {block['link']}  (auto -> {block['auto']})")
        print(
            f"  {'codec':<18}{'iteration':>11}{'vs fp32':>9}{'codec cpu':>11}{'network':>10}"
            f"{'MB/host':>9}{'ratio':>7}{'error':>8}"
        )
        for c in block["codecs"]:
            speed = f"{c['speedup_vs_fp32']:.2f}x" if c["speedup_vs_fp32"] else "-"
            print(
                f"  {c['codec']:<18}{c['iteration_s'] * 1e3:9.1f}ms{speed:>9}"
                f"{c['codec_cpu_s'] * 1e3:9.1f}ms{c['network_s'] * 1e3:8.1f}ms"
                f"{c['wire_bytes'] / 1e6:9.2f}{c['ratio']:7.2f}{c['rel_error']:8.3f}"
            )
    return 0
