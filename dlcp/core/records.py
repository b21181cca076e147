"""What the protocol engine (`dlcp.core.engine`) takes and gives, and what it
keeps of a round: a job's membership (`JobSpec`), the datagrams it hands out
(`Send`, `SendBatch`), the events it reports (`RoundComplete`,
`RoundFailed`), and its records of this node's contribution and of the shards
it finished (`_Contribution`, `_Finished`, kept to answer NACKs), and the
counters its parts share (`Tally`).
"""

from __future__ import annotations

import functools
import struct
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np

from dlcp.codecs import lanes as lane_ops
from dlcp.core.aggregate import ShardResult
from dlcp.core.layout import DEFAULT_PAYLOAD, Layout
from dlcp.errors import LocalError, Reason
from dlcp.wire.header import HEADER_SIZE, Codec, Flags, narrow_fits
from dlcp.wire.mac import MAC_ALGORITHMS

__all__ = [
    "ALLREDUCE",
    "ALL_GATHER",
    "CONTROL_CLASS",
    "LOWEST_RELIABLE_CLASS",
    "REDUCE_SCATTER",
    "RETRANSMIT_CLASS",
    "ROUND_KINDS",
    "Event",
    "JobSpec",
    "OpKey",
    "RoundComplete",
    "RoundFailed",
    "Send",
    "SendBatch",
    "Tally",
    "manifest_capacity",
    "nack_capacity",
    "ps_problem",
    "ps_shards",
]

OpKey = tuple[int, int, int]  # job, round, bucket

# What a round moves (`Engine.submit(kind=...)`): both legs (the sums to every
# contributor), the DATA leg only (each owner keeps its shard's sums: a
# reduce-scatter) or the RESULT leg only (each owner sends its own shard as
# the result: an all-gather). One-leg rounds need transpose membership.
ALLREDUCE = "allreduce"
REDUCE_SCATTER = "reduce_scatter"
ALL_GATHER = "all_gather"
ROUND_KINDS = (ALLREDUCE, REDUCE_SCATTER, ALL_GATHER)

# header fields that packets of one run (`Engine.receive_many`) share
_U32 = struct.Struct("!I")

_F32 = struct.Struct("!f")

CONTROL_CLASS = 0

RETRANSMIT_CLASS = 1  # recovered packets are needed now: top gradient class

LOWEST_RELIABLE_CLASS = 5


# shards of a bucket in a "switch" job (`JobSpec.switch`): the pipeline's depth
SWITCH_SHARDS = 8


