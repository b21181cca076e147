"""mode="ps": parameter servers (dedicated, co-located, both) from the job's
shape (`JobSpec.ps`) and the shim's placement to DDP through the hook over
loopback daemons (no root needed). The sums must be exact with bound 0: the
gradients equal PyTorch's default hook's, no step falls back."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import dlcp.shim as dlcp
from dlcp.core.records import SWITCH_SHARDS, JobSpec, ps_problem, ps_shards
from dlcp.errors import LocalError
from dlcp.shim.client import DaemonClient, DaemonError
from dlcp.shim.placement import SERVERS_ENV, Placement, placement
from dlcp.shim.rendezvous import plan_membership
from tests.daemons import Rank, hosts_of, loopback_daemons, submit
from tests.test_shim import make_model, reference_grads, spawn, train_steps

KEY = bytes(range(32))
DDP: dict[str, Any] = {"bucket_cap_mb": 0.01}
DAEMON_TIMING = {"timing": {"timeout": 2.0}}


def test_ps_shards_deal_evenly_and_pipeline() -> None:
    assert [ps_shards(n) for n in (1, 2, 3, 4, 5, 8, 12)] == [8, 8, 9, 8, 10, 8, 12]
    assert all(ps_shards(n) >= SWITCH_SHARDS and ps_shards(n) % n == 0 for n in range(1, 40))


def test_a_ps_job_deals_its_shards_among_the_aggregators() -> None:
    spec = JobSpec.ps(3, KEY, 0, 4, aggregators=(3,), contributors=(0, 1, 2), shards=8)
    assert spec.owners == (3,) * 8 and spec.contributors == (0, 1, 2)
    both = JobSpec.ps(3, KEY, 3, 4, aggregators=(3, 0, 1, 2), contributors=(0, 1, 2), shards=8)
    assert both.owners == (3, 0, 1, 2, 3, 0, 1, 2)
    assert JobSpec.ps(3, KEY, 1, 3, (0, 1, 2), (0, 1, 2)).owners == (0, 1, 2)  # one each
    assert both.senders_to(3) == frozenset({0, 1, 2})  # a server hears the contributors


@pytest.mark.parametrize(
    ("hosts", "aggs", "contr", "why"),
    [
        (3, (), (0, 1, 2), "at least one aggregator"),
        (3, (0,), (), "at least one contributor"),
        (3, (3,), (0, 1, 2), "aggregator 3 is not a host of the job (hosts 0..2)"),
        (3, (2,), (0, -1), "contributor -1 is not a host"),
        (4, (3, 3), (0, 1, 2), "aggregators list host(s) [3] twice"),
        (3, (2,), (0, 0, 1), "contributors list host(s) [0] twice"),
        (4, (3,), (0, 1), "host(s) [2] neither aggregate nor contribute"),
    ],
)
def test_ps_shapes_that_cannot_work(
    hosts: int, aggs: tuple[int, ...], contr: tuple[int, ...], why: str
) -> None:
    got = ps_problem(hosts, aggs, contr)
    assert got is not None and why in got
    with pytest.raises(LocalError, match="job 9: "):
        JobSpec.ps(9, KEY, 0, hosts, aggs, contr)


def test_uneven_shards_are_refused() -> None:
    with pytest.raises(LocalError, match="do not deal evenly"):
        JobSpec.ps(9, KEY, 0, 3, (0, 1), (0, 1, 2), shards=5)


def test_placement_follows_what_bytesps_users_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SERVERS_ENV, raising=False)
    assert placement("transpose", None, None) is None
    assert placement("ps", None, None) == Placement((), True)  # co-located by default
    assert placement("ps", ["/a.sock"], None) == Placement(("/a.sock",), False)
    assert placement("ps", "/a.sock,/b.sock", True) == Placement(("/a.sock", "/b.sock"), True)
    monkeypatch.setenv(SERVERS_ENV, "/s0.sock, /s1.sock")
    assert placement("ps", None, None) == Placement(("/s0.sock", "/s1.sock"), False)


@pytest.mark.parametrize(
    ("mode", "servers", "colocate", "why"),
    [
        ("ps", [], None, "empty list"),
        ("ps", ["/a.sock", "/a.sock"], None, "names ['/a.sock'] twice"),
        ("ps", "/a.sock,,/b.sock", None, "empty socket path"),
        ("ps", None, False, "colocate=False needs servers="),
        ("transpose", ["/a.sock"], None, "are for mode='ps'"),
        ("switch", None, True, "are for mode='ps'"),
    ],
)
def test_placements_that_cannot_work_are_clear_errors(
    monkeypatch: pytest.MonkeyPatch, mode: str, servers: Any, colocate: Any, why: str
) -> None:
    monkeypatch.delenv(SERVERS_ENV, raising=False)
    with pytest.raises(LocalError) as e:
        placement(mode, servers, colocate)
    assert why in str(e.value)
    with pytest.raises(LocalError):  # the state refuses them before any collective
        dlcp.DlcpState(mode=mode, servers=servers, colocate=colocate)


def _daemon(i: int) -> dict[str, Any]:
    return {"id": f"d{i}", "addresses": [f"10.0.0.{i + 1}"], "udp_port": 7400, "payload": 1400}


def test_plan_membership_puts_the_servers_after_the_training_hosts() -> None:
    secret = {"job": 5, "key": "ab" * 32}
    ranks = [_daemon(0), _daemon(1), _daemon(0)]  # two hosts, rank 2 on host 0
    m = plan_membership(ranks, 1, secret, servers=[_daemon(7)])
    assert m.ps and m.aggregators == [2] and m.shards == 8
    f = m.join_fields("ps")
    assert f["hosts"][2] == {"addresses": ["10.0.0.8"], "udp_port": 7400}
    assert (f["me"], f["local_ranks"], f["contributors"], f["shards"]) == (1, 1, [0, 1], 8)
    at = m.join_fields("ps", server=0)
    assert (at["me"], at["local_ranks"], at["aggregators"]) == (2, 1, [2])
    both = plan_membership(ranks, 0, secret, servers=[_daemon(7)], colocated=True)
    assert both.aggregators == [2, 0, 1] and both.shards == 9
    assert both.join_fields("ps")["local_ranks"] == 2
    co = plan_membership(ranks, 0, secret, colocated=True)
    assert co.aggregators == [0, 1] and co.job_hosts == co.hosts
    plain = plan_membership(ranks, 0, secret)
    assert not plain.ps and "aggregators" not in plain.join_fields("transpose")


def test_plan_membership_refuses_a_server_that_is_another_daemon_of_the_job() -> None:
    secret = {"job": 5, "key": "ab" * 32}
    ranks = [_daemon(0), _daemon(1)]
    with pytest.raises(LocalError, match="server 0 is the same daemon as training host 1"):
        plan_membership(ranks, 0, secret, servers=[_daemon(1)])
    with pytest.raises(LocalError, match="server 1 is the same daemon as server 0"):
        plan_membership(ranks, 0, secret, servers=[_daemon(5), _daemon(5)])


def test_a_ps_join_names_its_aggregators(tmp_path: Path) -> None:
    with loopback_daemons(tmp_path, 3) as ds:
        hosts = hosts_of(ds)
        with DaemonClient(ds[0].socket) as c:
            c.hello()
            for fields, why in (
                ({}, "at least one aggregator"),
                ({"aggregators": [3]}, "aggregator 3 is not a host"),
                ({"aggregators": [2, 2]}, "twice"),
                ({"aggregators": [1], "contributors": [0]}, "[2] neither aggregate"),
                ({"aggregators": [0, 1], "shards": 3}, "do not deal evenly"),
            ):
                with pytest.raises(DaemonError) as e:
                    c.join(job=4, key=KEY, hosts=hosts, me=0, mode="ps", **fields)
                assert e.value.code == "bad_request" and why in str(e.value), (fields, e.value)
            assert not c.status()["jobs"]


def test_a_dedicated_server_sums_in_eight_shards(tmp_path: Path) -> None:
    """Daemon 2 is the server (its only client puts the job there, as rank 0 does)."""
    with loopback_daemons(tmp_path, 3, DAEMON_TIMING) as ds:
        hosts = hosts_of(ds)
        shape = {"mode": "ps", "aggregators": [2], "contributors": [0, 1], "shards": 8}
        server = DaemonClient(ds[2].socket)
        ranks = []
        try:
            server.hello()
            server.join(job=6, key=KEY, hosts=hosts, me=2, **shape)
            for i in (0, 1):
                ranks.append(Rank(ds[i], f"dlcp-ps{os.getpid()}-{i}", 1 << 20))
                ranks[-1].client.join(job=6, key=KEY, hosts=hosts, me=i, **shape)
            (job,) = server.status()["jobs"]
            assert job["owners"] == [2] * 8 and job["contributors"] == [0, 1]
            xs = [
                np.random.default_rng(i).standard_normal(20_000).astype(np.float32) for i in (0, 1)
            ]
            waits = [
                submit(r, job=6, round=0, bucket=0, lanes=x, shards=8)
                for r, x in zip(ranks, xs, strict=True)
            ]
            for w in waits:
                res = w()
                np.testing.assert_array_equal(res.sums, xs[0] + xs[1])
                assert (res.contributors == 2).all() and res.reply["lost_lanes"] == 0
            counters = server.status()["counters"]
            assert counters["shards_aggregated"] == 8
            assert counters.get("data_packets_sent", 0) == 0
        finally:
            for r in ranks:
                r.close()
            server.close()


def _ddp_worker(
    rank: int, world: int, sockets: list[str], servers: list[str], colocate: bool | None
) -> dict[str, Any]:
    ref = reference_grads(rank, 4, **DDP)
    state = dlcp.init(
        socket=sockets[rank],
        mode="ps",
        servers=servers or None,
        colocate=colocate,
        round_timeout_s=30.0,
    )
    model = nn.parallel.DistributedDataParallel(make_model(), **DDP)
    model.register_comm_hook(state, dlcp.hook)
    grads = train_steps(model, rank, 4)
    t = torch.arange(1000.0) * (rank + 1)
    dlcp.all_reduce(t)
    link = state.link
    out = {
        "grads": grads,
        "ref": ref,
        "mean": t,
        "stats": state.stats(),
        "aggregators": None if link is None else link.membership.aggregators,
    }
    state.close()
    return out


@pytest.mark.parametrize(
    ("placed", "daemons", "servers", "colocate", "aggregators"),
    [
        ("dedicated", 4, [3], None, [3]),
        ("co-located", 3, [], None, [0, 1, 2]),
        ("both", 4, [3], True, [3, 0, 1, 2]),
    ],
)
def test_the_hook_sums_exactly_through_parameter_servers(
    tmp_path: Path,
    placed: str,
    daemons: int,
    servers: list[int],
    colocate: bool | None,
    aggregators: list[int],
) -> None:
    with loopback_daemons(tmp_path, daemons, DAEMON_TIMING) as ds:
        sockets = [d.socket for d in ds[:3]]
        results = spawn(
            _ddp_worker,
            3,
            tmp_path,
            sockets=sockets,
            servers=[ds[i].socket for i in servers],
            colocate=colocate,
        )
        aggregated = [d.client().status()["counters"].get("shards_aggregated", 0) for d in ds]
    for res in results:
        stats = res["stats"]
        assert stats["attached"] and stats["fallbacks"] == 0, (placed, stats)
        assert stats["lost_lanes"] == 0 and stats["rounds"] > 4
        assert res["aggregators"] == aggregators
        for got, want in zip(res["grads"], res["ref"], strict=True):
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(res["mean"], torch.arange(1000.0) * 2)
    # who summed: the servers, and the training hosts only when co-located
    assert all(aggregated[i] > 0 for i in aggregators), aggregated
    assert all(aggregated[i] == 0 for i in range(daemons) if i not in aggregators), aggregated


def _same_daemon_worker(rank: int, world: int, sockets: list[str]) -> str:
    try:
        dlcp.init(socket=sockets[rank], mode="ps", servers=[sockets[1]])
    except LocalError as exc:
        return str(exc)
    return "attached"


def test_a_training_hosts_daemon_named_as_a_server_is_an_error_on_every_rank(
    tmp_path: Path,
) -> None:
    with loopback_daemons(tmp_path, 2) as ds:
        got = spawn(_same_daemon_worker, 2, tmp_path, sockets=[d.socket for d in ds])
    assert got[0] == got[1] and "server 0 is the same daemon as training host 1" in got[0]


def test_the_bench_runs_servers_as_hosts_without_ranks() -> None:
    from dlcp.bench.cluster import Setup
    from dlcp.bench.common import BenchError

    assert "1 parameter server" in Setup(hosts=3, mode="ps", servers=1).describe()
    with pytest.raises(BenchError, match="--mode ps needs --servers"):
        Setup(hosts=3, mode="ps")
    with pytest.raises(BenchError, match="for --mode ps"):
        Setup(hosts=3, servers=1)
    with pytest.raises(BenchError, match="for --mode ps"):
        Setup(hosts=3, mode="switch", colocate=True)


@pytest.mark.parametrize(
    ("words", "servers", "colocate", "bound"),
    [
        ("--mode ps", 1, False, 0.0),  # one dedicated server, exact sums
        ("--mode ps --servers 0", 0, True, 0.0),  # co-located
        ("--mode ps --servers 2 --colocate --loss-bound 0.01", 2, True, 0.01),
        ("", 0, False, 0.05),  # other modes keep their default bound
    ],
)
def test_bench_ps_options(words: str, servers: int, colocate: bool, bound: float) -> None:
    import argparse

    from dlcp.bench import cli

    p = argparse.ArgumentParser(prog="dlcp")
    cli.register(p.add_subparsers(dest="command"))
    for bench in ("allreduce", "train"):
        args = p.parse_args(["bench", bench, *words.split()])
        opts = (cli.allreduce_options if bench == "allreduce" else cli.train_options)(args)
        assert (opts.setup.servers, opts.setup.colocate, opts.bound) == (servers, colocate, bound)


def _switch_worker(rank: int, world: int, sockets: list[str], switch: str) -> dict[str, Any]:
    ref = reference_grads(rank, 2, **DDP)
    state = dlcp.init(socket=sockets[rank], mode="switch", switch_socket=switch)
    model = nn.parallel.DistributedDataParallel(make_model(), **DDP)
    model.register_comm_hook(state, dlcp.hook)
    grads = train_steps(model, rank, 2)
    link = state.link
    out = {
        "grads": grads,
        "ref": ref,
        "stats": state.stats(),
        "held": len(link.held) if link else 0,
    }
    state.close()
    return out


def test_the_switch_mode_holds_its_aggregator_as_the_servers_are_held(tmp_path: Path) -> None:
    """Mode "switch" attaches through the same hold as "ps" (rank 0 holds one job)."""
    with loopback_daemons(tmp_path, 3, DAEMON_TIMING) as ds:
        results = spawn(
            _switch_worker, 2, tmp_path, sockets=[d.socket for d in ds[:2]], switch=ds[2].socket
        )
        aggregated = [d.client().status()["counters"].get("shards_aggregated", 0) for d in ds]
    assert [r["held"] for r in results] == [1, 0]
    for res in results:
        assert res["stats"]["fallbacks"] == 0 and res["stats"]["attached"]
        for got, want in zip(res["grads"], res["ref"], strict=True):
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    assert aggregated[2] > 0 and aggregated[:2] == [0, 0]
