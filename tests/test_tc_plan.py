"""The pure tc plan: structure, validation, rate parsing, readable ops (no root)."""

from __future__ import annotations

import pytest

from dlcp.errors import LocalError
from dlcp.tc.apply import _expected_state, _key_tuples
from dlcp.tc.plan import (
    DEFAULT_DSCP,
    ETH_P_IP,
    ETH_P_IPV6,
    ROOT_HANDLE,
    TC_H_ROOT,
    Op,
    TcConfig,
    build_plan,
    classid,
    format_handle,
    leaf_handle,
    parse_dscp,
    parse_dscp_list,
    parse_rate,
)
from dlcp.tc.stats import ClassStats, format_table, stats_as_dict, stats_as_samples

GBIT = 1_000_000_000


def ops(plan: list[Op], kind: str, tc_kind: str | None = None) -> list[Op]:
    return [op for op in plan if op.kind == kind and (tc_kind is None or op.tc_kind == tc_kind)]


@pytest.fixture
def plan() -> list[Op]:
    return build_plan(TcConfig("eth0", GBIT))


def test_root_qdisc_is_htb_with_default_minor(plan: list[Op]) -> None:
    root = plan[0]
    assert (root.kind, root.action, root.tc_kind) == ("qdisc", "add", "htb")
    assert root.handle == ROOT_HANDLE == 0x10000
    assert root.parent == TC_H_ROOT
    assert root.option("default") == 0x16  # the minor of class 6 (1:16), an int
    assert root.command == "add"


def test_parent_class_runs_at_link_rate(plan: list[Op]) -> None:
    parent = [op for op in ops(plan, "class") if op.handle == 0x10001]
    assert len(parent) == 1
    assert parent[0].parent == ROOT_HANDLE
    assert parent[0].option("rate") == parent[0].option("ceil") == GBIT // 8


def test_eight_classes_strict_priority(plan: list[Op]) -> None:
    classes = [op for op in ops(plan, "class") if op.parent == 0x10001]
    assert [op.handle for op in classes] == [classid(i) for i in range(8)]
    assert [format_handle(op.handle) for op in classes] == [f"1:1{i}" for i in range(8)]
    for i, op in enumerate(classes):
        assert op.command == "add-class"
        assert op.option("prio") == i
        assert op.option("ceil") == GBIT // 8  # bytes/s: pyroute2's unit for int rates
        assert op.option("rate") == GBIT // 1000 // 8  # the tiny guaranteed rate
        assert op.option("burst") >= 1600 and op.option("cburst") >= 1600


def test_filters_match_each_dscp(plan: list[Op]) -> None:
    filters = ops(plan, "filter", "u32")
    assert len(filters) == 8
    for i, (op, dscp) in enumerate(zip(filters, DEFAULT_DSCP, strict=True)):
        assert op.command == "add-filter"
        assert op.parent == ROOT_HANDLE
        assert op.option("protocol") == ETH_P_IP == 0x0800
        assert op.option("prio") == i + 1
        assert op.option("target") == classid(i)
        (key,) = op.option("keys")
        value, mask_off = key.split("/")
        assert int(value, 16) == dscp << 2
        assert mask_off == "0xfc+1"
        # as the kernel stores it: TOS byte (offset 1) under mask 0xfc
        assert _key_tuples(key) == ((0xFC000000, (dscp << 2) << 24, 1, 0),)


def test_leaf_fifos_short_for_droppable() -> None:
    cfg = TcConfig("eth0", GBIT, droppable_classes=frozenset({5, 7}), queue_packets=500,
                   short_queue_packets=8)  # fmt: skip
    leaves = ops(build_plan(cfg), "qdisc", "pfifo")
    assert [op.handle for op in leaves] == [leaf_handle(i) for i in range(8)]
    assert [op.parent for op in leaves] == [classid(i) for i in range(8)]
    assert [op.option("limit") for op in leaves] == [500] * 5 + [8, 500, 8]


