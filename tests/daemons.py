"""Test helpers: real dlcpd processes on loopback, and a small shim-protocol client."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlcp.core.layout import Layout
from dlcp.daemon.config import Config
from dlcp.ipc import CODEC_BY_NAME
from dlcp.shim.client import DaemonClient, SealedSegment, Segment
from dlcp.wire.header import Codec, lane_bytes
from dlcp.wire.mac import MacKey, mac_state

ROOT = Path(__file__).resolve().parent.parent


def wire_key(key: bytes) -> MacKey:
    """`key` as the MAC state of daemons with the default `[network] mac`: what a
    test that crafts datagrams for a running daemon must sign them with."""
    return mac_state(key, Config().mac)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (bind(0), connections)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_HANDED_OUT: set[int] = set()


def _port(kind: socket.SocketKind, addresses: Sequence[str]) -> int:
    """A port free on every address, below the kernel's ephemeral range (so no
    connection or bind(0) of this or another test takes it between now and the
    daemon's bind), never handed out twice by this process."""
    lo = _ephemeral_low()
    top = lo - 1 if lo > 12000 else 65535
    for _ in range(200):
        port = random.randint(10000, top)
        if port in _HANDED_OUT:
            continue
        try:
            for addr in addresses:
                with socket.socket(socket.AF_INET, kind) as s:
                    s.bind((addr, port))
        except OSError:
            continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port")


def free_udp_port() -> int:
    """A UDP port free on 127.0.0.1..8, the loopback daemons' addresses."""
    return _port(socket.SOCK_DGRAM, [f"127.0.0.{i}" for i in range(1, 9)])


def free_tcp_port() -> int:
    return _port(socket.SOCK_STREAM, ["127.0.0.1"])


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def write_config(path: Path, sections: dict[str, dict[str, Any]]) -> None:
    lines = []
    for name, table in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")


