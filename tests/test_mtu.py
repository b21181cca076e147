"""The datagram size follows the link MTU (dlcp.daemon.mtu, network.mtu/payload)."""

from __future__ import annotations

import pytest

from dlcp.core.layout import DEFAULT_PAYLOAD, lanes_per_packet
from dlcp.daemon import config as config_mod
from dlcp.daemon.config import parse
from dlcp.daemon.mtu import link_mtu, payload_for, route_mtu
from dlcp.errors import LocalError
from dlcp.wire.header import HEADER_SIZE, MAX_PAYLOAD, Codec


def test_payload_fills_the_mtu_less_the_headers() -> None:
    assert payload_for(1500) == DEFAULT_PAYLOAD == 1500 - 20 - 8 - HEADER_SIZE
    assert payload_for(9000) == 8908
    assert payload_for(9000, "fd00::1") == 9000 - 40 - 8 - HEADER_SIZE
    assert payload_for(65535) == MAX_PAYLOAD
    # a jumbo datagram carries about six times the lanes of a 1500-byte one
    assert lanes_per_packet(Codec.FP32, payload_for(9000)) == 8908 // 4
    assert lanes_per_packet(Codec.THC8, payload_for(9000)) == 8192


def test_loopback_and_unroutable_peers_give_no_mtu() -> None:
    assert route_mtu("127.0.0.2") is None and route_mtu("::1") is None
    assert route_mtu("0.0.0.0") is None
    assert link_mtu([]) is None and link_mtu(["127.0.0.1", "127.0.0.3"]) is None


def test_link_mtu_is_the_smallest_route_mtu(monkeypatch: pytest.MonkeyPatch) -> None:
    import dlcp.daemon.mtu as mtu

    routes = {"10.0.0.2": 9000, "10.0.1.2": 1500, "10.0.2.2": None}
    monkeypatch.setattr(mtu, "route_mtu", routes.get)
    assert mtu.link_mtu(["10.0.0.2"]) == 9000
    assert mtu.link_mtu(["10.0.0.2", "10.0.1.2", "10.0.2.2"]) == 1500


def _net(**network: object) -> dict[str, object]:
    return {"network": {"addresses": ["10.0.0.1"], **network}}


def test_config_payload_follows_mtu_and_an_explicit_payload_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    peers = [{"index": 1, "addresses": ["10.0.0.2"]}]
    monkeypatch.setattr(config_mod, "link_mtu", lambda addrs: 9000 if list(addrs) else None)
    auto = parse(_net(peers=peers))
    assert auto.mtu == 9000 and auto.payload == 8908
    assert parse(_net()).payload == DEFAULT_PAYLOAD  # no peers: no MTU known
    given = parse(_net(peers=peers, mtu=4000))
    assert given.mtu == 4000 and given.payload == payload_for(4000)
    assert parse(_net(peers=peers, payload=1200)).payload == 1200
    with pytest.raises(LocalError, match=r"network\.mtu"):
        parse(_net(mtu=100))