def test_order_root_classes_leaves_then_filters(plan: list[Op]) -> None:
    kinds = [op.kind for op in plan]
    assert kinds[0] == "qdisc" and kinds[1] == "class"
    first_filter = kinds.index("filter")
    assert all(k == "filter" for k in kinds[first_filter:])
    assert len(plan) == 1 + 1 + 8 * 2 + 8


def test_custom_dscp_default_class_and_ipv6() -> None:
    dscp = (46, 40, 32, 24, 16, 12, 0, 1)
    plan = build_plan(TcConfig("eth1", 200_000_000, dscp=dscp, default_class=7, match_ipv6=True))
    assert plan[0].option("default") == 0x17
    v4 = [op for op in ops(plan, "filter") if op.option("protocol") == ETH_P_IP]
    v6 = [op for op in ops(plan, "filter") if op.option("protocol") == ETH_P_IPV6]
    assert [int(op.option("keys")[0].split("/")[0], 16) >> 2 for op in v4] == list(dscp)
    assert [int(op.option("keys")[0].split("/")[0], 16) >> 22 for op in v6] == list(dscp)
    assert _key_tuples(v6[0].option("keys")[0]) == ((0x0FC00000, 46 << 22, 0, 0),)
    assert len({op.option("prio") for op in v4 + v6}) == 16


