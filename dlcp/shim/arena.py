"""The rank's shared-memory segment, cut into per-submit regions.

One segment per daemon connection. A bump allocator hands out regions for the
submits of one step and is reset when the step's rounds are all read. When a
step needs more than the segment holds, a larger one replaces it (the daemon
maps the new one; the old stays mapped here until the step's results are
read). Segments are sealed memfds handed to the daemon by descriptor where
the kernel has them (the daemon then maps them: no copy in or out), else
named /dev/shm files, unlinked as soon as the daemon has opened them; either
way a crashed rank leaves nothing in /dev/shm.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from dlcp.errors import DlcpError
from dlcp.shim.client import DaemonClient, SealedSegment, Segment, memfd_supported
from dlcp.shim.regions import RegionSizes, align

__all__ = ["MIN_SEGMENT", "Arena", "Region"]

MIN_SEGMENT = 1 << 20


@dataclass(frozen=True)
class Region:
    """The data, meta and out regions of one submit, as byte offsets in `segment`."""

    segment: Segment | SealedSegment
    data: int
    meta: int
    out: int
    sizes: RegionSizes

    def data_view(self) -> memoryview:
        return self.segment.buf[self.data : self.data + self.sizes.data]

    def meta_view(self) -> memoryview:
        return self.segment.buf[self.meta : self.meta + self.sizes.meta]

    def out_view(self) -> memoryview:
        return self.segment.buf[self.out : self.out + self.sizes.out]

    def submit_fields(self) -> dict[str, list[int]]:
        return {
            "data": [self.data, self.sizes.data],
            "meta": [self.meta, self.sizes.meta],
            "out": [self.out, self.sizes.out],
        }


class Arena:
    """Segments of one daemon connection and a bump allocator over the current one."""

    def __init__(
        self,
        client: DaemonClient,
        prefix: str,
        size: int = MIN_SEGMENT,
        *,
        unlink: bool = True,
        sealed: bool | None = None,
    ) -> None:
        """`sealed`: sealed memfd segments (None: where the kernel has them),
        else named ones, unlinked once the daemon has them if `unlink`."""
        self._client = client
        self._prefix = prefix
        self._unlink = unlink
        self._sealed = memfd_supported() if sealed is None else sealed
        self._serial = 0
        self._top = 0
        self._retired: list[Segment | SealedSegment] = []
        self.grows = 0  # segments replaced by larger ones
        self.step_bytes = 0  # what the regions since the last reset take, in any segment
        self.segment = self._new(max(size, MIN_SEGMENT))

    def _new(self, size: int) -> Segment | SealedSegment:
        kind = SealedSegment if self._sealed else Segment
        seg = kind(f"{self._prefix}-{self._serial}", align(size))
        self._serial += 1
        try:
            self._client.segment(seg)
        except BaseException:
            seg.close()
            raise
        if self._unlink and isinstance(seg, Segment):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(seg.path)
        return seg

    def fits(self, sizes: RegionSizes) -> bool:
        return self._top + sizes.total <= self.segment.size

    @property
    def used(self) -> int:
        return self._top

    def take(self, sizes: RegionSizes) -> Region:
        """Regions for one submit in the current segment (see `fits`)."""
        if not self.fits(sizes):
            raise DlcpError(f"segment of {self.segment.size} bytes is full")
        data = self._top
        meta = data + align(sizes.data)
        out = meta + align(sizes.meta)
        self._top = out + align(sizes.out)
        self.step_bytes += self._top - data
        return Region(self.segment, data, meta, out, sizes)

    def grow(self, needed: int) -> None:
        """Replace the segment by a larger one (at least `needed` bytes, twice the old).

        Call it only when no submit of this connection is outstanding; regions
        already handed out stay readable until `reset`.
        """
        size = max(2 * self.segment.size, needed, MIN_SEGMENT)
        new = self._new(size)
        self._retired.append(self.segment)
        self.segment = new
        self._top = 0
        self.grows += 1

    def reserve(self, size: int) -> bool:
        """Make the segment hold at least `size` bytes (between steps: no submit
        outstanding); whether it had to grow."""
        if self.segment.size >= size:
            return False
        self.grow(size)
        return True

    def reset(self) -> None:
        """The step's results are read: free all regions and retired segments."""
        self._top = 0
        self.step_bytes = 0
        for seg in self._retired:
            seg.close()
        self._retired = []

    def close(self) -> None:
        self.reset()
        self.segment.close()
