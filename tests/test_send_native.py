"""The send path with its C parts (`_keys.by_path`, `_keys.take`/`unqueue`/
`Fifo`, `_udp.send_gso`) puts the same datagrams on the wire as with the
Python definitions (DLCP_NATIVE_KEYS=0 DLCP_NATIVE_SEND=0): the same random
work (several shards, both legs, classes 1-7, droppable packets, DONEs,
NACKs of both legs and the retransmissions they ask for, pacing, a path that
goes down) through an outbox with two paths on loopback; each receiving
socket reads every datagram with its TOS byte. Bytes, TOS, destination and
order per path, and the outbox's counters and per-path tracking, are
compared. Each way runs in a process of its own (the switches are read at
import)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlcp.core.layout import Layout
from dlcp.core.pathhealth import HealthConfig
from dlcp.core.rate import RateConfig
from dlcp.daemon import packet_keys
from dlcp.daemon.outbox import Outbox, Peer
from dlcp.daemon.transport import UdpPath
from dlcp.policies import from_config
from dlcp.wire import Codec, Flags, Header, PacketType, decode, encode

if packet_keys._keys is None and os.environ.get("DLCP_ALLOW_NO_NATIVE") == "1":
    pytest.skip("dlcp.daemon._keys is not built (DLCP_ALLOW_NO_NATIVE=1)", allow_module_level=True)
_keys = packet_keys._keys
assert _keys is not None, "dlcp.daemon._keys was not built: pip install -e . builds it"

KEY = bytes(range(32))
JOB, ROUND = 5, 2
SHARDS = 4
IP_RECVTOS = 13
ROOT = Path(__file__).resolve().parents[1]


def _packets(lay: Layout, shard: int, rng: random.Random, result: bool) -> list[tuple[bytes, int]]:
    """A shard's DATA (or RESULT) packets with their classes; some droppable."""
    out = []
    ranges = (
        lay.shard_results(shard)
        if result
        else [lay.packet_range(i) for i in lay.shard_packets(shard)]
    )
    for off, count in ranges:
        drop = not result and rng.random() < 0.15
        cls = 7 if drop else rng.choice((1, 2, 2, 3, 5))
        h = Header(
            PacketType.RESULT if result else PacketType.DATA, JOB, ROUND, 1,
            flags=Flags.DROPPABLE if drop else Flags.NONE, priority=cls, shard=shard,
            sender=0, contributors=2 if result else 1, offset=off, count=count,
            total=lay.total,
        )  # fmt: skip
        payload = np.full(count, off % 251, np.float32).tobytes()
        out.append((encode(h, payload, KEY), cls))
    return out


def _done(lay: Layout, shard: int, result: bool) -> bytes:
    flags = Flags.LAST | (Flags.RESULT_LEG if result else Flags.NONE)
    h = Header(PacketType.DONE, JOB, ROUND, 1, flags=flags, priority=0, shard=shard,
               sender=0, total=lay.total)  # fmt: skip
    return encode(h, b"", KEY)


def _nack(lay: Layout, shard: int, indices: list[int], result: bool) -> bytes:
    h = Header(PacketType.NACK, JOB, ROUND, 1,
               flags=Flags.RESULT_LEG if result else Flags.NONE, shard=shard, sender=1,
               count=len(indices), total=lay.total)  # fmt: skip
    return encode(h, np.asarray(indices, ">u4").tobytes(), KEY)


def _resent(dgram: bytes) -> bytes:
    h, payload = decode(dgram, {JOB: KEY})
    return encode(replace(h, flags=h.flags | Flags.RETRANSMIT, priority=1), bytes(payload), KEY)


def _receivers() -> tuple[list[socket.socket], int]:
    """Sockets on 127.0.0.1 and 127.0.0.2 with one port, reading TOS."""
    for _ in range(50):
        a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        a.bind(("127.0.0.1", 0))
        port = a.getsockname()[1]
        b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            b.bind(("127.0.0.2", port))
        except OSError:
            a.close()
            b.close()
            continue
        for s in (a, b):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 20)
            s.setsockopt(socket.IPPROTO_IP, IP_RECVTOS, 1)
            s.setblocking(False)
        return [a, b], port
    raise RuntimeError("no port free on both 127.0.0.1 and 127.0.0.2")


def _drain(rx: list[socket.socket], log: list[list[Any]]) -> None:
    for p, s in enumerate(rx):
        while True:
            try:
                data, anc, _, _ = s.recvmsg(1 << 16, socket.CMSG_SPACE(4))
            except BlockingIOError:
                break
            tos = anc[0][2][0] if anc else -1
            log[p].append([hashlib.sha1(data).hexdigest()[:16], tos, data[3]])


