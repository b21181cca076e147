"""The daemon's view of a rank's shared-memory segment: two kinds.

`RankSegment`, a named file (/dev/shm/dlcp-*): the daemon never maps it. A
rank owns the file and may shrink it at any time (`ftruncate`); touching a
mapped page past the new end would kill the daemon with SIGBUS, for every job
on the host. Instead the daemon keeps the file's descriptor open and moves
bytes with `preadv`/`pwritev`, which report a shrunk file as a short count (or
an errno) rather than a fault. The daemon keeps this copy of the lanes for
retransmissions, so a rank rewriting `data` early cannot change what is sent.

`MappedSegment`, a memfd the rank sealed against shrinking and handed over
with SCM_RIGHTS (the shim's default where the kernel has sealed memfds): no
page of it can vanish, so the daemon maps it, sends the lanes from the
mapping and stores result lanes straight into the rank's `out` region. The
two copies of every byte that a named segment costs (`preadv` in, `pwritev`
out) are gone; a rank that rewrites its `data` during a round changes what
retransmissions of its own job carry, nothing else.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat
from collections.abc import Sequence
from typing import Any

import numpy as np

from dlcp.errors import LocalError
from dlcp.ipc import SEGMENT_NAME

__all__ = ["MAX_SEGMENT", "MappedSegment", "RankSegment"]

MAX_SEGMENT = 64 << 30
SHM_DIR = "/dev/shm"


class _Segment:
    """What every kind of rank segment has: a name and a size, and regions in it."""

    name: str
    size: int

    def holds(self, off: int, lanes: np.ndarray) -> bool:
        """Whether `lanes` are this segment's own bytes from `off` (a view of
        its mapping there); never for a segment that is not mapped."""
        return False

    def region(self, spec: object, what: str) -> tuple[int, int]:
        """A validated (offset, length) pair inside the segment."""
        if (
            not isinstance(spec, list | tuple)
            or len(spec) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in spec)
        ):
            raise LocalError(f"{what} must be [offset, length]")
        off, n = int(spec[0]), int(spec[1])
        if off < 0 or n < 0 or off + n > self.size:
            raise LocalError(f"{what} [{off}, {n}] lies outside the {self.size}-byte segment")
        return off, n


class RankSegment(_Segment):
    def __init__(self, name: str, size: int) -> None:
        if not isinstance(name, str) or not SEGMENT_NAME.fullmatch(name):
            raise LocalError(f"segment name must match {SEGMENT_NAME.pattern}")
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_SEGMENT:
            raise LocalError(f"segment size must be 1..{MAX_SEGMENT} bytes")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise LocalError(f"cannot open segment {name}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise LocalError(f"segment {name} is not a regular file")
            if st.st_size < size:
                raise LocalError(f"segment {name} has {st.st_size} bytes, not {size}")
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd
        self.name = name
        self.size = size

    def _fd(self) -> int:
        if self.fd is None:
            raise LocalError(f"segment {self.name} is closed")
        return self.fd

    def _shrunk(self, what: str, off: int, n: int) -> LocalError:
        try:
            now = f"{os.fstat(self._fd()).st_size} bytes"
        except OSError as exc:
            now = f"unreadable ({exc.strerror})"
        return LocalError(
            f"segment {self.name} shrank to {now} (announced {self.size}): cannot {what} "
            f"[{off}, {n}]; do not truncate a segment the daemon uses"
        )

    def read(self, off: int, n: int) -> np.ndarray:
        """A private copy of bytes [off, off + n) as a uint8 array."""
        out = np.empty(n, np.uint8)
        self.read_into(off, out)
        return out

    def read_into(self, off: int, out: np.ndarray) -> None:
        fd = self._fd()
        view = out.data.cast("B")
        n = len(view)
        done = 0
        while done < n:
            try:
                got = os.preadv(fd, [view[done:]], off + done)
            except OSError as exc:
                raise LocalError(f"cannot read segment {self.name}: {exc.strerror}") from None
            if got <= 0:
                raise self._shrunk("read", off, n)
            done += got

    def write(self, off: int, parts: Sequence[Any]) -> None:
        """Write the buffers back to back from `off`.

        A segment that shrank is refused. If it shrinks between the check and
        the write, the write grows the file again: no fault either way.
        """
        fd = self._fd()
        views = [memoryview(p).cast("B") for p in parts]
        views = [v for v in views if len(v)]
        n = sum(len(v) for v in views)
        try:
            size = os.fstat(fd).st_size
        except OSError as exc:
            raise LocalError(f"cannot stat segment {self.name}: {exc.strerror}") from None
        if off + n > size:
            raise self._shrunk("write", off, n)
        pos = off
        while views:
            try:
                put = os.pwritev(fd, views, pos)
            except OSError as exc:
                raise LocalError(f"cannot write segment {self.name}: {exc.strerror}") from None
            if put <= 0:
                raise self._shrunk("write", off, n)
            pos += put
            while views and put >= len(views[0]):
                put -= len(views[0])
                views.pop(0)
            if put:
                views[0] = views[0][put:]

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class MappedSegment(_Segment):
    """A rank's segment passed as a sealed memfd (the `segment` request with
    `"memfd": true`): mapped, so lanes are read in place and results stored in
    place (`lanes`) or written with a memory copy, no `preadv`/`pwritev`.

    Mapping is safe only because the file cannot shrink: the descriptor must
    carry F_SEAL_SHRINK (a memfd made with MFD_ALLOW_SEALING), so no page of the
    mapping can vanish and fault with SIGBUS. The rank can still rewrite the
    bytes: lanes it changes during a round change what retransmissions carry,
    which only its own job's results can notice.
    """

    def __init__(self, fd: int, size: int) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_SEGMENT:
            raise LocalError(f"segment size must be 1..{MAX_SEGMENT} bytes")
        try:
            st = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise LocalError(f"cannot use the segment descriptor: {exc.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise LocalError("the segment descriptor is not a regular file")
        if not seals & fcntl.F_SEAL_SHRINK:
            raise LocalError("the segment memfd must be sealed against shrinking (F_SEAL_SHRINK)")
        if st.st_size < size:
            raise LocalError(f"the segment memfd has {st.st_size} bytes, not {size}")
        try:
            # not MAP_POPULATE: that would allocate every page of a sparse memfd (up
            # to MAX_SEGMENT) in the daemon's name; pages fault in once, when touched
            self.mmap: mmap.mmap | None = mmap.mmap(fd, size)
        except OSError as exc:
            raise LocalError(f"cannot map the segment: {exc.strerror}") from None
        self.name = f"memfd:{st.st_ino}"
        self.size = size
        self._bytes = np.frombuffer(self.mmap, np.uint8)

    def _view(self, off: int, n: int) -> np.ndarray:
        if self.mmap is None:
            raise LocalError(f"segment {self.name} is closed")
        return self._bytes[off : off + n]

    def read(self, off: int, n: int) -> np.ndarray:
        """Bytes [off, off + n) in place (a view of the mapping, not a copy)."""
        return self._view(off, n)

    def lanes(self, off: int, dtype: np.dtype, count: int) -> np.ndarray:
        """`count` lanes of `dtype` from `off`, in place (a writable view)."""
        return self._view(off, count * dtype.itemsize).view(dtype)

    def holds(self, off: int, lanes: np.ndarray) -> bool:
        # one address space: the same address is the same memory
        return (
            self.mmap is not None
            and 0 <= off <= self.size - lanes.nbytes
            and lanes.flags.c_contiguous
            and lanes.ctypes.data == self._bytes.ctypes.data + off
        )

    def write(self, off: int, parts: Sequence[Any]) -> None:
        """Write the buffers back to back from `off`."""
        pos = off
        for p in parts:
            raw = np.frombuffer(memoryview(p).cast("B"), np.uint8)
            self._view(pos, raw.size)[:] = raw
            pos += raw.size

    def close(self) -> None:
        m, self.mmap = self.mmap, None
        self._bytes = np.zeros(0, np.uint8)
        if m is not None:
            # a round's views may still use it: then the mapping goes with them
            with contextlib.suppress(BufferError):
                m.close()