def test_min_rate_default_and_override() -> None:
    assert TcConfig("eth0", 100_000_000).min_rate == 100_000
    assert TcConfig("eth0", 1_000_000).min_rate == 8000  # floor of 8 kbit
    cfg = TcConfig("eth0", GBIT, min_rate_bps=10_000_000)
    assert {op.option("rate") for op in ops(build_plan(cfg), "class") if op.parent != ROOT_HANDLE
            } == {10_000_000 // 8}  # fmt: skip


def test_plan_is_plain_comparable_data() -> None:
    a = build_plan(TcConfig("eth0", GBIT))
    b = build_plan(TcConfig("eth0", GBIT, dscp=list(DEFAULT_DSCP)))  # type: ignore[arg-type]
    assert a == b
    assert len(set(a)) == len(a)  # hashable, all distinct
    assert build_plan(TcConfig("eth0", GBIT // 2)) != a
    assert _expected_state(a) == _expected_state(b)


def test_tc_kwargs_are_pyroute2_arguments(plan: list[Op]) -> None:
    f = ops(plan, "filter")[0]
    assert f.tc_kwargs() == {"handle": 0, "parent": 0x10000, "protocol": 0x0800, "prio": 1,
                             "target": 0x10010, "keys": ["0xc0/0xfc+1"]}  # fmt: skip
    assert plan[0].tc_kwargs() == {"handle": 0x10000, "parent": TC_H_ROOT, "default": 0x16}


def test_str_reads_like_tc(plan: list[Op]) -> None:
    lines = [str(op) for op in plan]
    assert lines[0] == "tc qdisc add dev eth0 root handle 1: htb default 16"
    assert lines[1].startswith("tc class add dev eth0 parent 1: classid 1:1 htb rate 1000000000bit")
    assert lines[2] == ("tc class add dev eth0 parent 1:1 classid 1:10 htb rate 1000000bit "
                        "ceil 1000000000bit burst 3200b cburst 125000b prio 0")  # fmt: skip
    assert lines[3] == "tc qdisc add dev eth0 parent 1:10 handle 10: pfifo limit 1000"
    assert "tc qdisc add dev eth0 parent 1:17 handle 17: pfifo limit 16" in lines
    assert lines[-8] == ("tc filter add dev eth0 parent 1: protocol ip prio 1 u32 "
                         "match ip dsfield 0xc0 0xfc flowid 1:10")  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dscp": (48, 40, 34)}, "8 values"),
        ({"dscp": (48, 40, 34, 26, 18, 10, 0, 64)}, "0..63"),
        ({"dscp": (48, 40, 34, 26, 18, 10, 0, -1)}, "0..63"),
        ({"dscp": (48, 40, 34, 26, 18, 10, 0, 48)}, "duplicate"),
        ({"rate_bps": 0}, "rate"),
        ({"rate_bps": -5}, "rate"),
        ({"rate_bps": 1.5e9}, "rate"),
        ({"default_class": 8}, "default_class"),
        ({"default_class": -1}, "default_class"),
        ({"droppable_classes": frozenset({9})}, "droppable_classes"),
        ({"queue_packets": 0}, "queue_packets"),
        ({"short_queue_packets": -1}, "short_queue_packets"),
        ({"min_rate_bps": 0}, "min_rate_bps"),
        ({"min_rate_bps": GBIT // 4}, "exceed the link rate"),
        ({"rate_bps": 32_000}, "exceed the link rate"),  # 8 x 8 kbit floor > 32 kbit
        ({"dev": ""}, "device name"),
        ({"dev": "a" * 16}, "device name"),
        ({"dev": "eth 0"}, "device name"),
    ],
)
def test_validation(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"dev": "eth0", "rate_bps": GBIT, **kwargs}
    with pytest.raises(LocalError, match=message):
        TcConfig(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("1gbit", 1_000_000_000),
        ("1Gbit", 1_000_000_000),
        ("200mbit", 200_000_000),
        ("100kbit", 100_000),
        ("10000000", 10_000_000),
        ("1500bit", 1500),
        ("1.5gbit", 1_500_000_000),
        ("2tbit", 2_000_000_000_000),
        ("1mibit", 1_048_576),
        ("1mbps", 8_000_000),  # tc: bps is bytes per second
        ("125bps", 1000),
        (" 40gbit ", 40_000_000_000),
    ],
)
def test_parse_rate(text: str, bps: int) -> None:
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text", ["", "fast", "1gbot", "-1mbit", "0", "0kbit", "1 g bit", "none"])
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(LocalError, match="bad rate"):
        parse_rate(text)


def test_parse_dscp() -> None:
    assert parse_dscp("cs6") == 48
    assert parse_dscp("AF41") == 34
    assert parse_dscp("ef") == 46
    assert parse_dscp("0x2e") == 46
    assert parse_dscp_list("48,40,34,26,18,10,0,8") == DEFAULT_DSCP
    assert parse_dscp_list("cs6,cs5,af41,af31,af21,af11,cs0,cs1") == DEFAULT_DSCP
    for bad in ("64", "x", "af51"):
        with pytest.raises(LocalError, match="bad DSCP"):
            parse_dscp(bad)


def test_format_handle() -> None:
    assert format_handle(0x10000) == "1:"
    assert format_handle(0x10010) == "1:10"
    assert format_handle(0x170000) == "17:"
    assert format_handle(TC_H_ROOT) == "root"


def test_stats_outputs() -> None:
    stats = [ClassStats(0, "1:10", 1000, 10, 0, 0, 0, 0, 48, 1000),
             ClassStats(7, "1:17", 500, 5, 3, 1, 1400, 1, 8, 16)]  # fmt: skip
    d = stats_as_dict(stats)
    assert d[1] == {"cls": 7, "classid": "1:17", "bytes": 500, "packets": 5, "drops": 3,
                    "overlimits": 1, "backlog_bytes": 1400, "backlog_packets": 1, "dscp": 8,
                    "queue_limit": 16}  # fmt: skip
    samples = stats_as_samples(stats, "veth0")
    assert len(samples) == 6 * 2
    dropped = [s for s in samples if s["name"] == "dlcp_tc_dropped_packets_total"]
    assert [(s["labels"], s["value"], s["type"]) for s in dropped] == [
        ({"dev": "veth0", "class": "0"}, 0.0, "counter"),
        ({"dev": "veth0", "class": "7"}, 3.0, "counter"),
    ]
    table = format_table(stats).splitlines()
    assert len(table) == 3 and "dropped" in table[0] and table[2].split()[:3] == ["7", "1:17", "8"]