@dataclass
class Daemon:
    index: int
    address: str
    port: int
    socket: str
    config: Path
    log: Path
    metrics_port: int
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)
    addresses: tuple[str, ...] = ()  # one a path (default: `address` alone)

    def __post_init__(self) -> None:
        self.addresses = self.addresses or (self.address,)

    def start(self, wait: float = 20.0) -> None:
        # the checkout first; packages installed beside the interpreter's stay reachable
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, **self.env}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dlcp.daemon", "--config", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + wait
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None:
                raise RuntimeError(f"dlcpd exited: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"dlcpd did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def client(self) -> DaemonClient:
        return DaemonClient(self.socket)


@contextlib.contextmanager
def loopback_daemons(
    tmp: Path,
    n: int,
    extra: dict[str, dict[str, Any]] | None = None,
    start: bool = True,
    paths: int = 1,
) -> Iterator[list[Daemon]]:
    """n daemons on 127.0.0.1..n, one UDP port, sockets and logs under tmp;
    with `paths` > 1, path p of daemon i is 127.0.p.(i + 1)."""
    port = free_udp_port()
    ds = []
    for i in range(n):
        d = Daemon(
            index=i,
            address=f"127.0.0.{i + 1}",
            port=port,
            socket=str(tmp / f"d{i}.sock"),
            config=tmp / f"d{i}.toml",
            log=tmp / f"d{i}.log",
            metrics_port=free_tcp_port(),
            addresses=tuple(f"127.0.{p}.{i + 1}" for p in range(paths)),
        )
        sections: dict[str, dict[str, Any]] = {
            "daemon": {
                "socket": d.socket,
                "metrics_address": "127.0.0.1",
                "metrics_port": d.metrics_port,
                "host_index": i,
            },
            "network": {"addresses": list(d.addresses), "udp_port": port},
        }
        for k, v in (extra or {}).items():
            sections[k] = {**sections.get(k, {}), **v}
        write_config(d.config, sections)
        ds.append(d)
    try:
        if start:
            for d in ds:
                d.start()
        yield ds
    except BaseException:
        # pytest shows what a failing test printed: the daemons' side of it
        for d in ds:
            if d.log.exists():
                print(f"--- {d.log.name} (rc {d.stop()}):\n{d.log.read_text()[-3000:]}")
        raise
    finally:
        for d in ds:
            d.stop()


OPEN_RANKS: set[Rank] = set()  # closed by conftest after each test, whatever happened


class Rank:
    """One rank's connection, segment and job, speaking the shim protocol."""

    def __init__(self, daemon: Daemon, name: str, size: int, *, sealed: bool = False) -> None:
        """`sealed`: the segment is a sealed memfd the daemon maps, else a named
        /dev/shm file it copies from and to."""
        self.client = DaemonClient(daemon.socket)
        try:
            self.info = self.client.hello()
            self.seg: Segment | SealedSegment = (SealedSegment if sealed else Segment)(name, size)
        except BaseException:
            self.client.close()
            raise
        OPEN_RANKS.add(self)
        try:
            self.client.segment(self.seg)
        except BaseException:
            self.close()
            raise

    def join(self, job: int, key: bytes, hosts: list[dict[str, Any]], me: int, **kw: Any) -> None:
        self.client.join(job=job, key=key, hosts=hosts, me=me, **kw)

    def close(self) -> None:
        """Idempotent; the segment goes (its /dev/shm file unlinked) even when
        the connection's close fails."""
        if self not in OPEN_RANKS:
            return
        OPEN_RANKS.discard(self)
        try:
            self.client.close()
        finally:
            self.seg.close()


def hosts_of(ds: Sequence[Daemon]) -> list[dict[str, Any]]:
    return [{"addresses": list(d.addresses), "udp_port": d.port} for d in ds]


@dataclass
class Result:
    sums: np.ndarray
    contributors: np.ndarray
    block_max: np.ndarray
    reply: dict[str, Any]


def submit(
    rank: Rank,
    *,
    job: int,
    round: int,
    bucket: int,
    lanes: np.ndarray,
    codec: str = "fp32",
    shards: int,
    bound: float = 0.0,
    layers: np.ndarray | None = None,
    norms: np.ndarray | None = None,
    base: int = 0,
    timeout: float = 60.0,
) -> Any:
    """Write lanes (+meta) at `base` in the rank's segment and submit; returns a
    callable that waits for the reply and reads the result."""
    wc = Codec(CODEC_BY_NAME[codec])
    raw = np.ascontiguousarray(lanes).view(np.uint8).ravel()
    total = raw.size * 8 // {0: 32, 1: 16, 2: 8, 3: 4}[int(wc)]
    lay = Layout(total, wc, shards, rank.info["payload"])
    P = lay.packets
    buf = rank.seg.buf
    off = base
    buf[off : off + raw.size] = raw.tobytes()
    data = [off, raw.size]
    off += raw.size
    meta = None
    if layers is not None or norms is not None:
        la = np.zeros(P, "<u2") if layers is None else np.asarray(layers, "<u2")
        no = np.zeros(P, "<f4") if norms is None else np.asarray(norms, "<f4")
        m = la.tobytes() + no.tobytes()
        buf[off : off + len(m)] = m
        meta = [off, len(m)]
        off += len(m)
    sb = lane_bytes(wc, total, True)
    out = [off, sb + 6 * P]
    fut = rank.client.submit(
        job=job,
        round=round,
        bucket=bucket,
        codec=codec,
        total=total,
        data=data,
        out=out,
        meta=meta,
        bound=bound,
    )

    def wait() -> Result:
        reply = fut.result(timeout)
        o = out[0]
        sums = np.frombuffer(bytes(buf[o : o + sb]), {0: "<f4", 1: "<f2"}.get(int(wc), "<u2"))
        contrib = np.frombuffer(bytes(buf[o + sb : o + sb + 2 * P]), "<u2")
        bmax = np.frombuffer(bytes(buf[o + sb + 2 * P : o + sb + 6 * P]), "<f4")
        return Result(sums, contrib, bmax, reply)

    return wait


def packet_norms(x: np.ndarray, shards: int, payload: int = 1408) -> np.ndarray:
    lay = Layout(x.size, Codec.FP32, shards, payload)
    return np.array(
        [np.linalg.norm(x[o : o + c]) for o, c in map(lay.packet_range, range(lay.packets))]
    )