def ps_shards(aggregators: int) -> int:
    """How a "ps" job cuts its buckets among `aggregators` servers: at least
    SWITCH_SHARDS, the same number each (BytePS's partitions: a server sums and
    sends back one while the next comes in, so up and down overlap)."""
    return -(-SWITCH_SHARDS // max(1, aggregators)) * max(1, aggregators)


def ps_problem(hosts: int, aggregators: Sequence[int], contributors: Sequence[int]) -> str | None:
    """Why a "ps" job of `hosts` nodes with these aggregators (shard owners) and
    contributors cannot work, or None if it can."""
    if not aggregators:
        return "a ps job needs at least one aggregator"
    if not contributors:
        return "a ps job needs at least one contributor"
    for name, nodes in (("aggregator", aggregators), ("contributor", contributors)):
        for i in nodes:
            if not 0 <= i < hosts:
                return f"{name} {i} is not a host of the job (hosts 0..{hosts - 1})"
        if len(set(nodes)) != len(nodes):
            dup = sorted({i for i in nodes if list(nodes).count(i) > 1})
            return f"{name}s list host(s) {dup} twice"
    idle = sorted(set(range(hosts)) - set(aggregators) - set(contributors))
    if idle:
        return f"host(s) {idle} neither aggregate nor contribute"
    return None


@dataclass(frozen=True)
class JobSpec:
    """One job's membership as this node sees it."""

    job: int
    key: bytes
    me: int
    contributors: tuple[int, ...]
    owners: tuple[int, ...]  # owner node of shard s
    payload: int = DEFAULT_PAYLOAD
    window: int = 256  # rounds behind the newest that are still accepted
    mac: str = "blake2b"  # the packet MAC function (dlcp/wire/mac.py), the same at every node
    ranks: int = 0  # the job's ranks, every contribution a lane can sum (0: not known)

    @classmethod
    def transpose(cls, job: int, key: bytes, me: int, hosts: int, **kw: Any) -> JobSpec:
        nodes = tuple(range(hosts))
        return cls(job=job, key=key, me=me, contributors=nodes, owners=nodes, **kw)

    @classmethod
    def switch(
        cls, job: int, key: bytes, me: int, hosts: int, shards: int = SWITCH_SHARDS, **kw: Any
    ) -> JobSpec:
        """Hosts 0..hosts-2 contribute; the last, an aggregator in the switch,
        owns every shard. The bucket is still cut into `shards`, so that the
        aggregator sums and sends back each shard as soon as it is whole, while
        the contributors are still sending the next: up and down overlap as in
        a switch that sums packet by packet."""
        agg = hosts - 1
        return cls(
            job=job, key=key, me=me, contributors=tuple(range(agg)), owners=(agg,) * shards, **kw
        )

    @classmethod
    def ps(
        cls,
        job: int,
        key: bytes,
        me: int,
        hosts: int,
        aggregators: Sequence[int],
        contributors: Sequence[int],
        shards: int | None = None,
        **kw: Any,
    ) -> JobSpec:
        """A parameter-server job: `aggregators` own the shards (`shards` of
        them, default `len(aggregators)`, dealt round robin), `contributors`
        send. An aggregator may contribute too (co-located servers)."""
        why = ps_problem(hosts, aggregators, contributors)
        n = len(aggregators) if shards is None else shards
        if why is None and not (1 <= n <= 65535 and n % len(aggregators) == 0):
            why = f"{n} shards do not deal evenly among {len(aggregators)} aggregators"
        if why is not None:
            raise LocalError(f"job {job}: {why}")
        owners = tuple(aggregators[s % len(aggregators)] for s in range(n))
        return cls(job=job, key=key, me=me, contributors=tuple(contributors), owners=owners, **kw)

    def layout(self, total: int, codec: int) -> Layout:
        """A bucket's layout in this job; THC's results in whole data packets
        of its narrow sums where no sum of the job's ranks can pass them."""
        return Layout(
            total=total,
            codec=Codec(codec),
            shards=len(self.owners),
            payload=self.payload,
            narrow=narrow_fits(codec, self.ranks),
        )

    def __post_init__(self) -> None:
        if not self.contributors or not self.owners:
            raise LocalError(f"job {self.job}: no contributors or no owners")
        if len(set(self.contributors)) != len(self.contributors):
            raise LocalError(f"job {self.job}: duplicate contributors")
        if self.me not in self.contributors and self.me not in self.owners:
            raise LocalError(f"job {self.job}: node {self.me} is not a member")
        if len(self.contributors) > lane_ops.MAX_CONTRIBUTORS:
            raise LocalError(f"job {self.job}: more than {lane_ops.MAX_CONTRIBUTORS} contributors")
        if self.ranks and not len(self.contributors) <= self.ranks <= lane_ops.MAX_CONTRIBUTORS:
            raise LocalError(
                f"job {self.job}: {self.ranks} ranks for {len(self.contributors)} contributors"
            )
        if len(self.key) < 16:
            raise LocalError(f"job {self.job}: MAC key shorter than 16 bytes")
        if self.mac not in MAC_ALGORITHMS:
            raise LocalError(f"job {self.job}: MAC {self.mac!r} is not one of {MAC_ALGORITHMS}")

    @functools.cached_property
    def members(self) -> frozenset[int]:
        """Every node of the job (kept: the engine asks once a control packet)."""
        return frozenset(self.contributors) | frozenset(self.owners)

    def senders_to(self, node: int) -> frozenset[int]:
        """The other nodes that send `node` a bucket's bytes: the contributors
        when it owns shards (data), the owners when it contributes (results)."""
        out: set[int] = set()
        if node in self.owners:
            out.update(self.contributors)
        if node in self.contributors:
            out.update(self.owners)
        out.discard(node)
        return frozenset(out)


class Send(NamedTuple):
    """A datagram for node `node`, in priority class `priority`."""

    node: int
    datagram: bytes
    priority: int
    droppable: bool = False
    kind: str = "data"  # data | result | control: for metrics


class SendBatch(NamedTuple):
    """Datagrams of one job for node `node`, in order, with their priority
    classes and droppable flags (`droppable` None: none is droppable). The
    engine hands out its datagrams in these: one per shard's run of packets, so
    nothing downstream makes or reads an object per datagram."""

    node: int
    datagrams: list[bytes]
    priorities: list[int]
    droppable: list[bool] | None = None
    kind: str = "data"  # data | result | control: for metrics

    def sends(self) -> list[Send]:
        """The batch as one `Send` per datagram."""
        drop: Iterable[bool] = repeat(False) if self.droppable is None else self.droppable
        return [
            Send(self.node, dg, p, d, self.kind)
            for dg, p, d in zip(self.datagrams, self.priorities, drop, strict=False)
        ]


class Tally:
    """The engine's counters, which its parts share: what happened (`stats`),
    the packets rejected, by reason (`rejects`), and the last internal error
    met (`last_error`)."""

    __slots__ = ("last_error", "rejects", "stats")

    def __init__(self) -> None:
        self.stats: Counter[str] = Counter()
        self.rejects: Counter[Reason] = Counter()
        self.last_error = ""


def _batch(
    node: int,
    datagrams: list[bytes],
    priorities: list[int],
    droppable: list[bool] | None,
    kind: str,
) -> SendBatch:
    if len(priorities) != len(datagrams):
        raise ValueError(f"{len(datagrams)} datagrams but {len(priorities)} priorities")
    if droppable is not None and len(droppable) != len(datagrams):
        raise ValueError(f"{len(datagrams)} datagrams but {len(droppable)} droppable flags")
    return SendBatch(node, datagrams, priorities, droppable, kind)


_RETRANSMIT = int(Flags.RETRANSMIT)


def _retransmitted(heads: np.ndarray) -> bool:
    """Whether any of a run's header records is a retransmission."""
    return bool((heads["flags"] & _RETRANSMIT).any())


def _int_list(a: np.ndarray) -> list[int]:
    """`a.tolist()`; where every element is one value (a bucket's packets in
    one class, the usual case) the list repeats one int, made once."""
    if a.size and a.min() == a.max():
        return [int(a[0])] * a.size
    return a.tolist()


def manifest_capacity(payload: int) -> int:
    """How many packets one DONE part covers within a payload budget of
    `payload` bytes (a bit each, whole bytes: a multiple of 8)."""
    return max(1, payload) * 8


def nack_capacity(payload: int) -> int:
    """How many packets one NACK lists within a payload budget of `payload`
    bytes (a u32 index each)."""
    return max(1, payload // 4)


def _control(node: int, datagram: bytes) -> SendBatch:
    return SendBatch(node, [datagram], [CONTROL_CLASS], None, "control")


@dataclass
class RoundComplete:
    job: int
    round: int
    bucket: int
    layout: Layout
    sums: np.ndarray  # summed lanes of the whole bucket
    contributors: np.ndarray  # per data packet: contributions in its sums
    block_max: np.ndarray  # per data packet: max block magnitude (next scale)
    lost_lanes: int
    total_lanes: int


@dataclass
class RoundFailed:
    job: int
    round: int
    bucket: int
    reason: str


Event = RoundComplete | RoundFailed


@dataclass
class _Contribution:
    """What this node sent for a round, kept to answer NACKs."""

    spec: JobSpec
    layout: Layout
    round: int
    bucket: int
    lanes: memoryview  # data lanes (or summed lanes) of the whole bucket
    summed: bool
    weight: int
    classes: np.ndarray
    droppable: np.ndarray
    layers: np.ndarray
    bound: float
    scale: float
    block_max: np.ndarray
    resent: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    kind: str = ALLREDUCE  # ROUND_KINDS
    # per packet, the lowest class any contributor gives it unless droppable
    # (the priority policy's; None: not known)
    class_bounds: np.ndarray | None = None


@dataclass
class _Finished:
    """A completed shard that this node owns, kept for result NACKs."""

    spec: JobSpec
    layout: Layout
    round: int
    bucket: int
    result: ShardResult
    classes: np.ndarray
    layers: np.ndarray
    until: float
    waiting: set[int] = field(default_factory=set)  # receivers yet to ACK
    resent: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    # the shard's result datagrams as first sent (one set serves every
    # receiver: nothing in them names it) and their classes; retransmissions
    # re-MAC their payloads, so `result.sums` is never read again and may be
    # the caller's `out`, which it reuses once the round completes here
    datagrams: list[bytes] | None = None
    classes_sent: list[int] | None = None
    codec_sent: int | None = None  # their codec: the layout's, or its narrow sums
    gathered: bool = False  # `datagrams` read `result.sums` in place
    # an all-gather's receivers not yet known to have submitted the round
    # (their DONE manifest, "ready", has not come): their results wait for it
    deferred: set[int] = field(default_factory=set)
    # per result packet, whether it went early (`dlcp.core.early`); None: none;
    # and those datagrams with their classes, by result index
    early: np.ndarray | None = None
    early_datagrams: dict[int, tuple[bytes, int]] | None = None


def _payload_of(datagram: Any) -> memoryview:
    """A sent datagram's payload: bytes after the header, or a `Gathered`
    datagram's payload in place."""
    if isinstance(datagram, bytes | bytearray | memoryview):
        return memoryview(datagram)[HEADER_SIZE:]
    payload: memoryview = datagram.payload
    return payload
