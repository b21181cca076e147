"""The path each DATA/RESULT packet recently sent to a multi-path peer took,
for the NACKs that name it (`Outbox.on_nack` charges each loss to its path).

Kept per shard and leg as chunks: the offset fields of the packets that one
send put on one path (bytes, four a packet, as `_keys.by_path` cuts them out
of the headers) and that path, so a send notes a chunk, not an entry a
packet. It holds to what a dict of (leg, job, round, bucket, shard, offset)
-> path in two generations did (the definition; `as_dicts` gives it back):
a packet noted again takes the path noted last, a NACK's look-up forgets
what it finds, and the newer generation becomes the older one once it holds
more than a limit of distinct packets. Noting costs no look-up: a packet
noted twice (pushed again after it left: rare) is found out only when the
count of entries passes the limit, where the distinct ones are counted.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SentPaths"]

_OFFSETS = np.dtype(">u4")


class _Log:
    """One shard and leg's packets in a generation."""

    __slots__ = ("chunks", "dead", "index", "paths")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []  # offset fields, four bytes a packet
        self.paths: list[int] = []  # each chunk's path
        self.dead = bytearray()  # a byte a packet of all chunks: 1 once forgotten
        # (offsets in order, their places, every packet's path): made by the
        # first look-up after a note
        self.index: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def note(self, offsets: bytes, path: int) -> None:
        self.chunks.append(offsets)
        self.paths.append(path)
        self.dead += bytes(len(offsets) // 4)
        self.index = None

    def sorted(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`index`, made if need be (a stable sort: equal offsets in the order noted)."""
        if self.index is None:
            offs = np.frombuffer(b"".join(self.chunks), _OFFSETS)
            paths = np.repeat(np.asarray(self.paths, np.int64), [len(c) // 4 for c in self.chunks])
            order = np.argsort(offs, kind="stable")
            self.index = (offs[order], order, paths)
        return self.index

    def take(self, want: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Look up `want` (distinct offsets): whether each is known, the path
        noted last for those that are, and how many entries that forgot. The
        latest entry of an offset is live if any is: a look-up forgets them
        all, and a later note is later."""
        ranked, order, paths = self.sorted()
        if not ranked.size:
            return np.zeros(want.size, bool), np.zeros(0, np.int64), 0
        hi = np.searchsorted(ranked, want, side="right")
        k = np.maximum(hi - 1, 0)
        dead = np.frombuffer(self.dead, np.uint8)
        hit = (ranked[k] == want) & (dead[order[k]] == 0)
        found = paths[order[k[hit]]]
        gone = 0
        lo = np.searchsorted(ranked, want[hit], side="left")
        for a, b in zip(lo.tolist(), hi[hit].tolist(), strict=True):
            for place in order[a:b].tolist():
                if not self.dead[place]:
                    self.dead[place] = 1
                    gone += 1
        del dead
        return hit, found, gone

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct live offsets, each with the path noted last."""
        ranked, order, paths = self.sorted()
        if not ranked.size:
            return ranked, paths[:0]
        last = np.ones(ranked.size, bool)  # the last of each run of equal offsets
        last[:-1] = ranked[1:] != ranked[:-1]
        alive = np.frombuffer(self.dead, np.uint8)[order] == 0
        keep = last & alive
        return ranked[keep], paths[order[keep]]


class SentPaths:
    """Recently sent DATA/RESULT packets' paths, two generations of them."""

    __slots__ = ("entries", "new", "old", "slack")

    def __init__(self) -> None:
        self.new: dict[bytes, _Log] = {}
        self.old: dict[bytes, _Log] = {}
        self.entries = 0  # live entries in `new`, a packet noted twice counted twice
        # entries less distinct packets, at most (counted when `entries` passed the limit)
        self.slack = 0

    def note(self, bkey: bytes, offsets: bytes, path: int) -> None:
        """Packets of shard and leg `bkey` (their offset fields `offsets`) went
        on `path`."""
        if not offsets:
            return
        log = self.new.get(bkey)
        if log is None:
            log = self.new[bkey] = _Log()
        log.note(offsets, path)
        self.entries += len(offsets) // 4

    @property
    def live(self) -> int:
        """Distinct packets in the newer generation: what the limit holds."""
        return sum(log.live()[0].size for log in self.new.values())

    def rotate(self, limit: int) -> None:
        """The newer generation becomes the older once it holds more than
        `limit` distinct packets."""
        if self.entries - self.slack <= limit:
            return
        distinct = self.live
        if distinct > limit:
            self.old = self.new
            self.new = {}
            self.entries = self.slack = 0
        else:
            self.slack = self.entries - distinct

    def pop(self, bkey: bytes, offsets: bytes) -> list[int]:
        """The path of each packet of shard and leg `bkey` at `offsets` (four
        bytes each, big endian), -1 where none is known: the newer
        generation's, else the older's; both forget it (a packet named twice
        is found once)."""
        want = np.frombuffer(offsets, _OFFSETS)
        if not want.size:
            return []
        got = np.full(want.size, -1, np.int64)
        first = np.unique(want, return_index=True)[1]  # a repeat within the list finds nothing
        older = self._look(self.old, bkey, want[first])
        newer = self._look(self.new, bkey, want[first], counted=True)
        got[first] = np.where(newer >= 0, newer, older)
        return got.tolist()

    def _look(
        self, gen: dict[bytes, _Log], bkey: bytes, want: np.ndarray, counted: bool = False
    ) -> np.ndarray:
        """The paths of `want` (distinct offsets) in generation `gen` (-1:
        none), forgotten there."""
        out = np.full(want.size, -1, np.int64)
        log = gen.get(bkey)
        if log is None:
            return out
        hit, found, gone = log.take(want)
        out[hit] = found
        if counted:
            self.entries -= gone
            # each packet found was `gone` entries, one of them distinct
            self.slack = max(0, self.slack - (gone - int(hit.sum())))
        return out

    def as_dicts(self) -> tuple[dict[bytes, int], dict[bytes, int]]:
        """Both generations as the dicts they stand for: (leg, job, round,
        bucket, shard) + offset -> path (for tests)."""
        out = []
        for gen in (self.new, self.old):
            d: dict[bytes, int] = {}
            for bkey, log in gen.items():
                offs, paths = log.live()
                raw = offs.astype(_OFFSETS).tobytes()
                for j, p in enumerate(paths.tolist()):
                    d[bkey + raw[4 * j : 4 * j + 4]] = p
            out.append(d)
        return out[0], out[1]
