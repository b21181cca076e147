"""The daemon process's allocator and garbage-collector settings.

dlcpd moves every gradient byte through freshly allocated buffers: received
datagrams, encoded packets, sums and result arrays, one set per round. With
glibc's defaults, memory freed at the end of a round goes back to the kernel
(heap trimming, and mmap for blocks over the dynamic threshold), and the next
round's buffers fault it in again, every page zeroed by the kernel first: on
the project's machines (transparent huge pages always on) `clear_page` was 22 %
of a daemon's samples at 1-2 Gbit/s (perf, bench/diag/veth_busbw.py, MTU 9000).
Keeping freed memory in the process turns those faults into reuse; the
price is that the daemon's resident size stays at its peak (about two rounds'
buffers).

CPython's own allocator for small objects maps memory an arena (1 MiB) at a
time and unmaps an arena as soon as its last object is freed: at MTU 1500 a
round's datagrams, views and lists made and dropped about 4,000 page faults a
round a daemon that way. Up to ARENAS_KEPT freed arenas are kept mapped and
reused (dlcp/daemon/_arenas.c, where it is built; DLCP_NATIVE_ARENAS=0 turns
it off).

CPython's cyclic collector runs every 700 net container allocations, and a
daemon at full rate allocates hundreds of thousands of short-lived tuples and
lists a second (3-5 % of its samples in `gc_collect_main`). The daemon's
long-lived objects are frozen out of the collector after start-up and
collections are made rarer; reference counting frees everything acyclic as
before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os

try:
    from dlcp.daemon import _arenas  # type: ignore[attr-defined]
except ImportError:  # not built: arenas come and go
    _arenas = None

__all__ = ["ARENAS_KEPT", "GC_THRESHOLDS", "MALLOPT", "tune_process"]

# mallopt(3) parameters (glibc's malloc.h) and the values dlcpd sets
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
MALLOPT: dict[str, tuple[int, int]] = {
    # freed memory at the top of the heap stays mapped up to 1 GiB
    "trim_threshold": (_M_TRIM_THRESHOLD, 1 << 30),
    # grow the heap 64 MiB at a time (fewer brk calls and faults in bulk)
    "top_pad": (_M_TOP_PAD, 64 << 20),
    # blocks up to 32 MiB (glibc's largest allowed threshold) come from the
    # reusable heap, not from a fresh mmap each time
    "mmap_threshold": (_M_MMAP_THRESHOLD, 32 << 20),
    # ... and larger ones too (a 100 MB rank's input, its sums): no block is
    # mmapped on its own, so none is unmapped at free and zeroed again by the
    # kernel at the next round's first touch. That alone is not enough when one
    # round's arrays are still alive as the next one's are made: the largest are
    # also reused explicitly (dlcp/core/buffers.py)
    "mmap_max": (_M_MMAP_MAX, 0),
}
GC_THRESHOLDS = (50_000, 20, 100)
ARENAS_KEPT = 128  # freed object arenas of 1 MiB kept for reuse: at most 128 MiB


def tune_process() -> dict[str, bool]:
    """Apply MALLOPT (where the C library is glibc), ARENAS_KEPT (where
    dlcp.daemon._arenas is built and not turned off) and GC_THRESHOLDS, and freeze the objects
    alive now out of the cyclic collector. Returns what was applied, per
    setting (False: not glibc, or refused, or not built)."""
    applied: dict[str, bool] = {}
    libc_name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(libc_name).mallopt if libc_name is not None else None
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        mallopt = None
    for name, (param, value) in MALLOPT.items():
        applied[name] = bool(
            mallopt is not None and mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1
        )
    arenas = _arenas is not None and os.environ.get("DLCP_NATIVE_ARENAS", "1") != "0"
    if arenas:
        _arenas.keep(ARENAS_KEPT)
    applied["arenas"] = arenas
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    applied["gc"] = gc.get_threshold() == GC_THRESHOLDS
    return applied
