"""The shim's side of the daemon: one connection per rank on the Unix socket,
its requests (hello, segment, join, submit, leave, status) checked and
answered, its shared-memory segment taken over, its submitted lanes copied
and handed to the round lifecycle.

`Client` is one rank's connection; `ShimService` owns the connections
(`clients`) and whether new work is refused (`draining`); it is given the
config, the engine, the round lifecycle (which keeps the jobs and rounds the
requests join and submit to), the counters, the daemon's id and a callable
that answers "status".
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from dlcp import ipc
from dlcp.codecs.lanes import MAX_CONTRIBUTORS
from dlcp.core.buffers import SpareBuffers
from dlcp.core.engine import Engine
from dlcp.core.records import ALL_GATHER, ALLREDUCE, ROUND_KINDS
from dlcp.daemon.config import Config
from dlcp.daemon.jobs import HostAddr, LocalPart, parse_hosts
from dlcp.daemon.requests import RequestError, bad_request, float_field, int_field
from dlcp.daemon.shm import MAX_SEGMENT, MappedSegment, RankSegment
from dlcp.errors import LocalError
from dlcp.wire.header import Codec, lane_bytes

if TYPE_CHECKING:  # rounds.py imports Client from here
    from dlcp.daemon.rounds import RoundLifecycle

__all__ = ["INPUT_BUFFERS", "Client", "ShimService"]

log = logging.getLogger("dlcpd")

_UNION_BOUND = "the sketch's index union (codec union) is never droppable: its bound must be 0"

FD_TIMEOUT = 5.0  # seconds a rank has to send the memfd it announced
_INT_SIZE = array.array("i").itemsize
INPUT_BUFFERS = 4  # per rank: buffers of its submitted lanes kept for reuse


class Client:
    """One connection from a rank."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.segment: RankSegment | MappedSegment | None = None
        self.jobs: set[int] = set()
        self.pending = 0
        self.closed = False
        self.awaiting_fd: tuple[int, int] | None = None  # (request id, size) of a memfd segment
        # this rank's submitted lanes, copied into buffers reused across rounds
        self.inputs = SpareBuffers(INPUT_BUFFERS)

    def reply(self, rid: Any, **fields: Any) -> None:
        if self.closed:
            return
        try:
            self.writer.write(ipc.encode({"id": rid, "ok": True, **fields}))
        except (OSError, RuntimeError):
            self.closed = True

    def error(self, rid: Any, code: str, message: str) -> None:
        if self.closed:
            return
        try:
            self.writer.write(
                ipc.encode({"id": rid, "ok": False, "code": code, "error": message[:2000]})
            )
        except (OSError, RuntimeError):
            self.closed = True


