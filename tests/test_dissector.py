"""The scapy layer `dlcp.wire.dissector.DLCP` and `dlcp decode`.

Property tests: dlcp's encoder and the scapy layer agree on every field and
byte, both ways. CLI tests run `dlcp decode` on captures written with scapy.
The namespace test (root) captures real daemons' rounds with tcpdump on a
testbed switch port and decodes that.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import Raw
from scapy.utils import rdpcap, wrpcap, wrpcapng

from dlcp import decode_cli
from dlcp.cli import main
from dlcp.daemon.config import Config
from dlcp.wire import Codec, Flags, Header, PacketType, decode, encode
from dlcp.wire.dissector import DEFAULT_PORT, DLCP, FLAG_NAMES, bind, flag_names, seal
from dlcp.wire.header import (
    _STRUCT,
    ALL_FLAGS,
    HEADER_SIZE,
    MAC_OFFSET,
    MAX_PRIORITY,
    expected_payload,
    header_of_valid,
)
from dlcp.wire.mac import MacKey, mac_state

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
U16, U32 = 0xFFFF, 0xFFFFFFFF
KEY = bytes(range(32))
JOB = 7
HEADER_FIELDS = [
    *("magic", "version", "type", "flags", "priority", "codec", "reserved"),
    *("job", "round", "bucket", "shard", "layer", "sender", "contributors"),
    *("offset", "count", "total", "param", "aux", "mac"),
]


@st.composite
def packets(draw: st.DrawFn) -> tuple[Header, bytes]:
    """A header dlcp's encoder accepts and a payload of the length it says."""
    ptype = draw(st.sampled_from(list(PacketType)))
    codec = draw(st.sampled_from(list(Codec)))
    flags = Flags(draw(st.integers(0, ALL_FLAGS)))
    count = draw(st.integers(1 if ptype in (PacketType.DATA, PacketType.RESULT) else 0, 200))
    total = draw(st.integers(count, U32))
    offset = draw(st.integers(0, total - count))
    h = Header(
        type=ptype,
        job=draw(st.integers(0, U32)),
        round=draw(st.integers(0, U32)),
        bucket=draw(st.integers(0, U32)),
        flags=flags,
        priority=draw(st.integers(0, MAX_PRIORITY)),
        codec=codec,
        shard=draw(st.integers(0, U16)),
        layer=draw(st.integers(0, U16)),
        sender=draw(st.integers(0, U16)),
        contributors=draw(st.integers(1, U16)),
        offset=offset,
        count=count,
        total=total,
        param=draw(st.floats(width=32, allow_nan=False, allow_infinity=False)),
        aux=draw(st.integers(0, U32)),
    )
    size = expected_payload(ptype, codec, flags, count, 0)
    return h, draw(st.binary(min_size=size, max_size=size))


def _expected_fields(h: Header, raw: bytes) -> dict[str, Any]:
    """What each DLCP field must read: the header as the decoder parses it."""
    parsed = header_of_valid(raw)  # param rounded to float32 as on the wire
    return {
        "magic": 0xD1CF,
        "version": 1,
        "type": int(h.type),
        "flags": int(h.flags),
        "priority": h.priority,
        "codec": int(h.codec),
        "reserved": 0,
        **{f: getattr(h, f) for f in ("job", "round", "bucket", "shard", "layer", "sender")},
        **{f: getattr(h, f) for f in ("contributors", "offset", "count", "total", "aux")},
        "param": parsed.param,
        "mac": raw[MAC_OFFSET:HEADER_SIZE],
    }


# ---------------------------------------------------------------------------------
# The layer


def test_layer_has_every_header_field_in_wire_order() -> None:
    assert [f.name for f in DLCP.fields_desc] == HEADER_FIELDS
    assert len(DLCP()) == HEADER_SIZE
    assert set(Header.__dataclass_fields__) <= set(HEADER_FIELDS)
    assert len(_STRUCT.unpack(bytes(48))) == len(HEADER_FIELDS) - 1  # all but the MAC


def test_default_port_is_the_daemons() -> None:
    from dlcp.testbed.plan import UDP_PORT

    assert DEFAULT_PORT == Config().udp_port == UDP_PORT == decode_cli.DEFAULT_PORT


