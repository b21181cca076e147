"""`SentPaths` (a chunk of offsets a send) answers NACKs as the dict of
(shard and leg, offset) -> path in two generations it replaced: the same path
for every packet named, the same packets forgotten, the same rotation."""

from __future__ import annotations

import random

from dlcp.daemon.sentpaths import SentPaths


class DictModel:
    """The definition: what `pathloss.track` and `on_nack` kept before."""

    def __init__(self) -> None:
        self.new: dict[bytes, int] = {}
        self.old: dict[bytes, int] = {}

    def note(self, bkey: bytes, offsets: bytes, path: int) -> None:
        for i in range(0, len(offsets), 4):
            self.new[bkey + offsets[i : i + 4]] = path

    def rotate(self, limit: int) -> None:
        if len(self.new) > limit:
            self.old, self.new = self.new, {}

    def pop(self, bkey: bytes, offsets: bytes) -> list[int]:
        out = []
        for i in range(0, len(offsets), 4):
            key = bkey + offsets[i : i + 4]
            p = self.new.pop(key, None)
            q = self.old.pop(key, None)
            out.append(-1 if p is None and q is None else p if p is not None else q)
        return out


def _offsets(values: list[int]) -> bytes:
    return b"".join(v.to_bytes(4, "big") for v in values)


def test_sent_paths_answer_as_the_dicts_did() -> None:
    rng = random.Random(5)
    for trial in range(40):
        got, want = SentPaths(), DictModel()
        limit = rng.choice((8, 40, 1000))
        bkeys = [bytes((1 + k % 2,)) + bytes(13) + bytes((k,)) for k in range(3)]
        top = {b: 0 for b in bkeys}
        for _ in range(60):
            r = rng.random()
            bkey = rng.choice(bkeys)
            if r < 0.6:  # a batch: its paths' parts of one shard, distinct
                n = rng.randrange(1, 30)
                if rng.random() < 0.7:  # the next packets, in order
                    vals = list(range(top[bkey], top[bkey] + n))
                    top[bkey] += n
                elif rng.random() < 0.7:  # old ones again, any order
                    vals = rng.sample(range(top[bkey] + n), n)
                else:  # some twice in one send (none of a queue does that, but still)
                    vals = rng.choices(range(top[bkey] + n), k=n)
                for p in range(rng.randrange(1, 4)):
                    part = vals[p::3]
                    got.note(bkey, _offsets(part), p)
                    want.note(bkey, _offsets(part), p)
                    got.rotate(limit)
                    want.rotate(limit)
            else:  # a NACK, maybe naming a packet twice or one never sent
                vals = [rng.randrange(top[bkey] + 3) for _ in range(rng.randrange(0, 12))]
                assert got.pop(bkey, _offsets(vals)) == want.pop(bkey, _offsets(vals)), trial
            assert got.as_dicts() == (want.new, want.old), trial
            assert got.live == len(want.new)
