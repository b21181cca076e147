"""Every metric dashboards/dlcp.json queries exists on a daemon of a one-path
setup: its PromQL expressions are parsed for `dlcp_...` names and a real
daemon's scrape, after a round, must hold each (the histogram's _bucket,
_sum and _count as the dashboard names them)."""

from __future__ import annotations

import json
import os
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tests.daemons import ROOT, Rank, hosts_of, loopback_daemons, submit

DASHBOARD = ROOT / "dashboards" / "dlcp.json"
# the daemon exports the tc class stats of the devices in its [tc] devices,
# and a daemon of loopback daemons manages none: these come from a testbed
# host whose daemon is given its tc device (tests/test_tc_netns.py)
TC_METRICS = re.compile(r"^dlcp_tc_")


def _exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "expr" and isinstance(v, str):
                yield v
            else:
                yield from _exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _exprs(v)


def dashboard_metrics(path: Path = DASHBOARD) -> set[str]:
    """The `dlcp_` metric names the dashboard's queries read."""
    exprs = list(_exprs(json.loads(path.read_text())))
    assert exprs, f"no PromQL expressions found in {path}"
    # a metric name: not a label (followed by =, !=, =~) nor a function
    return {m for e in exprs for m in re.findall(r"\b(dlcp_[a-z0-9_]+)\b(?!\s*[=!~])", e)}


def scraped_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] not in "#"}


def test_the_dashboard_queries_names_of_every_kind() -> None:
    names = dashboard_metrics()
    # the parse finds the panels' metrics, the path panels' among them
    assert {"dlcp_path_state", "dlcp_path_probe_rtt_seconds", "dlcp_rounds_total"} <= names
    assert "dlcp_round_duration_seconds_bucket" in names
    assert not {n for n in names if n.endswith("_")}


def test_a_one_path_daemon_exports_every_metric_the_dashboard_queries(tmp_path: Path) -> None:
    want = dashboard_metrics()
    with loopback_daemons(tmp_path, 2, {"timing": {"timeout": 5.0}}, paths=1) as ds:
        ranks = [Rank(d, f"dlcp-dash{os.getpid()}-{i}", 4 << 20) for i, d in enumerate(ds)]
        try:
            for i, r in enumerate(ranks):
                r.join(77, bytes(range(32)), hosts_of(ds), i)
            xs = [np.full(20_000, i + 1, np.float32) for i in range(2)]
            waits = [submit(r, job=77, round=0, bucket=0, lanes=x, shards=2)
                     for r, x in zip(ranks, xs, strict=True)]  # fmt: skip
            for w in waits:
                assert np.array_equal(w().sums, xs[0] + xs[1])
            for d in ds:
                url = f"http://127.0.0.1:{d.metrics_port}/metrics"
                text = urllib.request.urlopen(url, timeout=10).read().decode()
                missing = {n for n in want - scraped_names(text) if not TC_METRICS.match(n)}
                assert not missing, f"daemon {d.index} does not export {sorted(missing)}"
                # the one path towards the peer: a state (up) and a probe round trip (NaN)
                peer = re.search(
                    r'dlcp_path_state\{path="0",peer="([^"]+)",state="up"\} 1\.0', text
                )
                assert peer is not None, text
                assert f'dlcp_path_probe_rtt_seconds{{path="0",peer="{peer.group(1)}"}} NaN' in text
        finally:
            for r in ranks:
                r.close()
