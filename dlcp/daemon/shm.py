"""The daemon's view of a rank's shared-memory segment (/dev/shm/dlcp-*)."""

from __future__ import annotations

import mmap
import os
import stat

from dlcp.errors import LocalError
from dlcp.ipc import SEGMENT_NAME

__all__ = ["MAX_SEGMENT", "MappedSegment"]

MAX_SEGMENT = 64 << 30
SHM_DIR = "/dev/shm"


class MappedSegment:
    def __init__(self, name: str, size: int) -> None:
        if not isinstance(name, str) or not SEGMENT_NAME.fullmatch(name):
            raise LocalError(f"segment name must match {SEGMENT_NAME.pattern}")
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_SEGMENT:
            raise LocalError(f"segment size must be 1..{MAX_SEGMENT} bytes")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise LocalError(f"cannot open segment {name}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise LocalError(f"segment {name} is not a regular file")
            if st.st_size < size:
                raise LocalError(f"segment {name} has {st.st_size} bytes, not {size}")
            self.mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.name = name
        self.size = size
        self.buf = memoryview(self.mmap)

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

    def close(self) -> None:
        try:
            self.buf.release()
            self.mmap.close()
        except BufferError:
            pass