def test_flag_and_enum_names() -> None:
    for f in Flags:
        if int(f):
            assert FLAG_NAMES[int(f).bit_length() - 1] == f.name
    assert flag_names(int(Flags.DROPPABLE | Flags.LAST)) == ["DROPPABLE", "LAST"]
    assert flag_names(0xC0) == ["EARLY", "BIT7"]
    pkt = DLCP(type="RESULT", codec="THC4", flags="SUMMED+RETRANSMIT")
    raw = bytes(pkt)
    assert raw[3] == PacketType.RESULT and raw[6] == Codec.THC4
    assert raw[4] == Flags.SUMMED | Flags.RETRANSMIT
    shown = str(pkt.show(dump=True))
    assert "RESULT" in shown and "THC4" in shown and "SUMMED" in shown
    assert "type=NACK" in repr(DLCP(type=int(PacketType.NACK)))


def test_bind_dissects_either_direction_of_a_port() -> None:
    raw = encode(Header(PacketType.ACK, JOB, 1, 0), b"", KEY)
    port = 46123
    assert DLCP not in IP(bytes(IP() / UDP(sport=port, dport=9) / raw))
    bind(port)
    bind(port)  # idempotent
    for sport, dport in ((port, 9), (9, port), (port, port)):
        pkt = IP(bytes(IP() / UDP(sport=sport, dport=dport) / raw))
        assert pkt[DLCP].type == PacketType.ACK
    assert DLCP not in IP(bytes(IP() / UDP(sport=9, dport=10) / raw))
    built = UDP() / DLCP()
    assert DLCP in UDP(bytes(built))
    with pytest.raises(ValueError):
        bind(0)


def test_default_port_bound_on_import_ipv6_too() -> None:
    raw = encode(Header(PacketType.NACK, JOB, 2, 3, count=2), bytes(8), KEY)
    pkt = Ether(bytes(Ether() / IPv6() / UDP(sport=5000, dport=DEFAULT_PORT) / raw))
    assert pkt[DLCP].round == 2 and pkt[DLCP].bucket == 3
    assert pkt[Raw].load == bytes(8)


@SETTINGS
@given(packets())
def test_dlcp_encoded_parses_field_by_field(packet: tuple[Header, bytes]) -> None:
    h, payload = packet
    raw = encode(h, payload, KEY)
    pkt = DLCP(raw)
    for name, want in _expected_fields(h, raw).items():
        assert pkt.getfieldval(name) == want, name
    assert (bytes(pkt[Raw].load) if payload else bytes(pkt.payload)) == payload
    assert bytes(pkt) == raw
    framed = IP(bytes(IP() / UDP(sport=DEFAULT_PORT, dport=DEFAULT_PORT) / raw))
    assert bytes(framed[DLCP]) == raw


@SETTINGS
@given(packets(), st.sampled_from(["blake2b", "ghash-aes"]))
def test_scapy_built_equals_dlcp_encoded_and_decodes(
    packet: tuple[Header, bytes], algorithm: str
) -> None:
    h, payload = packet
    key: MacKey = mac_state(KEY, algorithm)
    raw = encode(h, payload, key)
    fields = {k: v for k, v in _expected_fields(h, raw).items() if k != "mac"}
    built = DLCP(**fields) / Raw(payload) if payload else DLCP(**fields)
    assert bytes(built)[:MAC_OFFSET] == raw[:MAC_OFFSET]
    assert header_of_valid(bytes(built)) == header_of_valid(raw)  # header-only unpack
    sealed = seal(built, key)
    assert bytes(sealed) == raw
    got, body = decode(bytes(sealed), {h.job: key})
    assert got == header_of_valid(raw) and bytes(body) == payload


@SETTINGS
@given(st.binary(min_size=HEADER_SIZE, max_size=300))
def test_any_bytes_round_trip(raw: bytes) -> None:
    assert bytes(DLCP(raw)) == raw


# ---------------------------------------------------------------------------------
# dlcp decode