class ShimService:
    """The shim protocol: requests from the ranks' connections."""

    def __init__(
        self,
        *,
        config: Config,
        engine: Engine,
        lifecycle: RoundLifecycle,
        counters: Counter[str],
        requests: Counter[tuple[str, str]],
        daemon_id: str,
        status: Callable[[], dict[str, Any]],
    ) -> None:
        self.config = config
        self.engine = engine
        self.lifecycle = lifecycle
        self.jobs = lifecycle.jobs  # read here; joined and left through `lifecycle`
        self.counters = counters
        self.requests = requests
        self.id = daemon_id
        self._status = status
        self.clients: set[Client] = set()
        self.draining = False  # joins and submits refused: the daemon is stopping

    def drain(self) -> None:
        self.draining = True

    # "status" is answered by the daemon's status view (`status.snapshot`)
    _OPS = ("hello", "segment", "join", "submit", "leave", "status")

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        client = Client(writer)
        self.clients.add(client)
        try:
            while True:
                try:
                    prefix = await reader.readexactly(4)
                    body = await reader.readexactly(ipc.decode_length(prefix))
                    req = ipc.decode_body(body)
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                except ipc.ProtocolError as exc:
                    client.error(None, "bad_request", str(exc))
                    self.requests[("framing", "bad_request")] += 1
                    break
                self._handle(client, req)
                if client.closed:
                    break
                await writer.drain()
                if client.awaiting_fd is not None:
                    await self._take_fd(client, reader, writer)
                    if client.closed:
                        break
        finally:
            self._drop_client(client)
            client.closed = True
            writer.close()

    def _drop_client(self, client: Client) -> None:
        if client not in self.clients:
            return
        self.clients.discard(client)
        self.lifecycle.drop_client(client)
        if client.segment is not None:
            client.segment.close()
            client.segment = None

    def _handle(self, client: Client, req: dict[str, Any]) -> None:
        rid = req.get("id")
        op = req.get("op")
        if not isinstance(rid, int) or isinstance(rid, bool):
            client.error(rid, "bad_request", "id must be an integer")
            self.requests[("unknown", "bad_request")] += 1
            return
        if op not in self._OPS:
            client.error(rid, "unknown_op", f"unknown op {str(op)[:50]!r}")
            self.requests[("unknown", "unknown_op")] += 1
            return
        handler: Callable[[Client, int, dict[str, Any]], None] = getattr(self, f"_op_{op}")
        try:
            handler(client, rid, req)
        except RequestError as exc:
            self.requests[(op, exc.code)] += 1
            client.error(rid, exc.code, str(exc))
        except LocalError as exc:
            self.requests[(op, "bad_request")] += 1
            client.error(rid, "bad_request", str(exc))
        except Exception as exc:  # never let one request take the daemon down
            log.exception("internal error serving %s", op)
            self.requests[(op, "internal")] += 1
            client.error(rid, "internal", f"{type(exc).__name__}: {exc}")
        else:
            if op != "submit":
                self.requests[(op, "ok")] += 1

    def _op_status(self, client: Client, rid: int, req: dict[str, Any]) -> None:
        """The shim protocol's "status" (`dlcp status`): `status.snapshot`."""
        client.reply(rid, status=self._status())

    def _op_hello(self, client: Client, rid: int, req: dict[str, Any]) -> None:
        version = req.get("version", ipc.PROTOCOL_VERSION)
        if version != ipc.PROTOCOL_VERSION:
            raise RequestError("bad_request", f"protocol version {version!r}; this daemon speaks 1")
        fb = req.get("fallbacks", 0)
        if isinstance(fb, int) and not isinstance(fb, bool) and 0 <= fb < 2**40:
            self.counters["fallbacks"] += fb
        client.reply(rid, version=ipc.PROTOCOL_VERSION, daemon=self.describe())

    def describe(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "id": self.id,
            "host_index": cfg.host_index,
            "addresses": list(cfg.addresses),
            "udp_port": cfg.udp_port,
            "payload": cfg.payload,
            "metrics_port": cfg.metrics_port,
            "peers": [
                {"index": p.index, "addresses": list(p.addresses), "udp_port": p.udp_port}
                for p in cfg.peers
            ],
        }

    def _op_segment(self, client: Client, rid: int, req: dict[str, Any]) -> None:
        if client.pending:
            raise RequestError("conflict", "cannot replace the segment with submits outstanding")
        if req.get("memfd") is True:
            # the descriptor follows as SCM_RIGHTS with one byte; nothing else is
            # read from this connection until it has come (_take_fd)
            size = int_field(req, "size", 1, MAX_SEGMENT)
            client.awaiting_fd = (rid, size)
            client.writer.transport.pause_reading()  # type: ignore[attr-defined]
            client.reply(rid, send_fd=True)
            return
        seg = RankSegment(req.get("name"), req.get("size"))  # type: ignore[arg-type]
        self._set_segment(client, seg)
        client.reply(rid)

    @staticmethod
    def _set_segment(client: Client, seg: RankSegment | MappedSegment) -> None:
        if client.segment is not None:
            client.segment.close()
        client.segment = seg

    async def _take_fd(
        self, client: Client, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Receive the memfd a `segment` request announced and map it; the
        request's second reply says whether that worked. A connection that
        sends anything else first, or nothing within FD_TIMEOUT, is closed."""
        assert client.awaiting_fd is not None
        rid, size = client.awaiting_fd
        client.awaiting_fd = None
        fds: list[int] = []
        try:
            if getattr(reader, "_buffer", b""):  # the stream read ahead: out of step
                raise ipc.ProtocolError("data sent after a memfd segment request")
            sock = writer.get_extra_info("socket")
            raw = socket.socket(fileno=os.dup(sock.fileno()))
            try:
                raw.setblocking(False)
                loop = asyncio.get_running_loop()
                ready: asyncio.Future[None] = loop.create_future()

                def wake() -> None:
                    if not ready.done():
                        ready.set_result(None)

                loop.add_reader(raw.fileno(), wake)
                try:
                    await asyncio.wait_for(ready, FD_TIMEOUT)
                finally:
                    loop.remove_reader(raw.fileno())
                msg, anc, flags, _ = raw.recvmsg(1, socket.CMSG_SPACE(_INT_SIZE))
            finally:
                raw.close()
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", data[: len(data) - len(data) % _INT_SIZE]))
            if msg != b"F" or len(fds) != 1 or flags & socket.MSG_CTRUNC:
                raise ipc.ProtocolError("expected one byte 'F' carrying one descriptor")
        except (ipc.ProtocolError, OSError, TimeoutError) as exc:
            for fd in fds:
                os.close(fd)
            self.requests[("segment", "bad_request")] += 1
            client.error(rid, "bad_request", f"no segment descriptor: {exc or 'timed out'}")
            client.closed = True  # the stream is out of step: drop the connection
            return
        try:
            seg = MappedSegment(fds[0], size)
        except LocalError as exc:
            self.requests[("segment", "bad_request")] += 1
            client.error(rid, "bad_request", str(exc))
        else:
            self._set_segment(client, seg)
            client.reply(rid, mapped=True)
        finally:
            os.close(fds[0])
            writer.transport.resume_reading()  # type: ignore[attr-defined]

    def _op_join(self, client: Client, rid: int, req: dict[str, Any]) -> None:
        if self.draining:
            raise RequestError("shutting_down", "the daemon is stopping")
        job_id = int_field(req, "job", 0, 2**32 - 1)
        key_hex = req.get("key")
        try:
            key = bytes.fromhex(key_hex) if isinstance(key_hex, str) else b""
        except ValueError:
            key = b""
        if not 16 <= len(key) <= 64:
            raise bad_request("key must be 16..64 bytes in hex")
        if "hosts" in req:
            hosts = parse_hosts(req["hosts"])
            me = int_field(req, "me", 0, len(hosts) - 1)
        else:  # membership from the config's peers
            cfg = self.config
            table = {p.index: HostAddr(p.addresses, p.udp_port) for p in cfg.peers}
            table[cfg.host_index] = HostAddr(cfg.addresses, cfg.udp_port)
            if sorted(table) != list(range(len(table))):
                raise bad_request("config peers do not form indices 0..H-1; pass hosts")
            hosts = tuple(table[i] for i in range(len(table)))
            me = cfg.host_index
        local = int_field(req, "local_ranks", 1, 256) if "local_ranks" in req else 1
        ranks = int_field(req, "ranks", 1, MAX_CONTRIBUTORS) if "ranks" in req else 0
        mode = req.get("mode", "transpose")
        payload = int_field(req, "payload", 64, 65443) if "payload" in req else self.config.payload
        aggs_raw, contr_raw = req.get("aggregators", ()), req.get("contributors", ())
        if not isinstance(aggs_raw, list | tuple) or not isinstance(contr_raw, list | tuple):
            raise bad_request("aggregators and contributors must list host indices")
        aggs, contr = tuple(aggs_raw), tuple(contr_raw)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in (*aggs, *contr)):
            raise bad_request("aggregators and contributors must list host indices")
        shards = int_field(req, "shards", 1, 65535) if "shards" in req else None
        state = self.lifecycle.make_job(
            job=job_id,
            key=key,
            hosts=hosts,
            me=me,
            local_ranks=local,
            ranks=ranks,
            mode=str(mode),
            payload=payload,
            aggregators=aggs,
            contributors=contr,
            shards=shards,
        )
        existing = self.jobs.get(job_id)
        if existing is not None:
            if existing.signature() != state.signature():
                raise RequestError(
                    "conflict", f"job {job_id} is already here with other members, key or ranks"
                )
            state = existing
        else:
            self.lifecycle.add_job(state)
            log.info(
                "job %d joined: %d hosts, me=%d, %d local ranks", job_id, len(hosts), me, local
            )
        state.clients.add(client)
        client.jobs.add(job_id)
        client.reply(rid)

    def _op_leave(self, client: Client, rid: int, req: dict[str, Any]) -> None:
        job_id = int_field(req, "job", 0, 2**32 - 1)
        if job_id not in client.jobs:
            raise RequestError("unknown_job", f"this client has not joined job {job_id}")
        self.lifecycle.leave(client, job_id)
        client.reply(rid)

    @staticmethod
    def _round_kind(req: dict[str, Any], job: Any, bound: float) -> str:
        """A submit's `kind`: what its round moves (docs/shim-protocol.md)."""
        kind = req.get("kind", ALLREDUCE)
        if kind not in ROUND_KINDS:
            raise bad_request(f"kind must be one of {', '.join(ROUND_KINDS)}")
        if kind == ALLREDUCE:
            return str(kind)
        spec = job.spec
        if job.local_ranks != 1 or sorted(set(spec.owners)) != sorted(spec.contributors):
            raise bad_request(f"a {kind} needs one rank a host and a transpose job")
        if kind == ALL_GATHER and bound > 0:
            raise bad_request("an all_gather is exact: bound 0")
        return str(kind)

    def _op_submit(self, client: Client, rid: int, req: dict[str, Any]) -> None:
        if self.draining:
            raise RequestError("shutting_down", "the daemon is stopping")
        job_id = int_field(req, "job", 0, 2**32 - 1)
        job = self.jobs.get(job_id)
        if job is None or job_id not in client.jobs:
            raise RequestError("unknown_job", f"job {job_id} was not joined on this connection")
        seg = client.segment
        if seg is None:
            raise bad_request("no segment: send 'segment' first")
        rnd = int_field(req, "round", 0, 2**32 - 1)
        bucket = int_field(req, "bucket", 0, 2**32 - 1)
        codec_name = req.get("codec")
        if not isinstance(codec_name, str) or codec_name not in ipc.CODEC_BY_NAME:
            raise bad_request(f"codec must be one of {', '.join(ipc.CODEC_BY_NAME)}")
        codec = Codec(ipc.CODEC_BY_NAME[codec_name])
        total = int_field(req, "total", 1, 2**32 - 1)
        bound = float_field(req, "bound", 0.0, 0.5, 0.0)
        scale = float_field(req, "scale", -3.4e38, 3.4e38, 0.0)
        if codec == Codec.UNION and bound > 0:
            raise bad_request(_UNION_BOUND)
        spec = job.spec
        kind = self._round_kind(req, job, bound)
        layout = spec.layout(total, codec)
        n = layout.packets
        d_off, d_len = seg.region(req.get("data"), "data")
        if d_len != lane_bytes(codec, total, False):
            raise bad_request(
                f"data holds {d_len} bytes; {total} {codec_name} lanes need "
                f"{lane_bytes(codec, total, False)}"
            )
        o_off, o_len = seg.region(req.get("out"), "out")
        need = lane_bytes(codec, total, True) + 6 * n
        if o_len < need:
            raise bad_request(f"out holds {o_len} bytes; the result needs {need}")
        regions = [(d_off, d_len)]
        layers = norms = bmax = None
        if req.get("meta") is not None:
            m_off, m_len = seg.region(req.get("meta"), "meta")
            if m_len not in (6 * n, 10 * n):
                raise bad_request(f"meta must hold {6 * n} or {10 * n} bytes for {n} packets")
            regions.append((m_off, m_len))
            mv = seg.read(m_off, m_len)
            layers = np.frombuffer(mv, "<u2", n, 0).astype(np.int64)
            norms = np.frombuffer(mv, "<f4", n, 2 * n).astype(np.float64)
            if not np.isfinite(norms).all() or (norms < 0).any():
                raise bad_request("norms must be finite and >= 0")
            if m_len == 10 * n:
                bmax = np.frombuffer(mv, "<f4", n, 6 * n).copy()
        n_layers = int_field(req, "layers", 1, 0x10000) if "layers" in req else None
        for off, ln in regions:
            if off < o_off + o_len and o_off < off + ln:
                raise bad_request("out overlaps data or meta")
        op = (job_id, rnd, bucket)
        self.lifecycle.check_submit(op, client, int(codec), total, bound, scale, kind)
        # A named segment: a private copy by preadv, never a mapping (a rank that
        # shrinks its file gets bad_request instead of killing the daemon with
        # SIGBUS); the copy answers retransmissions until the round has its
        # results. A sealed memfd cannot shrink: its lanes are read in place.
        if isinstance(seg, MappedSegment):
            data = seg.read(d_off, d_len)
        else:
            data = client.inputs.take(d_len)
            seg.read_into(d_off, data)
        part = LocalPart(client, rid, (o_off, o_len), data, layers, norms, bmax, n_layers)
        self.lifecycle.add_part(op, job, part, int(codec), total, bound, scale, kind)
