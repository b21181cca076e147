"""A path that dies under real daemons, and comes back (root only).

Three hosts on two paths (a switch plane each); the daemons' default
balancer (spray) and path probes. Host 0's switch port on path 0 is set down
in the middle of a round, left down for several rounds and set up again.
What must hold: every round completes with the exact sums (loss bound 0:
nothing may be lost), the daemons take the path out of use (`dlcp status`
says down, and nothing but probes goes on it: the per-path packet counts of
the outbox stop growing), and once the port is up the path is probed back
into use and carries traffic again. No test asserts a speed: `dlcp bench
allreduce --scenario pathdown` measures the rounds.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest

from dlcp.testbed import Testbed
from tests.test_policies_netns import _jobs, allreduce, make_testbed, ranks

pytestmark = pytest.mark.netns


def metrics(tb: Testbed, host: int) -> str:
    """Host `host`'s daemon's /metrics, fetched from inside its namespace."""
    url = tb.hosts[host].metrics_url
    code = (
        f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=10).read().decode())"
    )
    return tb.exec(host, [sys.executable, "-c", code], capture=True, check=True).stdout


def states(status: dict[str, Any]) -> dict[str, list[str]]:
    """Each peer's path states, by the peer's first address."""
    return {p["peer"].split(":")[0]: [q["state"] for q in p["paths"]] for p in status["peers"]}


# a suspect path (a probe late: the two cores busy) is still in use, as an up one
IN_USE = ("up", "suspect")


def in_use(states: list[str]) -> bool:
    return all(x in IN_USE for x in states)


def transitions(text: str, labels: str, to: str) -> float:
    """`dlcp_path_transitions_total{labels,to=...}` in a /metrics text (0 if absent)."""
    head = f'dlcp_path_transitions_total{{{labels},to="{to}"}} '
    vals = [float(ln[len(head) :]) for ln in text.splitlines() if ln.startswith(head)]
    return vals[0] if vals else 0.0


def sent_on(status: dict[str, Any], path: int) -> int:
    """Packets the outbox sent on `path` to all peers (probes and credits not counted)."""
    return sum(p["paths"][path]["sent"] for p in status["peers"])


def test_a_path_set_down_mid_round_leaves_use_and_comes_back() -> None:
    total = 1 << 20  # 4 MB of fp32: about 0.4 s a round at 50 Mbit/s
    with make_testbed("pol-pd", hosts=3, paths=2, rate_bps=50_000_000) as tb:
        tb.start_daemons({"timing": {"timeout": 60.0}})
        addr0 = tb.hosts[0].addresses[0]
        job = next(_jobs)
        with ranks(tb, job) as rs:
            allreduce(rs, job=job, rnd=0, total=total, seed=0)
            assert all(in_use(s) for r in rs for s in states(r.status()).values())
            # the port goes down 0.1 s into round 1
            cut = threading.Timer(0.1, tb.set_port, (0, 0, False))
            cut.start()
            try:
                allreduce(rs, job=job, rnd=1, total=total, seed=1)
            finally:
                cut.join()
            assert tb.ports_down() == [tb.hosts[0].switch_ports[0]]
            allreduce(rs, job=job, rnd=2, total=total, seed=2)
            st = [r.status() for r in rs]
            # host 0 sees path 0 down to both peers, the others see it down to host 0
            # path 1, the only live one, stays in use even if its probes come back slow
            # on a busy machine (degraded: when every live path is, they all may be used)
            assert all(
                s[0] == "down" and s[1] in (*IN_USE, "degraded") for s in states(st[0]).values()
            ), states(st[0])
            for other in (1, 2):
                seen = states(st[other])
                assert seen[addr0][0] == "down", seen
                assert all(in_use(s) for a, s in seen.items() if a != addr0), seen
            text = metrics(tb, 0)
            peer1 = f"{tb.hosts[1].addresses[0]}:{tb.hosts[1].udp_port}"
            labels = f'path="0",peer="{peer1}"'
            assert f'dlcp_path_state{{{labels},state="down"}} 1.0' in text, text
            assert f'dlcp_path_state{{{labels},state="up"}} 0.0' in text
            # at least the cut's move to down is counted (a busy machine may add an earlier
            # suspect -> down -> probed back up, so not exactly one)
            downs = transitions(text, labels, "down")
            assert downs >= 1.0, [ln for ln in text.splitlines() if "transitions" in ln]
            before = [sent_on(s, 0) for s in st]
            for rnd in (3, 4):
                allreduce(rs, job=job, rnd=rnd, total=total, seed=rnd)
            st = [r.status() for r in rs]
            # nothing to or from host 0 went on path 0; hosts 1 and 2 still use it between them
            assert sent_on(st[0], 0) == before[0]
            for other in (1, 2):
                (to0,) = [p for p in st[other]["peers"] if p["peer"].startswith(addr0 + ":")]
                assert to0["paths"][1]["sent"] > 0
            assert any(sent_on(st[o], 0) > before[o] for o in (1, 2))

            tb.set_port(0, 0, True)
            assert tb.ports_down() == []
            healed = False
            for rnd in range(5, 12):
                allreduce(rs, job=job, rnd=rnd, total=total, seed=rnd)
                st = [r.status() for r in rs]
                if all(in_use(s) for x in st for s in states(x).values()):
                    healed = True
                    break
            assert healed, [states(x) for x in st]
            mark = sent_on(st[0], 0)
            allreduce(rs, job=job, rnd=rnd + 1, total=total, seed=99)
            assert sent_on(rs[0].status(), 0) > mark  # path 0 carries host 0's traffic again