def _frame(raw: bytes, src: str = "10.0.0.1", sport: int = DEFAULT_PORT, tos: int = 0) -> Any:
    return (
        Ether()
        / IP(src=src, dst="10.0.0.9", tos=tos)
        / UDP(sport=sport, dport=DEFAULT_PORT)
        / Raw(raw)
    )


def _capture(tmp_path: Path, *, ng: bool = False) -> tuple[Path, list[bytes]]:
    """Data of two senders (one retransmitted), a result, DONE, a MAC failure,
    three malformed datagrams and unrelated traffic; returns the file and the
    dlcp datagrams in order."""
    key = mac_state(KEY, "ghash-aes")
    dgs: list[tuple[bytes, str, int]] = []
    for sender in range(2):
        for i in range(3):
            flags = Flags.RETRANSMIT if (sender, i) == (1, 2) else Flags.NONE
            h = Header(PacketType.DATA, JOB, 5, 0, flags=flags, priority=i + 1, sender=sender)
            h = h.with_(offset=4 * i, count=4, total=12, shard=1)
            dgs.append((encode(h, bytes(16), key), f"10.0.0.{sender + 1}", (34 - 8 * i) << 2))
    result_header = Header(PacketType.RESULT, JOB, 5, 0, offset=0, count=12, total=12)
    result = encode(result_header, bytes(48), key)
    dgs.append((result, "10.0.0.9", 48 << 2))
    dgs.append((encode(Header(PacketType.DONE, JOB, 5, 0, count=3), b"\0", key), "10.0.0.1", 0))
    tampered = bytearray(result)
    tampered[-1] ^= 1
    dgs.append((bytes(tampered), "10.0.0.9", 0))  # MAC failure
    dgs.append((b"short", "10.0.0.5", 0))  # truncated
    dgs.append((b"\x12\x34" + result[2:], "10.0.0.5", 0))  # bad magic
    dgs.append((result[:3] + b"\x09" + result[4:], "10.0.0.5", 0))  # unknown type
    frames = [_frame(raw, src, tos=tos) for raw, src, tos in dgs]
    frames.insert(3, Ether() / IP() / UDP(sport=5353, dport=53) / Raw(b"not dlcp"))
    path = tmp_path / ("cap.pcapng" if ng else "cap.pcap")
    (wrpcapng if ng else wrpcap)(str(path), frames)
    return path, [raw for raw, _, _ in dgs]


