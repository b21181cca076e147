"""Receive moderation (`[network] moderation_s`): a busy daemon polls its
sockets instead of waking for each datagram, and goes back to watching them
when a poll finds nothing to do."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dlcp.daemon.config import Config, parse
from dlcp.daemon.server import MODERATION_BYTES, Daemon
from dlcp.daemon.transport import UdpPath
from dlcp.errors import LocalError
from tests.daemons import Rank, free_udp_port, hosts_of, loopback_daemons, submit

KEY = bytes(range(32))


@pytest.fixture
def daemon() -> Iterator[tuple[Daemon, UdpPath, asyncio.AbstractEventLoop]]:
    """A daemon with one socket on loopback, its readable callback registered
    on a loop that is never run (its clock and its registrations only)."""
    cfg = Config(addresses=("127.0.0.1",), udp_port=free_udp_port(), moderation_s=0.002)
    d = Daemon(cfg)
    loop = asyncio.new_event_loop()
    d._loop = loop
    path = UdpPath("127.0.0.1", cfg.udp_port)
    d.paths.append(path)
    loop.add_reader(path.fileno(), d._on_readable, path)
    try:
        yield d, path, loop
    finally:
        if d._timer is not None:
            d._timer.cancel()
        loop.remove_reader(path.fileno())
        path.close()
        loop.close()


def _registered(loop: asyncio.AbstractEventLoop, path: UdpPath) -> bool:
    """Whether the loop watches `path`'s socket for reading."""
    try:
        loop._selector.get_key(path.fileno())  # type: ignore[attr-defined]
    except KeyError:
        return False
    return True


def _send(port: int, sizes: list[int]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for n in sizes:
            s.sendto(bytes(n), ("127.0.0.1", port))


def test_a_busy_wake_up_polls_and_an_idle_poll_watches_again(
    daemon: tuple[Daemon, UdpPath, asyncio.AbstractEventLoop],
) -> None:
    d, path, loop = daemon
    _send(d.config.udp_port, [100, 100, 100])
    before = d.now
    d._on_readable(path)
    assert d.counters["rx_packets"] == 3  # taken (and rejected: not dlcp datagrams)
    # busy: the socket is no longer watched; the next wake-up is the poll
    assert d.netin.polling and not _registered(loop, path)
    assert d._timer is not None
    assert d.netin.poll_at >= before + d.config.moderation_s
    assert d._timer_at == d.netin.poll_at
    # a poll that finds datagrams keeps polling
    _send(d.config.udp_port, [100])
    d._on_timer()
    assert d.counters["rx_packets"] == 4
    assert d.netin.polling and not _registered(loop, path)
    # a poll with nothing to take or send watches the socket again
    d._on_timer()
    assert not d.netin.polling and _registered(loop, path)
    assert d._timer is None  # nothing to time: an idle daemon sleeps
    # counted by what woke the daemon (dlcp_wakeups_total)
    assert (d.counters["wakeups_readable"], d.counters["wakeups_poll"]) == (1, 2)
    assert d.counters["wakeups_timer"] == 0


def test_a_poll_that_takes_a_fast_links_worth_comes_back_at_once(
    daemon: tuple[Daemon, UdpPath, asyncio.AbstractEventLoop],
) -> None:
    d, path, _loop = daemon
    n = MODERATION_BYTES // 60_000 + 1
    _send(d.config.udp_port, [60_000] * n)
    d._on_readable(path)
    assert d.counters["rx_bytes"] >= MODERATION_BYTES
    assert d.netin.polling
    assert d.netin.poll_at <= d.now  # due now, not after the interval


def test_without_moderation_the_socket_stays_watched(
    daemon: tuple[Daemon, UdpPath, asyncio.AbstractEventLoop],
) -> None:
    d, path, loop = daemon
    d.netin.moderation = 0.0
    _send(d.config.udp_port, [100])
    d._on_readable(path)
    assert d.counters["rx_packets"] == 1
    assert not d.netin.polling and _registered(loop, path)


@pytest.mark.parametrize("moderation", [0.0, 0.002])
def test_sums_are_exact_with_and_without_moderation(tmp_path: Path, moderation: float) -> None:
    """Three real daemons on loopback, rounds of several sizes, exact sums."""
    rng = np.random.default_rng(7)
    extra = {"network": {"moderation_s": moderation}, "timing": {"timeout": 5.0}}
    with loopback_daemons(tmp_path, 3, extra) as ds:
        ranks = [Rank(d, f"dlcp-mod{i}-{id(tmp_path)}", 4 << 20) for i, d in enumerate(ds)]
        try:
            for i, r in enumerate(ranks):
                r.join(77, KEY, hosts_of(ds), i)
            for rnd, n in enumerate((1, 5_000, 300_000)):
                xs = [rng.standard_normal(n).astype(np.float32) for _ in ranks]
                waits = [
                    submit(r, job=77, round=rnd, bucket=0, lanes=x, shards=3)
                    for r, x in zip(ranks, xs, strict=True)
                ]
                for res in (w() for w in waits):
                    np.testing.assert_array_equal(res.sums, xs[0] + xs[1] + xs[2])
                    assert res.reply["lost_lanes"] == 0
        finally:
            for r in ranks:
                r.close()


@pytest.mark.parametrize("value", [-0.001, 0.5, "2ms", True])
def test_a_bad_moderation_is_one_clear_error(value: object) -> None:
    with pytest.raises(LocalError, match=r"network\.moderation_s"):
        parse({"network": {"moderation_s": value}})


def test_moderation_is_read_from_the_config() -> None:
    assert parse({"network": {"moderation_s": 0}}).moderation_s == 0.0
    assert parse({}).moderation_s == Config().moderation_s > 0  # on by default