def scenario(seed: int) -> dict[str, Any]:
    """The random work; what went out and the counters after it."""
    rng = random.Random(seed)
    rx, port = _receivers()
    paths = [UdpPath(f"127.0.0.{1 + p}", 0) for p in range(2)]
    ob = Outbox(
        paths,
        dscp=(48, 40, 34, 26, 18, 10, 0, 8),
        rate=RateConfig(initial_rate_bps=2e9, min_rate_bps=1e8),
        pacing=True,
        balancer_factory=lambda: from_config("balance", "spray"),
        health=HealthConfig(),
    )
    peer: Peer = ob.peer(("127.0.0.1", "127.0.0.2"), port, 0.0)
    lay = Layout(SHARDS * 300 * 352, Codec.FP32, SHARDS)
    log: list[list[Any]] = [[], []]
    now = 0.0
    sent: dict[tuple[int, bool], list[bytes]] = {}

    def flush(steps: int = 3) -> None:
        nonlocal now
        for _ in range(steps):
            now += 0.0005
            ob.flush(now)
            _drain(rx, log)

    for shard in range(SHARDS):
        for result in (False, True):
            if rng.random() < 0.3 and (shard, result) != (0, False):
                continue
            work = _packets(lay, shard, rng, result)
            sent[(shard, result)] = [dg for dg, _ in work]
            dgs = [dg for dg, _ in work] + [_done(lay, shard, result)] * 2
            ob.push_many(peer, dgs, [c for _, c in work] + [0, 0])
            flush(rng.randrange(1, 4))
    for turn in range(6):
        if turn == 3:  # path 0 goes down: its urgent datagrams again on path 1
            peer.usable = [False, True]
            ob.path_down(peer, 0, now)
        for (shard, result), dgs in sent.items():
            lost = sorted(rng.sample(range(len(dgs)), rng.randrange(0, 12)))
            nack = _nack(lay, shard, lost, result)
            h, _ = decode(nack, {JOB: KEY})
            ob.on_nack(peer, h, memoryview(nack), shards=SHARDS, payload=lay.payload, now=now)
            ob.on_loss(peer, len(lost), now)
            # the retransmissions (a DONE too, sometimes) and the NACK's answer
            for i in lost:
                ob.push(peer, _resent(dgs[i]), 1)
                if rng.random() < 0.2:  # asked for twice while queued: a repeat
                    ob.push(peer, _resent(dgs[i]), 1)
            if rng.random() < 0.3:
                ob.push(peer, _done(lay, shard, result), 0)
        flush(rng.randrange(1, 5))
    for _ in range(400):
        if not ob.queued():
            break
        flush(1)
    for s in rx:
        s.close()
    new, old = peer.sent_paths.as_dicts()
    return {
        "wire": log,
        "queued": ob.queued(),
        "repeats": ob.repeats,
        "resent_on_down": ob.resent_on_down,
        "sent_packets": sorted([list(k), v] for k, v in peer.sent_packets.items()),
        "sent_bytes": sorted([list(k), v] for k, v in peer.sent_bytes.items()),
        "paths": [[ps.sent, ps.lost, ps.loss_rate] for ps in peer.paths],
        "rates": [c.rate_bps for c in peer.rate.paths],
        "tracked": sorted([k.hex(), v] for k, v in new.items()),
        "tracked_old": sorted([k.hex(), v] for k, v in old.items()),
        "live": peer.sent_paths.live,
        "shard_paths": [[k.hex(), v] for k, v in peer.shard_paths.items()],
        "recent": {p: len(d) for p, d in peer.recent.items()},
        "oversize": [p.oversize_drops for p in paths],
    }


def _run(seed: int, native: bool) -> dict[str, Any]:
    flag = "1" if native else "0"
    env = os.environ | {
        "DLCP_NATIVE_KEYS": flag,
        "DLCP_NATIVE_SEND": flag,
        "PYTHONPATH": str(ROOT),
    }
    out = subprocess.run(
        [sys.executable, __file__, str(seed)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_the_c_send_path_puts_the_python_datagrams_on_the_wire() -> None:
    for seed in (1, 2):
        want = _run(seed, native=False)
        got = _run(seed, native=True)
        assert want["wire"] == got["wire"], seed
        for field in want:
            assert got[field] == want[field], (seed, field)
        # the work did what it is meant to: both paths, several classes,
        # losses charged, retransmissions, repeats, and path 0 down at the end
        w0, w1 = want["wire"]
        assert len(w0) > 800 and len(w1) > 800
        assert want["repeats"] > 0
        assert len({tos for _, tos, _ in w0}) >= 4
        assert sum(lost for _, lost, _ in want["paths"]) > 10
        assert want["resent_on_down"] > 0 and want["queued"] == 0
        assert want["tracked"] and want["live"] == len(want["tracked"])


def test_by_path_in_c_is_the_python_definition() -> None:
    rng = random.Random(3)
    lay = Layout(SHARDS * 40 * 352, Codec.FP32, SHARDS)
    dgs = [dg for s in range(SHARDS) for dg, _ in _packets(lay, s, rng, s % 2 == 1)]
    dgs += [_done(lay, 0, False), _nack(lay, 1, [1, 2], True)]
    for trial in range(30):
        batch = rng.sample(dgs, rng.randrange(0, 70))
        if trial % 3 == 0:
            batch.sort(key=lambda dg: dg[28:32])
        n = rng.randrange(1, 4)
        assign = [rng.randrange(n) for _ in batch]
        want = packet_keys._py_by_path(batch, assign, n)
        assert _keys.by_path(batch, assign, n) == want
        assert _keys.by_path([memoryview(dg) for dg in batch], assign, n)[2:] == want[2:]
        for p, (g, x) in enumerate(zip(want[0], want[1], strict=True)):
            assert (g is None) == (p not in assign)
            assert g is None or g == [batch[i] for i in x]


def test_by_path_refuses_bad_input() -> None:
    dg = _done(Layout(1000, Codec.FP32, SHARDS), 0, False)
    for args, error in (
        (([dg, dg], [0], 2), ValueError),  # lengths differ
        (([dg], [2], 2), ValueError),  # path out of range
        (([dg], [-1], 2), ValueError),
        (([dg], [0], 0), ValueError),  # no paths
        (([dg], [0], 257), ValueError),
        (([dg[:35]], [0], 2), ValueError),  # shorter than the header fields
        (([dg], ["0"], 2), TypeError),
        (([1], [0], 2), TypeError),  # not a buffer
        ((dg, [0], 2), ValueError),  # bytes: a sequence of ints, not datagrams
    ):
        for f in (_keys.by_path, packet_keys._py_by_path):
            with pytest.raises(error):
                f(*args)


if __name__ == "__main__":
    print(json.dumps(scenario(int(sys.argv[1]))))