def _json_lines(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[dict[str, Any]]:
    assert main(["decode", *argv, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("ng", [False, True])
def test_decode_json_one_line_per_datagram(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], ng: bool
) -> None:
    path, dgs = _capture(tmp_path, ng=ng)
    lines = _json_lines(capsys, [str(path)])
    assert len(lines) == len(dgs)
    first = lines[0]
    assert first["src"] == f"10.0.0.1:{DEFAULT_PORT}" and first["dst"].startswith("10.0.0.9:")
    assert first["dscp"] == 34 and first["type"] == "DATA" and first["class"] == 1
    assert (first["job"], first["round"], first["bucket"], first["shard"]) == (JOB, 5, 0, 1)
    assert (first["offset"], first["count"], first["sender"], first["flags"]) == (0, 4, 0, [])
    assert first["reject"] is None and "mac" not in first
    assert lines[5]["flags"] == ["RETRANSMIT"] and lines[5]["sender"] == 1
    assert [x["frame"] for x in lines[:4]] == [1, 2, 3, 5]  # frame 4 is DNS
    assert lines[1]["time"] > lines[0]["time"] > 0
    assert [x["reject"] for x in lines[-4:]] == [None, "truncated", "bad_magic", "bad_type"]
    assert "type" not in lines[-3] and lines[-2]["detail"] == "magic 0x1234"


def test_decode_checks_macs_with_a_hex_or_raw_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = _capture(tmp_path)
    for text in (KEY, f"  {KEY.hex()}\n".encode()):
        keyfile = tmp_path / "job.key"
        keyfile.write_bytes(text)
        lines = _json_lines(capsys, [str(path), "--key-file", str(keyfile), "--job", str(JOB)])
        assert [x["mac"] for x in lines] == ["ok"] * 8 + ["bad"] + [None] * 3
    other = _json_lines(capsys, [str(path), "--key-file", str(keyfile), "--job", "8"])
    assert {x["mac"] for x in other} == {None}  # no packet of job 8
    wrong = _json_lines(
        capsys, [str(path), "--key-file", str(keyfile), "--job", str(JOB), "--mac", "blake2b"]
    )
    assert {x["mac"] for x in wrong[:9]} == {"bad"}


def test_decode_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = _capture(tmp_path)
    keyfile = tmp_path / "job.key"
    keyfile.write_text(KEY.hex())
    assert main(["decode", str(path), "--key-file", str(keyfile), "--job", str(JOB)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{path}: 12 dlcp datagrams on UDP port {DEFAULT_PORT}, ")
    assert ", 3 malformed" in out
    rows = {tuple(line.split()) for line in out.splitlines()}
    assert ("DATA", "6", str(6 * 80)) in rows
    assert ("RESULT", "2", str(2 * 112)) in rows and ("DONE", "1", "65") in rows
    assert ("34", "2", "160") in rows  # DSCP 34: the two class-1 packets
    assert ("7/5", "9", str(6 * 80 + 2 * 112 + 65)) in rows  # per round
    assert ("1", "3", "240", "10.0.0.2") in rows  # per sender
    assert "retransmissions: 1 packets, 80 bytes (DATA 1)" in out
    assert f"MAC of job {JOB}: 8 ok, 1 bad" in out
    assert ("7/5/0", "2", "6", "1", "1", "0", "2", "0", "0", "100.0", "%") in rows
    assert ("bad_magic", "1") in rows and ("truncated", "1") in rows
    assert "bad_type: type 9" in out and "truncated: 5 bytes < header of 64" in out


def test_decode_other_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = encode(Header(PacketType.ACK, JOB, 1, 0), b"", KEY)
    frames = [
        Ether() / IP() / UDP(sport=9000, dport=9001) / Raw(raw),
        Ether() / IP() / UDP(sport=9001, dport=9000) / Raw(raw),
    ]
    wrpcap(str(tmp_path / "p.pcap"), frames)
    assert _json_lines(capsys, [str(tmp_path / "p.pcap")]) == []
    lines = _json_lines(capsys, [str(tmp_path / "p.pcap"), "--port", "9001"])
    assert [x["type"] for x in lines] == ["ACK", "ACK"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (None, "No such file"),
        (b"this is not a capture file at all", "Not a supported capture file"),
    ],
)
def test_decode_unreadable_capture_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: bytes | None, message: str
) -> None:
    path = tmp_path / "x.pcap"
    if make is not None:
        path.write_bytes(make)
    assert main(["decode", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dlcp decode: error: ") and message in err


def test_decode_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = _capture(tmp_path)
    (tmp_path / "k").write_text("abcd")
    for argv in (
        ["--key-file", str(tmp_path / "k")],
        ["--key-file", str(tmp_path / "k"), "--job", "7"],
        ["--key-file", str(tmp_path / "missing"), "--job", "7"],
        ["--port", "0"],
    ):
        assert main(["decode", str(path), *argv]) == 2, argv
        assert capsys.readouterr().err.startswith("dlcp decode: error: ")


def test_decode_truncated_capture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = _capture(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 30])  # the last record cut short
    status = main(["decode", str(path), "--json"])
    out, err = capsys.readouterr()
    assert status in (0, 2) and "Traceback" not in err
    assert len(out.splitlines()) >= 10


def test_random_garbage_never_raises(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(5)
    good = encode(Header(PacketType.DATA, JOB, 1, 0, count=4, total=4), bytes(16), KEY)
    frames = []
    for _ in range(200):
        raw = bytearray(good[: rng.randint(0, len(good))])
        for _ in range(rng.randint(0, 4)):
            if raw:
                raw[rng.randrange(len(raw))] = rng.randrange(256)
        frames.append(_frame(bytes(raw)))
    wrpcap(str(tmp_path / "g.pcap"), frames)
    assert len(_json_lines(capsys, [str(tmp_path / "g.pcap")])) == 200
    assert main(["decode", str(tmp_path / "g.pcap")]) == 0
    assert "200 dlcp datagrams" in capsys.readouterr().out


# ---------------------------------------------------------------------------------
# Real daemons in namespaces, captured with tcpdump on a switch port (root)


@pytest.fixture
def testbed_job() -> Iterator[tuple[Any, list[Any]]]:
    from dlcp.shim.client import DaemonClient, Segment
    from dlcp.testbed import Testbed, TestbedSpec

    class Rank:
        def __init__(self, socket: str, name: str) -> None:
            self.client = DaemonClient(socket)
            self.info = self.client.hello()
            self.seg = Segment(name, 4 << 20)
            self.client.segment(self.seg)

        def close(self) -> None:
            self.client.close()
            self.seg.close()

    if shutil.which("tcpdump") is None:
        pytest.skip("tcpdump is not installed (scripts/test installs it)")
    root = Path(tempfile.mkdtemp(prefix="dlcp-diss-", dir="/tmp"))
    # segmentation off: the switch port sees wire-size datagrams, not GSO super-packets
    spec = TestbedSpec(hosts=2, name="dlcp-diss", segmentation=False)
    tb = Testbed.up(spec, state_root=root)
    ranks: list[Rank] = []
    try:
        tb.start_daemons({"timing": {"timeout": 20.0}, "daemon": {"metrics_port": 0}})
        hosts = [{"addresses": [tb.address(i)], "udp_port": spec.udp_port} for i in range(2)]
        for i in range(2):
            ranks.append(Rank(str(tb.hosts[i].socket), f"dlcp-diss{os.getpid()}-{i}"))
            ranks[i].client.join(job=JOB, key=KEY, hosts=hosts, me=i, local_ranks=1)
        yield tb, ranks
    finally:
        for r in ranks:
            r.close()
        tb.down()
        shutil.rmtree(root, ignore_errors=True)
        left = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
        assert not [n for n in left if n.startswith("dlcp-diss")]


def _start_tcpdump(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 10
    while b"listening on" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            pytest.fail(f"tcpdump did not start: {log.read_text(errors='replace')}")
        time.sleep(0.05)
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # tcpdump flushes and exits
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.netns
def test_capture_of_real_rounds_decodes(
    testbed_job: tuple[Any, list[Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.daemons import submit

    tb, ranks = testbed_job
    cap = tmp_path / "run.pcap"
    argv = ["ip", "netns", "exec", tb.switch_netns, "tcpdump", "-n", "-U", "-Z", "root"]
    argv += ["--immediate-mode"]  # else packets still in the ring are lost at SIGINT
    argv += ["-i", tb.hosts[0].switch_ports[0], "-w", str(cap), "udp", "port", str(DEFAULT_PORT)]
    proc = _start_tcpdump(argv, tmp_path / "tcpdump.log")
    try:
        rng = np.random.default_rng(3)
        for rnd, n in ((0, 1000), (1, 20000)):
            xs = [rng.standard_normal(n).astype(np.float32) for _ in ranks]
            waits = [
                submit(r, job=JOB, round=rnd, bucket=0, lanes=x, shards=2, timeout=60)
                for r, x in zip(ranks, xs, strict=True)
            ]
            for res in (w() for w in waits):
                np.testing.assert_array_equal(res.sums, xs[0] + xs[1])
        time.sleep(0.5)  # the last ACKs cross the port
    finally:
        _stop(proc)
    lines = _json_lines(capsys, [str(cap)])
    frames = rdpcap(str(cap))
    udp = [(i, f) for i, f in enumerate(frames, 1) if UDP in f]
    assert len(lines) == len(udp) > 0
    for line, (i, f) in zip(lines, udp, strict=True):
        assert line["frame"] == i and line["reject"] is None
        assert isinstance(line["dscp"], int)
        assert DLCP in f, f.summary()
        d = f[DLCP]
        got = (PacketType(d.type).name, d.job, d.round, d.sender)
        assert got == (line["type"], line["job"], line["round"], line["sender"])
    data = [x for x in lines if x["type"] == "DATA"]
    assert {x["round"] for x in data} == {0, 1} and {x["job"] for x in data} == {JOB}
    assert {x["src"].split(":")[0] for x in lines} == {tb.address(0), tb.address(1)}
