"""A blocking client of the local daemon (docs/shim-protocol.md).

Thread-safe: requests may be issued from any thread; a reader thread matches
replies to requests by id and completes `concurrent.futures.Future`s.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import itertools
import mmap
import os
import socket
import threading
from concurrent.futures import Future
from typing import Any

from dlcp import ipc
from dlcp.errors import DlcpError

__all__ = ["DaemonClient", "DaemonError", "SealedSegment", "Segment", "default_socket"]


class DaemonError(DlcpError):
    """The daemon answered a request with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def default_socket() -> str:
    return os.environ.get("DLCP_SOCKET", ipc.DEFAULT_SOCKET)


def _unmap(buf: memoryview, m: mmap.mmap) -> None:
    """Release a segment's view and mapping, unless someone still holds a view
    of it: then the mapping goes with the process."""
    try:
        buf.release()
        m.close()
    except BufferError:
        pass


def _map_populated(fd: int, size: int) -> mmap.mmap:
    """A shared mapping of `fd` with its pages allocated and mapped now
    (MAP_POPULATE where the platform has it): a fresh segment costs its page
    faults here, at attach or growth, not in the step that first writes it
    (about 2 ms per MB on a busy host, and the daemon then maps pages that
    exist)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags)


class _Mapped:
    """A segment's mapping, page-locked for CUDA once a GPU bucket uses it."""

    mmap: mmap.mmap
    buf: memoryview
    pinned: bool = False  # page-locked: GPU copies to and from it are one DMA
    _pin_tried: bool = False

    def pin_for_cuda(self) -> bool:
        """Page-lock the mapping (tried once); whether it is."""
        if not self._pin_tried:
            from dlcp.shim.pinning import pin_mapping  # torch: only for GPU buckets

            self._pin_tried = True
            self.pinned = pin_mapping(self.buf)
        return self.pinned

    def _release(self) -> None:
        if self.pinned:
            from dlcp.shim.pinning import unpin_mapping

            self.pinned = False
            unpin_mapping(self.buf)
        _unmap(self.buf, self.mmap)


class Segment(_Mapped):
    """A POSIX shared-memory segment (/dev/shm/NAME) this process creates and owns."""

    def __init__(self, name: str, size: int, group: int | None = None) -> None:
        if group is None:
            with contextlib.suppress(OSError):
                group = os.stat(default_socket()).st_gid
        if not ipc.SEGMENT_NAME.fullmatch(name):
            raise DlcpError(f"bad segment name {name!r}")
        self.name = name
        self.size = size
        self.path = f"/dev/shm/{name}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o660)
        try:
            # The daemon (user dlcp) maps it: group-readable/writable whatever the
            # umask, and owned by the group of the daemon's socket when we can.
            os.fchmod(fd, 0o660)
            if group is not None:
                with contextlib.suppress(OSError):
                    os.fchown(fd, -1, group)
            os.ftruncate(fd, size)
            self.mmap = _map_populated(fd, size)
        finally:
            os.close(fd)
        self.buf = memoryview(self.mmap)

    def close(self) -> None:
        self._release()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class SealedSegment(_Mapped):
    """A segment in a memfd sealed against shrinking, which the daemon maps.

    Handed to the daemon as a descriptor (`DaemonClient.segment`), never by
    name: nothing is left in /dev/shm, and the daemon reads the lanes in place
    and writes results straight into the mapping (no `preadv`/`pwritev` copy),
    which it may do only because the seal keeps the file from shrinking under
    its mapping. Same attributes as `Segment` (no `path`).
    """

    def __init__(self, name: str, size: int) -> None:
        if not ipc.SEGMENT_NAME.fullmatch(name):
            raise DlcpError(f"bad segment name {name!r}")
        self.name = name
        self.size = size
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            # it may grow, never shrink; and the seals themselves are final
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            self.mmap = _map_populated(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.buf = memoryview(self.mmap)

    def close(self) -> None:
        self._release()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def memfd_supported() -> bool:
    """Whether this system can make sealed memfd segments."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_SEAL_SHRINK")


class DaemonClient:
    def __init__(self, path: str | None = None, *, timeout: float = 5.0) -> None:
        self.path = path or default_socket()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(self.path)
        except OSError:
            self.sock.close()
            raise
        self.sock.settimeout(None)
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        # held while sending, and across a memfd handover: nothing may reach the
        # daemon between a memfd `segment` request and its descriptor
        self._send = threading.RLock()
        self._closed = False
        self.error: BaseException | None = None
        self._reader = threading.Thread(target=self._read, name="dlcp-client", daemon=True)
        self._reader.start()

    # -- plumbing ---------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                msg = ipc.recv_message(self.sock)
                with self._lock:
                    fut = self._pending.pop(msg.get("id", -1), None)
                if fut is None:
                    continue
                if msg.get("ok"):
                    fut.set_result(msg)
                else:
                    fut.set_exception(
                        DaemonError(str(msg.get("code", "error")), str(msg.get("error", "")))
                    )
        except (OSError, ipc.ProtocolError, ConnectionError) as exc:
            self.error = exc
        finally:
            with self._lock:
                pending, self._pending = self._pending, {}
                self._closed = True
            for fut in pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError(f"lost the daemon: {self.error}"))

    def request(self, op: str, **fields: Any) -> Future[dict[str, Any]]:
        return self._request(op, fields)[1]

    def _request(self, op: str, fields: dict[str, Any]) -> tuple[int, Future[dict[str, Any]]]:
        fut: Future[dict[str, Any]] = Future()
        with self._send, self._lock:
            if self._closed:
                raise ConnectionError(f"lost the daemon: {self.error}")
            rid = next(self._ids)
            self._pending[rid] = fut
            try:
                ipc.send_message(self.sock, {"op": op, "id": rid, **fields})
            except OSError:
                self._pending.pop(rid, None)
                raise
        return rid, fut

    def call(self, op: str, timeout: float | None = 30.0, **fields: Any) -> dict[str, Any]:
        return self.request(op, **fields).result(timeout)

    @property
    def alive(self) -> bool:
        return not self._closed

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._reader.join(timeout=2)

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests ---------------------------------------------------------
    def hello(self, fallbacks: int = 0) -> dict[str, Any]:
        return self.call(
            "hello", version=ipc.PROTOCOL_VERSION, pid=os.getpid(), fallbacks=fallbacks
        )["daemon"]

    def segment(self, seg: Segment | SealedSegment, timeout: float = 30.0) -> None:
        if not isinstance(seg, SealedSegment):
            self.call("segment", name=seg.name, size=seg.size)
            return
        # the request, then (once the daemon asks for it) one byte carrying the
        # descriptor; the second reply to the same id says whether it was mapped
        with self._send:
            rid, first = self._request("segment", {"memfd": True, "size": seg.size})
            if not first.result(timeout).get("send_fd"):
                raise DaemonError("bad_request", "the daemon did not ask for the descriptor")
            mapped: Future[dict[str, Any]] = Future()
            with self._lock:
                self._pending[rid] = mapped
            self.sock.sendmsg(
                [b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [seg.fd]))]
            )
        mapped.result(timeout)

    def join(self, **fields: Any) -> dict[str, Any]:
        if isinstance(fields.get("key"), bytes | bytearray):
            fields["key"] = bytes(fields["key"]).hex()
        return self.call("join", **fields)

    def submit(self, **fields: Any) -> Future[dict[str, Any]]:
        return self.request("submit", **fields)

    def leave(self, job: int) -> None:
        self.call("leave", job=job)

    def status(self) -> dict[str, Any]:
        return self.call("status")["status"]
