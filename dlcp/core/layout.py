"""How a bucket is cut into packets and shards; the same on every host.

A bucket of `total` lanes (encoded elements) is cut into data packets of
`per_packet` lanes (all but the last full). Shard s of H owns a contiguous run
of whole packets, so every host can compute, from the header fields alone,
which packets it should receive. Result lanes may be wider than data lanes
(THC sums are 16 bit), so each data packet's result is sent as `result_split`
result packets that still fit in the payload budget; where THC's results always
go in its narrow sums (`narrow`: 10 bits for thc8, the job's ranks cannot sum
past them) one result packet holds a whole data packet's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from dlcp.errors import LocalError
from dlcp.wire.header import LANE_BITS, MAX_PAYLOAD, NARROW_SUMS, RESULT_ONLY_CODECS, Codec

__all__ = ["DEFAULT_PAYLOAD", "Layout", "lanes_per_packet"]

# 1500-byte MTU - 20 IPv4 - 8 UDP - 64 dlcp header.
DEFAULT_PAYLOAD = 1408

_BLOCK_CODECS = frozenset({Codec.THC8, Codec.THC4})
_MAX_TOTAL = 0xFFFFFFFF  # Header.total is u32
_MAX_SHARDS = 0x10000  # Header.shard is u16


def lanes_per_packet(codec: int, payload: int = DEFAULT_PAYLOAD) -> int:
    """Lanes in a full data packet: whole lanes within `payload` bytes.

    Block codecs (THC rotates each packet's block with a Hadamard transform) use
    the largest power of two that fits.
    """
    if not 8 <= payload <= MAX_PAYLOAD:
        raise LocalError(f"payload budget {payload} outside 8..{MAX_PAYLOAD} bytes")
    if codec not in LANE_BITS or codec in RESULT_ONLY_CODECS:
        raise LocalError(f"unknown codec {codec}")
    bits = LANE_BITS[codec][0]
    n = payload * 8 // bits
    if codec in _BLOCK_CODECS:
        n = 1 << (n.bit_length() - 1)
    return n


@dataclass(frozen=True)
class Layout:
    total: int  # lanes in the bucket
    codec: Codec
    shards: int
    payload: int = DEFAULT_PAYLOAD
    # THC's results always in its narrow sums (every sum the job's ranks can
    # make fits them: `JobSpec.layout`), so a result packet is cut for those
    narrow: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.total <= _MAX_TOTAL:
            raise LocalError(f"bucket of {self.total} lanes (header field is u32)")
        if not 0 < self.shards <= _MAX_SHARDS:
            raise LocalError(f"{self.shards} shards (header field is u16)")
        _ = self.per_packet  # checks the codec and payload budget now, not at first use
        if self.narrow and self.codec not in NARROW_SUMS:
            raise LocalError(f"{Codec(self.codec).name} has no narrow sums")
        if self.codec in _BLOCK_CODECS and self.total % self.per_packet:
            raise LocalError(
                f"{self.codec.name} bucket of {self.total} lanes is not a multiple of "
                f"its block of {self.per_packet}"
            )

    @cached_property
    def per_packet(self) -> int:
        return lanes_per_packet(self.codec, self.payload)

    @cached_property
    def packets(self) -> int:
        return -(-self.total // self.per_packet)

    def packet_range(self, i: int) -> tuple[int, int]:
        """(offset, count) of data packet i."""
        off = i * self.per_packet
        return off, min(self.per_packet, self.total - off)

    def packet_of(self, offset: int) -> int:
        return offset // self.per_packet

    def shard_packets(self, shard: int) -> range:
        """Indices of the data packets that shard `shard` owns."""
        return range(self.packets * shard // self.shards, self.packets * (shard + 1) // self.shards)

    def shard_of_packet(self, i: int) -> int:
        # inverse of shard_packets: the s with P*s//H <= i < P*(s+1)//H
        return ((i + 1) * self.shards - 1) // self.packets

    def shard_range(self, shard: int) -> tuple[int, int]:
        """(offset, count) in lanes of a shard."""
        pk = self.shard_packets(shard)
        if not pk:
            return 0, 0
        start = pk.start * self.per_packet
        end = min(pk.stop * self.per_packet, self.total)
        return start, end - start

    @cached_property
    def result_split(self) -> int:
        """Result packets per data packet (summed lanes may be wider)."""
        # split by whole summed lanes, so every ceil(per_packet / split) run fits
        sums = NARROW_SUMS[self.codec] if self.narrow else self.codec
        fit = self.payload * 8 // LANE_BITS[sums][1]
        return -(-self.per_packet // fit)

    def result_ranges(self, i: int) -> list[tuple[int, int]]:
        """(offset, count) of the result packets for data packet i."""
        off, count = self.packet_range(i)
        step = -(-self.per_packet // self.result_split)
        return [(o, min(step, off + count - o)) for o in range(off, off + count, step)]

    def result_index(self, offset: int) -> int:
        """Global index of the result packet that starts at lane `offset`."""
        i = self.packet_of(offset)
        step = -(-self.per_packet // self.result_split)
        return i * self.result_split + (offset - i * self.per_packet) // step

    def shard_results(self, shard: int) -> Sequence[tuple[int, int]]:
        """(offset, count) of every result packet of a shard, in order, packet
        by packet (the engine takes `shard_result_arrays` and
        `shard_result_count`, which give the same without a tuple apiece)."""
        return [r for i in self.shard_packets(shard) for r in self.result_ranges(i)]

    def shard_result_count(self, shard: int) -> int:
        """len(shard_results(shard)), without listing them."""
        pk = self.shard_packets(shard)
        if not pk:
            return 0
        step = -(-self.per_packet // self.result_split)
        # every packet but a shorter last one of the bucket has `per_packet` lanes
        last = self.packet_range(pk.stop - 1)[1]
        return (len(pk) - 1) * -(-self.per_packet // step) + -(-last // step)

    def shard_result_arrays(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """`shard_results(shard)` as two int64 arrays, offsets and counts
        (computed with a few numpy operations, not a tuple per packet)."""
        pk = self.shard_packets(shard)
        per = self.per_packet
        off = np.arange(pk.start, pk.stop, dtype=np.int64) * per
        end = np.minimum(off + per, self.total)
        step = -(-per // self.result_split)
        k = -(-(end - off) // step)  # result packets of each data packet
        if k.size and k.max() == 1:
            return off, end - off
        first = np.repeat(np.cumsum(k) - k, k)  # each result packet's first sibling
        offs = np.repeat(off, k) + (np.arange(int(k.sum()), dtype=np.int64) - first) * step
        return offs, np.minimum(step, np.repeat(end, k) - offs)

    def packet_counts(self) -> np.ndarray:
        """Lane count of every data packet."""
        counts = np.full(self.packets, self.per_packet, dtype=np.int64)
        counts[-1] = self.total - (self.packets - 1) * self.per_packet
        return counts
