"""The path each DATA/RESULT packet recently sent to a multi-path peer took,
for the NACKs that name it (`Outbox.on_nack` charges each loss to its path).

Kept per shard and leg as chunks: the offset fields of the packets that one
send put on one path (bytes, four a packet, as `_keys.by_path` cuts them out
of the headers) and that path, so a send notes a chunk, not an entry a
packet. It holds to what a dict of (leg, job, round, bucket, shard, offset)
-> path in two generations did (the definition; `as_dicts` gives it back):
a packet noted again replaces its entry, a NACK's look-up forgets what it
finds, and the newer generation becomes the older one once it holds more than
a limit of packets.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SentPaths"]

_OFFSETS = np.dtype(">u4")


class _Log:
    """One shard and leg's packets in a generation."""

    __slots__ = ("batch", "before", "chunks", "gone", "paths", "size", "top")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []  # offset fields, four bytes a packet
        self.paths: list[int] = []  # each chunk's path
        self.size = 0  # packets in all chunks
        self.top = b""  # the highest offset noted (4 bytes, big endian)
        self.before = b""  # ... before the batch `batch`
        self.batch = -1
        self.gone: set[int] = set()  # places (over all chunks) forgotten or replaced

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(offsets, paths) of the live entries, and their places."""
        offs = np.frombuffer(b"".join(self.chunks), _OFFSETS)
        paths = np.repeat(np.asarray(self.paths, np.int64), [len(c) // 4 for c in self.chunks])
        alive = np.ones(offs.size, bool)
        if self.gone:
            alive[np.fromiter(self.gone, np.int64, len(self.gone))] = False
        where = np.flatnonzero(alive)
        return offs[where], paths[where], where


class SentPaths:
    """Recently sent DATA/RESULT packets' paths, two generations of them."""

    __slots__ = ("batch", "live", "new", "old")

    def __init__(self) -> None:
        self.new: dict[bytes, _Log] = {}
        self.old: dict[bytes, _Log] = {}
        self.live = 0  # distinct packets in `new`: what the limit holds
        self.batch = 0  # the send batch being noted (`begin`)

    def begin(self) -> None:
        """What is noted from now on comes from one new batch, whose packets
        are distinct (a queue holds a packet once): its paths' parts of one
        shard need not be looked up against each other."""
        self.batch += 1

    def note(self, bkey: bytes, offsets: bytes, path: int, rising: bool) -> None:
        """Packets of shard and leg `bkey` (their offset fields `offsets`;
        `rising`: known to strictly increase) went on `path`."""
        n = len(offsets) // 4
        if not n:
            return
        log = self.new.get(bkey)
        if log is None:
            log = self.new[bkey] = _Log()
        if log.batch != self.batch:
            log.batch, log.before = self.batch, log.top
        base = log.size
        # above all that came before this batch: nothing to replace
        if rising and offsets[:4] > log.before:
            top = max(log.top, offsets[-4:])
            fresh = n
        else:
            a = np.frombuffer(offsets, _OFFSETS)
            if log.size:  # the entries these replace
                self.live -= self._forget(log, np.unique(a)).size
            # within the chunk the last of each offset stays
            _, last = np.unique(a[::-1], return_index=True)
            fresh = last.size
            if fresh < n:
                keep = np.zeros(n, bool)
                keep[n - 1 - last] = True
                log.gone.update((base + np.flatnonzero(~keep)).tolist())
            top = max(log.top, int(a.max()).to_bytes(4, "big"))
        log.chunks.append(offsets)
        log.paths.append(path)
        log.size = base + n
        log.top = top
        self.live += fresh

    def rotate(self, limit: int) -> None:
        """The newer generation becomes the older once it holds more than `limit`."""
        if self.live > limit:
            self.old = self.new
            self.new = {}
            self.live = 0

    def pop(self, bkey: bytes, offsets: bytes) -> list[int]:
        """The path of each packet of shard and leg `bkey` at `offsets` (four
        bytes each, big endian), -1 where none is known: the newer
        generation's, else the older's; both forget it (a packet named twice
        is found once)."""
        want = np.frombuffer(offsets, _OFFSETS)
        got = np.full(want.size, -1, np.int64)
        if not want.size:
            return []
        first = np.unique(want, return_index=True)[1]  # a repeat within the list finds nothing
        older = self._look(self.old, bkey, want, first)
        newer = self._look(self.new, bkey, want, first, counted=True)
        got[first] = np.where(newer >= 0, newer, older)
        return got.tolist()

    def _look(
        self,
        gen: dict[bytes, _Log],
        bkey: bytes,
        want: np.ndarray,
        first: np.ndarray,
        counted: bool = False,
    ) -> np.ndarray:
        """The paths of `want[first]` (distinct offsets) in generation `gen`
        (-1: none), forgotten there."""
        out = np.full(first.size, -1, np.int64)
        log = gen.get(bkey)
        if log is None:
            return out
        offs, paths, where = log.arrays()
        if not offs.size:
            return out
        order = np.argsort(offs, kind="stable")
        ranked = offs[order]
        w = want[first]
        # the latest of equal offsets (the stable order keeps them in order)
        k = np.maximum(np.searchsorted(ranked, w, side="right") - 1, 0)
        hit = ranked[k] == w
        found = order[k[hit]]
        out[hit] = paths[found]
        log.gone.update(where[found].tolist())
        if counted:
            self.live -= int(hit.sum())
        return out

    @staticmethod
    def _forget(log: _Log, offsets: np.ndarray) -> np.ndarray:
        """Forget the live entries of `log` at `offsets` (distinct); returns
        their places."""
        offs, _, where = log.arrays()
        hit = where[np.isin(offs, offsets)]
        log.gone.update(hit.tolist())
        return hit

    def as_dicts(self) -> tuple[dict[bytes, int], dict[bytes, int]]:
        """Both generations as the dicts they stand for: (leg, job, round,
        bucket, shard) + offset -> path (for tests and `dlcp status`)."""
        out = []
        for gen in (self.new, self.old):
            d: dict[bytes, int] = {}
            for bkey, log in gen.items():
                offs, paths, _ = log.arrays()
                raw = offs.astype(_OFFSETS).tobytes()
                for j, p in enumerate(paths.tolist()):
                    d[bkey + raw[4 * j : 4 * j + 4]] = p
            out.append(d)
        return out[0], out[1]

    def __len__(self) -> int:
        return self.live
