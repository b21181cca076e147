"""`dlcp bench report`: the issues' targets and the per-codec table from
benchmark JSON, and a `dlcp bench all` directory's plots and summary redrawn."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from dlcp.bench.common import BenchError

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    """`dlcp bench report PATH...`: the targets' tables and the per-codec table."""
    from dlcp.bench import scorecard
    from dlcp.bench.codec_table import markdown_codecs

    paths: list[Path] = args.paths
    for path in paths:
        if not path.exists():
            raise BenchError(f"{path}: no such file or directory")
        if path.is_dir() and _is_suite(path):
            _redraw_suite(path)
    try:
        invocations = scorecard.load(paths)
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot read the records: {exc}") from None
    if not invocations:
        raise BenchError(f"no benchmark records in {', '.join(map(str, paths))}")
    print(scorecard.markdown(invocations))
    codecs = markdown_codecs(invocations)
    if codecs:
        print(f"\nCodecs against the fastest no-worse baseline and the cost model:\n\n{codecs}")
    return 0


def _is_suite(path: Path) -> bool:
    """A `dlcp bench all` directory: allreduce-<rate>.json or train.json."""
    rated = re.compile(r"allreduce-(none|[0-9.]+[kmgt]?bit)\.json")
    return (path / "train.json").exists() or any(rated.fullmatch(f.name) for f in path.iterdir())


def _redraw_suite(out: Path) -> None:
    """Plots and summary.md of a `dlcp bench all` directory, drawn anew."""
    from dlcp.bench.common import format_rate
    from dlcp.bench.plots import plot_latency_cdf, plot_tta
    from dlcp.bench.suite import load_dir, summary

    ar, tr = load_dir(out)
    rates = sorted({r.get("rate_bps") or 0 for r in ar})
    for rate in rates:
        recs = [r for r in ar if (r.get("rate_bps") or 0) == rate]
        plot_latency_cdf(recs, out / f"latency-{format_rate(rate or None)}.png")
    if tr:
        plot_tta(tr, out / "tta.png")
    (out / "summary.md").write_text(summary(out))
    print(f"dlcp bench: wrote {out / 'summary.md'}")
