"""Datagram fuzzing: a mutation corpus, an oracle, and a harness against running daemons.

Used by tests/test_fuzz.py (in-process decoders and the CI/slow daemon runs)
and runnable on its own:

    python -m tests.fuzz_daemon --datagrams 1000000 --seed 1 --json fuzz.json

which starts three dlcpd on 127.0.0.1..3 with a job all-reducing between them,
sends the datagrams to their UDP ports from loopback addresses while the job
runs, and checks that every datagram was counted under the reject reason the
decoder predicts, that no daemon died or stalled, and that every round of the
job summed exactly.

The corpus (`Mutator`): random bytes, and valid packets of every type and
codec (MAC'd with the job's key) mutated by bit flips, boundary values in each
header field, truncation, extension, splicing, wrong keys, zeroed MACs and
equal-sized UDP GSO trains. A mutation always changes at least one byte of a
valid packet, so nothing it makes can authenticate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import struct
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlcp.codecs.lanes import WIDE
from dlcp.core.layout import lanes_per_packet
from dlcp.errors import WireError
from dlcp.wire.header import (
    HEADER_SIZE,
    MAC_OFFSET,
    MAX_DATAGRAM,
    Codec,
    Flags,
    Header,
    PacketType,
    compute_mac,
    decode,
    encode,
    lane_bytes,
)
from dlcp.wire.mac import MacKey

__all__ = [
    "FIELDS",
    "Blaster",
    "JobRunner",
    "Mutator",
    "expected_reason",
    "metric_rejects",
    "run_daemon_fuzz",
    "templates",
    "udp_drops",
]

# (name, offset, width in bytes) of the 48 MAC-covered header bytes
FIELDS: tuple[tuple[str, int, int], ...] = (
    ("magic", 0, 2),
    ("version", 2, 1),
    ("type", 3, 1),
    ("flags", 4, 1),
    ("priority", 5, 1),
    ("codec", 6, 1),
    ("reserved", 7, 1),
    ("job", 8, 4),
    ("round", 12, 4),
    ("bucket", 16, 4),
    ("shard", 20, 2),
    ("layer", 22, 2),
    ("sender", 24, 2),
    ("contributors", 26, 2),
    ("offset", 28, 4),
    ("count", 32, 4),
    ("total", 36, 4),
    ("param", 40, 4),
    ("aux", 44, 4),
    ("mac", 48, 16),
)
_F32_SPECIAL = (
    struct.pack("!f", float("nan")),
    struct.pack("!f", float("inf")),
    struct.pack("!f", float("-inf")),
    b"\x7f\x80\x00\x01",  # signalling NaN
    b"\x80\x00\x00\x00",  # -0.0
    b"\x00\x00\x00\x01",  # denormal
)


def templates(job: int, key: MacKey, rnd: int = 1_000_000) -> list[bytes]:
    """Valid packets of every type and codec for `job` (MAC'd with `key`).

    Round numbers far from any a test runs, so that even a verbatim copy could
    not touch a live round (mutations never leave one verbatim anyway).
    """
    out: list[bytes] = []
    rng = random.Random(job ^ rnd)
    for codec in Codec:
        # fp32 352, fp16 704, thc8 1024, thc4 2048, fft 1408, ...; THC's narrow
        # sums (result packets only: data ones must be refused) as THC's
        per = lanes_per_packet(WIDE.get(codec, codec))
        for ptype, flags in (
            (PacketType.DATA, Flags.NONE),
            (PacketType.DATA, Flags.DROPPABLE | Flags.LAST),
            (PacketType.DATA, Flags.SUMMED | Flags.RETRANSMIT),
            (PacketType.RESULT, Flags.NONE),
        ):
            for count in (1, per // 2, per):
                h = Header(
                    type=ptype,
                    job=job,
                    round=rnd,
                    bucket=rng.randrange(4),
                    flags=flags,
                    priority=rng.randrange(8),
                    codec=codec,
                    shard=rng.randrange(3),
                    layer=rng.randrange(100),
                    sender=rng.randrange(3),
                    contributors=rng.randrange(1, 4),
                    offset=per * rng.randrange(3),
                    count=count,
                    total=per * 3 + count,
                    param=rng.uniform(0, 2),
                    aux=rng.getrandbits(32),
                )
                summed = ptype == PacketType.RESULT or bool(flags & Flags.SUMMED)
                out.append(encode(h, rng.randbytes(lane_bytes(codec, count, summed)), key))
    for ptype, flags, count, plen in (
        (PacketType.NACK, Flags.NONE, 5, 20),
        (PacketType.NACK, Flags.RESULT_LEG | Flags.NEED_MANIFEST, 0, 0),
        (PacketType.DONE, Flags.LAST, 90, 12),
        (PacketType.DONE, Flags.RESULT_LEG | Flags.LAST, 0, 0),
        (PacketType.ACK, Flags.RESULT_LEG, 0, 0),
        (PacketType.CONTROL, Flags.NONE, 17, 17),
    ):
        h = Header(
            type=ptype,
            job=job,
            round=rnd,
            bucket=rng.randrange(4),
            flags=flags,
            shard=rng.randrange(3),
            sender=rng.randrange(3),
            count=count,
            total=1000,
            param=0.05,
        )
        out.append(encode(h, rng.randbytes(plen), key))
    return out


class Mutator:
    """Deterministic stream of hostile datagrams from a seed and valid templates."""

    def __init__(self, seeds: Sequence[bytes], seed: int = 0) -> None:
        if not seeds:
            raise ValueError("need at least one template")
        self.seeds = list(seeds)
        self._valid = frozenset(self.seeds)
        self.rng = random.Random(seed)
        self.kinds: Counter[str] = Counter()
        self._ops: tuple[tuple[str, Callable[[bytes], bytes], int], ...] = (
            ("random", self._random, 10),
            ("bitflip", self._bitflip, 14),
            ("header_bitflip", self._header_bitflip, 14),
            ("field", self._field, 24),
            ("truncate", self._truncate, 8),
            ("extend", self._extend, 6),
            ("splice", self._splice, 5),
            ("wrong_key", self._wrong_key, 8),
            ("zero_mac", self._zero_mac, 3),
            ("other_job", self._other_job, 4),
            ("mac_only_header", self._mac_only_header, 4),
        )
        self._names = [o[0] for o in self._ops]
        self._funcs = [o[1] for o in self._ops]
        self._weights = [o[2] for o in self._ops]

    def one(self) -> bytes:
        rng = self.rng
        i = rng.choices(range(len(self._funcs)), self._weights)[0]
        base = self.seeds[rng.randrange(len(self.seeds))]
        dg = self._funcs[i](base)
        while dg in self._valid:  # never a verbatim valid packet (a splice can make one)
            dg = self._bitflip(dg)
        self.kinds[self._names[i]] += 1
        return dg

    def many(self, n: int) -> list[bytes]:
        return [self.one() for _ in range(n)]

    def gso_train(self, max_bytes: int = 60_000) -> list[bytes]:
        """Equal-sized mutated datagrams (the last may be shorter) for one UDP_SEGMENT send."""
        rng = self.rng
        size = rng.choice((64, 65, 100, 412, 1000, 1472, rng.randrange(64, 1473)))
        k = rng.randrange(2, min(64, max_bytes // size) + 1)
        train = []
        for j in range(k):
            dg = self.one()
            n = size if j < k - 1 else rng.randrange(1, size + 1)
            dg = dg[:n] if len(dg) >= n else dg + rng.randbytes(n - len(dg))
            while dg in self._valid:
                dg = self._header_bitflip(dg) if n >= HEADER_SIZE else dg[:-1]
            train.append(dg)
        self.kinds["gso"] += k
        return train

    # -- mutations --------------------------------------------------------
    def _random(self, base: bytes) -> bytes:
        rng = self.rng
        r = rng.random()
        if r < 0.3:
            n = rng.randrange(0, HEADER_SIZE + 1)
        elif r < 0.97:
            n = rng.randrange(HEADER_SIZE, 1501)
        elif r < 0.995:
            n = rng.randrange(1501, 9001)
        else:
            n = rng.choice((MAX_DATAGRAM, MAX_DATAGRAM - 1, 65_000))
        blob = bytearray(rng.randbytes(n))
        if n >= 4 and rng.random() < 0.5:  # a plausible prefix gets past the magic check
            blob[0:4] = base[0:4]
        return bytes(blob)

    def _bitflip(self, base: bytes) -> bytes:
        rng = self.rng
        b = bytearray(base)
        for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b)

    def _header_bitflip(self, base: bytes) -> bytes:
        b = bytearray(base)
        i = self.rng.randrange(HEADER_SIZE)
        b[i] ^= 1 << self.rng.randrange(8)
        return bytes(b)

    def _field(self, base: bytes) -> bytes:
        rng = self.rng
        _name, off, width = FIELDS[rng.randrange(len(FIELDS))]
        top = (1 << (8 * width)) - 1
        old = int.from_bytes(base[off : off + width], "big")
        choices = [0, 1, top, top - 1, top >> 1, (top >> 1) + 1, old + 1, old - 1, old ^ top]
        if width == 4:
            choices += [int.from_bytes(v, "big") for v in _F32_SPECIAL]
        value = rng.choice(choices) if rng.random() < 0.8 else rng.getrandbits(8 * width)
        value &= top
        if value == old:
            value = old ^ 1
        return base[:off] + value.to_bytes(width, "big") + base[off + width :]

    def _truncate(self, base: bytes) -> bytes:
        return base[: self.rng.randrange(len(base))]

    def _extend(self, base: bytes) -> bytes:
        rng = self.rng
        return base + rng.randbytes(rng.choice((1, 2, 3, 4, rng.randrange(1, 200))))

    def _splice(self, base: bytes) -> bytes:
        other = self.seeds[self.rng.randrange(len(self.seeds))]
        cut = self.rng.choice((HEADER_SIZE, MAC_OFFSET, self.rng.randrange(len(base) + 1)))
        out = base[:cut] + other[cut:]
        return out if out != base else self._bitflip(base)

    def _wrong_key(self, base: bytes) -> bytes:
        """Any header change, re-MAC'd with a key that is not the job's."""
        b = self._field(base) if self.rng.random() < 0.7 else base
        if len(b) < HEADER_SIZE:
            return b
        key = self.rng.randbytes(32)
        return b[:MAC_OFFSET] + compute_mac(key, b[:MAC_OFFSET], b[HEADER_SIZE:]) + b[HEADER_SIZE:]

    def _zero_mac(self, base: bytes) -> bytes:
        return base[:MAC_OFFSET] + bytes(16) + base[HEADER_SIZE:]

    def _other_job(self, base: bytes) -> bytes:
        """A well-formed packet of a job nobody joined, MAC'd with its own key."""
        job = self.rng.getrandbits(32).to_bytes(4, "big")
        b = base[:8] + job + base[12:MAC_OFFSET]
        key = self.rng.randbytes(32)
        return b + compute_mac(key, b, base[HEADER_SIZE:]) + base[HEADER_SIZE:]

    def _mac_only_header(self, base: bytes) -> bytes:
        """Payload changed, MAC still of the original (a common forgery attempt)."""
        if len(base) == HEADER_SIZE:
            return base + b"\0"
        p = bytearray(base[HEADER_SIZE:])
        p[self.rng.randrange(len(p))] ^= 0xFF
        return base[:HEADER_SIZE] + bytes(p)


def expected_reason(
    datagram: bytes, keys: dict[int, MacKey], members: dict[int, frozenset[str]], src: str
) -> str:
    """The reject label a daemon must count for `datagram` from `src` (the oracle).

    Mirrors dlcpd's receive path: a datagram naming a job the daemon is in but
    coming from an address outside that job is `bad_address`; anything else
    goes through the decoder. "accepted" means it would authenticate.
    """
    if len(datagram) >= HEADER_SIZE:
        job = int.from_bytes(datagram[8:12], "big")
        if job in members and src not in members[job]:
            return "bad_address"
    try:
        decode(datagram, keys)
    except WireError as exc:
        return exc.reason.label
    return "accepted"


def udp_drops(address: str, port: int) -> int | None:
    """Kernel receive-queue drops of the UDP socket bound to address:port (this netns)."""
    a = socket.inet_aton(address)
    local = f"{struct.unpack('<I', a)[0]:08X}:{port:04X}"
    try:
        lines = Path("/proc/net/udp").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        cols = line.split()
        if len(cols) >= 13 and cols[1] == local:
            return int(cols[-1])
    return None


_UDP_SEGMENT = 103


@dataclass
class Blaster:
    """Sends datagrams from one source address, in chunks the receiver can keep up with.

    `counted()` returns the receiver's running total of rejects; after each
    chunk the blaster waits until it has grown by the chunk (so the socket
    buffer never overflows and every datagram is accounted for) or
    `stall_s` passes, which it reports as a stall.
    """

    src: str
    dest: tuple[str, int]
    counted: Callable[[], int]
    stall_s: float = 120.0
    sent: int = 0
    gso_sends: int = 0
    stalls: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((self.src, 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)

    def close(self) -> None:
        self.sock.close()

    def send(self, datagrams: Sequence[bytes], trains: Sequence[Sequence[bytes]] = ()) -> None:
        before = self.counted()
        n = 0
        for dg in datagrams:
            self._sendto(dg)
            n += 1
        for train in trains:
            size = len(train[0])
            try:
                self.sock.sendmsg(
                    [b"".join(train)],
                    [(socket.SOL_UDP, _UDP_SEGMENT, struct.pack("@H", size))],
                    0,
                    self.dest,
                )
                self.gso_sends += 1
            except OSError:  # no GSO here: one by one
                for dg in train:
                    self._sendto(dg)
            n += len(train)
        self.sent += n
        deadline = time.monotonic() + self.stall_s
        while (got := self.counted() - before) < n:
            if time.monotonic() > deadline:
                self.stalls.append(f"{self.dest}: {got} of {n} counted after {self.stall_s}s")
                return
            time.sleep(0.002)

    def _sendto(self, dg: bytes) -> None:
        while True:
            try:
                self.sock.sendto(dg, self.dest)
                return
            except BlockingIOError:
                time.sleep(0.001)
            except ConnectionRefusedError:  # ICMP from an earlier datagram: send again
                continue


class JobRunner(threading.Thread):
    """All-reduces fp32 buckets through `ranks` until stopped; checks every sum exactly."""

    def __init__(
        self,
        ranks: Sequence[Any],
        job: int,
        *,
        lanes: int = 30_000,
        seed: int = 0,
        first_round: int = 0,
        timeout: float = 120.0,
        pause: float = 0.02,
    ) -> None:
        super().__init__(name="dlcp-fuzz-job", daemon=True)
        self.ranks = list(ranks)
        self.job = job
        self.lanes = lanes
        self.rng = np.random.default_rng(seed)
        self.round = first_round
        self.timeout = timeout
        self.pause = pause
        self.stop = threading.Event()
        self.rounds_ok = 0
        self.failures: list[str] = []

    def run(self) -> None:
        from tests.daemons import submit

        while not self.stop.is_set():
            xs = [self.rng.standard_normal(self.lanes).astype(np.float32) for _ in self.ranks]
            expected = xs[0].copy()
            for x in xs[1:]:
                expected += x  # the owner sums in sender order
            try:
                waits = [
                    submit(
                        r,
                        job=self.job,
                        round=self.round,
                        bucket=0,
                        lanes=x,
                        shards=len(self.ranks),
                        timeout=self.timeout,
                    )
                    for r, x in zip(self.ranks, xs, strict=True)
                ]
                results = [w() for w in waits]
            except Exception as exc:  # recorded; the test fails on it
                self.failures.append(f"round {self.round}: {type(exc).__name__}: {exc}")
                return
            for i, res in enumerate(results):
                if res.sums.tobytes() != expected.tobytes() or res.reply["lost_lanes"]:
                    self.failures.append(f"round {self.round} rank {i}: sums differ")
            self.rounds_ok += 1
            self.round += 1
            self.stop.wait(self.pause)


def metric_rejects(port: int) -> Counter[str]:
    """dlcp_rejected_packets_total by reason, scraped from a daemon's /metrics."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: Counter[str] = Counter()
    for m in re.finditer(r'^dlcp_rejected_packets_total\{reason="(\w+)"\} (\S+)$', text, re.M):
        out[m.group(1)] += int(float(m.group(2)))
    return out


def _rejects_total(client: Any) -> int:
    return int(sum(client.status()["rejects"].values()))


def run_daemon_fuzz(
    tmp: Path,
    count: int,
    *,
    seed: int = 1,
    chunk: int = 2000,
    job: int = 0xF0220,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Fuzz three loopback daemons with `count` datagrams while a job all-reduces.

    Returns the figures; the caller asserts. Keys: sent, by_reason (actual
    daemon counts), predicted (oracle), mismatch, stalls, drops (kernel),
    rounds (job rounds completed), job_failures, daemons_alive, seconds.
    """
    from dlcp.shim.client import DaemonClient
    from tests.daemons import Rank, hosts_of, loopback_daemons, wire_key

    key = os.urandom(32)
    t0 = time.monotonic()
    with loopback_daemons(tmp, 3, {"timing": {"timeout": 60.0}}) as ds:
        hosts = hosts_of(ds)
        ranks = [Rank(d, f"dlcp-fz{os.getpid()}-{i}", 4 << 20) for i, d in enumerate(ds)]
        watchers = [DaemonClient(d.socket) for d in ds]
        blasters: list[Blaster] = []
        runner = JobRunner(ranks, job, seed=seed)
        try:
            for i, r in enumerate(ranks):
                r.join(job, key, hosts, i)
            keys = {job: wire_key(key)}  # signed as the daemons sign (their default MAC)
            mutator = Mutator(templates(job, keys[job]), seed)
            addrs = [d.address for d in ds]
            outsider = "127.0.0.9"
            before = [w.status()["rejects"] for w in watchers]
            scraped0 = [metric_rejects(d.metrics_port) for d in ds]
            drops0 = [udp_drops(d.address, d.port) or 0 for d in ds]
            predicted: Counter[str] = Counter()
            # per target daemon: its job members (the other daemons' addresses)
            # and four sources: both members, its own address, an outsider
            targets: list[tuple[dict[int, frozenset[str]], list[Blaster]]] = []
            for t, d in enumerate(ds):
                members = {job: frozenset(a for j, a in enumerate(addrs) if j != t)}
                w = watchers[t]
                srcs = [addrs[(t + 1) % 3], addrs[(t + 2) % 3], d.address, outsider]
                bl = [Blaster(s, (d.address, d.port), lambda w=w: _rejects_total(w)) for s in srcs]
                blasters += bl
                targets.append((members, bl))
            runner.start()
            sent = 0
            step = 0
            while sent < count:
                members, bl = targets[step % 3]
                b = bl[mutator.rng.choices(range(4), (40, 40, 10, 10))[0]]
                n = min(chunk, count - sent)
                trains: list[list[bytes]] = []
                if step % 5 == 4 and n > 200:
                    while sum(map(len, trains)) < n // 4:
                        trains.append(mutator.gso_train())
                k = n - sum(map(len, trains))
                if k < 0:
                    trains, k = [], n
                dgs = mutator.many(k)
                for dg in [*dgs, *(dg for tr in trains for dg in tr)]:
                    predicted[expected_reason(dg, keys, members, b.src)] += 1
                b.send(dgs, trains)
                sent += n
                step += 1
                if progress is not None and step % 50 == 0:
                    progress(f"{sent}/{count} datagrams, {runner.rounds_ok} job rounds")
            # let the job run a few more rounds after the storm
            target = runner.rounds_ok + 3
            deadline = time.monotonic() + 120
            while runner.rounds_ok < target and not runner.failures and runner.is_alive():
                if time.monotonic() > deadline:
                    runner.failures.append("job made no progress after the fuzzing")
                    break
                time.sleep(0.05)
            runner.stop.set()
            runner.join(180)
            after = [w.status()["rejects"] for w in watchers]
            scraped: Counter[str] = Counter()
            for d, m0 in zip(ds, scraped0, strict=True):
                m1 = metric_rejects(d.metrics_port)
                scraped.update({r: m1[r] - m0.get(r, 0) for r in m1 if m1[r] - m0.get(r, 0)})
            by_reason: Counter[str] = Counter()
            for b4, a4 in zip(before, after, strict=True):
                for r, v in a4.items():
                    if v - b4.get(r, 0):
                        by_reason[r] += v - b4.get(r, 0)
            drops = sum(
                (udp_drops(d.address, d.port) or 0) - d0 for d, d0 in zip(ds, drops0, strict=True)
            )
            alive = [d.proc is not None and d.proc.poll() is None for d in ds]
            mismatch = {
                r: (by_reason.get(r, 0), predicted.get(r, 0))
                for r in set(by_reason) | set(predicted)
                if by_reason.get(r, 0) != predicted.get(r, 0)
            }
            return {
                "sent": sum(b.sent for b in blasters),
                "gso_sends": sum(b.gso_sends for b in blasters),
                "by_reason": dict(sorted(by_reason.items())),
                "metrics_by_reason": dict(sorted(scraped.items())),
                "predicted": dict(sorted(predicted.items())),
                "mismatch": mismatch,
                "mutations": dict(sorted(mutator.kinds.items())),
                "stalls": [s for b in blasters for s in b.stalls],
                "kernel_drops": drops,
                "rounds": runner.rounds_ok,
                "job_failures": runner.failures,
                "daemons_alive": all(alive),
                "seconds": round(time.monotonic() - t0, 1),
            }
        finally:
            runner.stop.set()
            for b in blasters:
                b.close()
            for w in watchers:
                with contextlib.suppress(Exception):
                    w.close()
            for r in ranks:
                with contextlib.suppress(Exception):
                    r.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datagrams", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--chunk", type=int, default=2000)
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dlcp-fuzz-") as d:
        report = run_daemon_fuzz(
            Path(d),
            args.datagrams,
            seed=args.seed,
            chunk=args.chunk,
            progress=lambda m: print(m, file=sys.stderr, flush=True),
        )
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    ok = (
        report["metrics_by_reason"] == report["by_reason"]
        and not report["mismatch"]
        and not report["stalls"]
        and not report["job_failures"]
        and report["daemons_alive"]
        and report["by_reason"].get("accepted", 0) == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
