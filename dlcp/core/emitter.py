"""Making a round's datagrams: this node's data packets for each shard's owner
and their DONE manifest, an owner's result packets and its result DONE, the
NACKs that ask for what is missing, the ACKs of whole shards and CONTROL
packets. Each goes into the emitter's outgoing `SendBatch`es with its class
and droppable flag.

`Emitter` reads only what it is given (a round's `_Contribution` or
`_Finished`, a job's spec) and the jobs' MAC keys; what it keeps is its own
queue of batches, which the engine drains (`take`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dlcp.codecs import lanes as lane_ops
from dlcp.core.aggregate import Nack
from dlcp.core.layout import Layout
from dlcp.core.records import (
    CONTROL_CLASS,
    LOWEST_RELIABLE_CLASS,
    RETRANSMIT_CLASS,
    JobSpec,
    OpKey,
    SendBatch,
    _batch,
    _Contribution,
    _control,
    _Finished,
    _int_list,
    _payload_of,
    manifest_capacity,
    nack_capacity,
)
from dlcp.errors import LocalError
from dlcp.wire.batch import HEADER_DTYPE, encode_batch
from dlcp.wire.header import LANE_BITS, Codec, Flags, Header, PacketType, encode
from dlcp.wire.mac import MacKey, mac_state
from dlcp.wire.slices import Slices

if TYPE_CHECKING:
    from dlcp.core.early import EarlyResults

__all__ = ["Emitter"]


class Emitter:
    """The datagrams of rounds, queued in batches until taken."""

    def __init__(self, keys: dict[int, MacKey], stats: Counter[str], *, gather: bool) -> None:
        self.keys = keys  # the engine's, per job (read only here)
        self.stats = stats
        self.gather = gather
        self.out: list[SendBatch] = []

    def take(self) -> list[SendBatch]:
        """The batches queued since the last call, in order."""
        out, self.out = self.out, []
        return out

    def _mac(self, spec: JobSpec) -> MacKey:
        key = self.keys.get(spec.job)
        return key if key is not None else mac_state(spec.key, spec.mac)

    # -- packet building ---------------------------------------------------
    @staticmethod
    def _heads(n: int, **common: Any) -> np.ndarray:
        """`n` header records, each with the `common` fields (the rest 0): the
        fields all packets share are set in one record, which is copied into
        each, instead of a pass over all records per field."""
        one = np.zeros(1, dtype=HEADER_DTYPE)
        for name, value in common.items():
            one[name] = value
        return np.repeat(one, n)

    def data(
        self,
        c: _Contribution,
        shard: int,
        owner: int,
        only: Sequence[int] | None,
        gathered: list[list[bytes]],
    ) -> None:
        """The shard's data packets to `owner` (`only` these, resent); gathered
        datagrams (`gather`) are noted in `gathered`, the round's list."""
        lay = c.layout
        pk = lay.shard_packets(shard)
        idx = np.arange(pk.start, pk.stop) if only is None else pk.start + np.asarray(only, int)
        if idx.size == 0:
            return
        # the per-packet arrays of these packets: views of the shard's range on a
        # first send, not copies made by indexing with `idx`
        pick: slice | np.ndarray = slice(pk.start, pk.stop) if only is None else idx
        h = self._heads(
            idx.size,
            type=PacketType.DATA,
            codec=lay.codec,
            job=c.spec.job,
            round=c.round,
            bucket=c.bucket,
            shard=shard,
            sender=c.spec.me,
            contributors=c.weight,
            total=lay.total,
            param=c.scale,
        )
        offs = idx * lay.per_packet
        counts = np.minimum(lay.per_packet, lay.total - offs)
        drop = c.droppable[pick] if only is None else np.zeros(idx.size, bool)
        flags = np.where(drop, int(Flags.DROPPABLE), 0) | (int(Flags.SUMMED) if c.summed else 0)
        if only is None:
            flags[-1] |= int(Flags.LAST)
            prio = c.classes[pick]
        else:
            flags |= int(Flags.RETRANSMIT)
            prio = np.minimum(c.classes[idx], RETRANSMIT_CLASS).astype(np.uint8)
        h["flags"] = flags
        h["priority"] = prio
        h["layer"] = c.layers[pick]
        h["offset"] = offs
        h["count"] = counts
        h["aux"] = c.block_max[pick].view(np.uint32)
        bits = LANE_BITS[lay.codec][1 if c.summed else 0]
        # lane_bytes, for every packet at once; no slice object per packet
        payloads = Slices(c.lanes, (offs * bits + 7) // 8, (counts * bits + 7) // 8)
        dgs = encode_batch(h, payloads, self._mac(c.spec), gather=self.gather)
        if self.gather:
            gathered.append(dgs)
        self.out.append(
            _batch(owner, dgs, _int_list(prio), drop.tolist() if drop.any() else None, "data")
        )
        self.stats["data_packets_sent" if only is None else "data_retransmits"] += idx.size

    def manifest(self, c: _Contribution, shard: int, owner: int, copies: int) -> None:
        """The shard's DONE: a bit a packet (droppable or not), in parts of
        `manifest_capacity` packets, each within the job's payload budget
        (one IP packet; one DONE for all of a large shard was IP-fragmented
        past about 11,000 packets, and could not be encoded past 523,544).
        A part's `offset` is its first packet, `count` its packets."""
        pk = c.layout.shard_packets(shard)
        bits = c.droppable[pk.start : pk.stop]
        per = manifest_capacity(c.layout.payload)
        key = self._mac(c.spec)
        parts = []
        for first in range(0, max(bits.size, 1), per):
            part = bits[first : first + per]
            header = Header(
                type=PacketType.DONE,
                job=c.spec.job,
                round=c.round,
                bucket=c.bucket,
                flags=Flags.LAST,
                priority=CONTROL_CLASS,
                codec=c.layout.codec,
                shard=shard,
                sender=c.spec.me,
                contributors=c.weight,
                offset=first,
                count=part.size,
                total=c.layout.total,
                param=c.bound,
            )
            parts.append(encode(header, np.packbits(part, bitorder="little").tobytes(), key))
        for _ in range(copies):
            for dg in parts:
                self.out.append(_control(owner, dg))

    def results(
        self,
        f: _Finished,
        node: int,
        only: Sequence[int] | None,
        gathered: list[list[bytes]] | None = None,
    ) -> None:
        """The shard's result packets to `node` (`only` these, resent); a first
        send from sums that may be the caller's `out` notes its gathered
        datagrams in `gathered` (the round's list while its collector is open)."""
        if only is None and f.datagrams is not None:  # the same datagrams to another receiver
            assert f.classes_sent is not None
            self._send_results(f, node, f.datagrams, f.classes_sent)
            return
        lay = f.layout
        shard = f.result.shard
        ranges = lay.shard_result_arrays(shard)
        pick: slice | np.ndarray = slice(None)
        if only is not None:
            pick = np.asarray(only, dtype=np.int64)
        elif f.early is not None:  # those sent early are not made again
            pick = np.flatnonzero(~f.early)
        offs = ranges[0][pick]
        counts = ranges[1][pick]
        if offs.size == 0:
            if only is None and f.early is not None:  # all went early: kept for NACKs
                f.datagrams, f.classes_sent = self._with_early(f, offs, [], [])
            return
        local = offs // lay.per_packet - lay.shard_packets(shard).start
        payloads: Sequence[bytes | memoryview]
        if only is None:  # the whole shard: packed once, sliced per packet
            rel = offs - lay.shard_range(shard)[0]
            codec: int = lay.codec
            narrow = lane_ops.narrow_sums(codec, f.result.sums, rel, counts)
            if narrow is not None:  # THC's sums in the bits they need
                codec, wire = narrow
            else:
                wire = lane_ops.summed_wire(codec, f.result.sums)
            if f.codec_sent is not None and codec != f.codec_sent:  # see `early_codec`
                raise LocalError(f"shard {shard}: results in codec {codec} after {f.codec_sent}")
            view = wire.data.cast("B")  # no copy where the sums are wire lanes already
            bits = LANE_BITS[codec][1]  # 1-bit and 10-bit lanes start on packet bytes
            payloads = Slices(view, rel * bits // 8, (counts * bits + 7) // 8)
        else:  # the payloads first sent (the sums may have been overwritten since)
            assert f.datagrams is not None
            codec = lay.codec if f.codec_sent is None else f.codec_sent
            payloads = [_payload_of(f.datagrams[int(j)]) for j in only]
        # a retransmission in the top gradient class, as data's are: needed now,
        # and all in one queue, so that one that comes says those asked for
        # before it and still missing were lost (`dlcp.core.stream`)
        top = LOWEST_RELIABLE_CLASS if only is None else RETRANSMIT_CLASS
        prio = np.minimum(f.classes[local], top)
        h = self._result_heads(
            f.spec,
            (f.spec.job, f.round, f.bucket),
            lay,
            shard,
            offs,
            counts,
            flags=int(Flags.RETRANSMIT) if only is not None else 0,
            codec=codec,
            contributors=f.result.contributors[local],
            block_max=f.result.block_max[local],
            prio=prio,
            layers=f.layers[local],
        )
        dgs = encode_batch(h, payloads, self._mac(f.spec), gather=self.gather and only is None)
        classes = _int_list(prio)
        if only is None:
            if self.gather and gathered is not None and dgs:  # the sums may be the caller's `out`
                gathered.append(dgs)
                f.gathered = True
            if isinstance(pick, np.ndarray):  # some went early
                dgs, classes = self._with_early(f, pick, dgs, classes)
            f.datagrams, f.classes_sent, f.codec_sent = dgs, classes, codec
            self._send_results(f, node, dgs, classes)
            return
        self.out.append(_batch(node, dgs, classes, None, "result"))
        self.stats["result_retransmits"] += offs.size

    @staticmethod
    def _with_early(
        f: _Finished, made: np.ndarray, dgs: list[bytes], classes: list[int]
    ) -> tuple[list[bytes], list[int]]:
        """Every result datagram of the shard, in order: `dgs` (in `classes`)
        at result packets `made`, the ones sent early at the others."""
        assert f.early is not None and f.early_datagrams is not None
        n = f.early.size
        out: list = [None] * n
        cls = [0] * n
        for i, dg, c in zip(made.tolist(), dgs, classes, strict=True):
            out[i], cls[i] = dg, c
        for i, (dg, c) in f.early_datagrams.items():
            out[i], cls[i] = dg, c
        return out, cls

    def _send_results(self, f: _Finished, node: int, dgs: list[bytes], classes: list[int]) -> None:
        """A finished shard's result datagrams to `node`, but those sent early."""
        if f.early is not None:
            unsent = np.flatnonzero(~f.early).tolist()
            dgs, classes = [dgs[i] for i in unsent], [classes[i] for i in unsent]
        if dgs:
            self.out.append(_batch(node, dgs, classes, None, "result"))
        self.stats["result_packets_sent"] += len(dgs)

    def early_results(
        self,
        spec: JobSpec,
        op: OpKey,
        early: EarlyResults,
        whole: np.ndarray,
        nodes: Sequence[int],
    ) -> tuple[np.ndarray, list[bytes], list[int]]:
        """The result packets of the whole data packets `whole` (a mask) of
        `early`'s shard, whose sums its accumulator has made final, to each of
        `nodes`, flagged EARLY (`dlcp.core.early`). Returns the mask of the
        shard's result packets they are, their datagrams and classes."""
        agg = early.agg
        lay, shard = agg.layout, agg.shard
        offs_all, counts_all = lay.shard_result_arrays(shard)[:2]
        pick = whole[offs_all // lay.per_packet - lay.shard_packets(shard).start]
        offs, counts = offs_all[pick], counts_all[pick]
        if not offs.size:
            return pick, [], []
        sums = agg.acc.out
        assert sums is not None
        rel = offs - lay.shard_range(shard)[0]
        codec = early.codec
        assert codec is not None
        spans = [sums[a : a + c] for a, c in zip(rel.tolist(), counts.tolist(), strict=True)]
        if codec == lay.codec:
            wire = lane_ops.summed_wire(codec, np.concatenate(spans))
        else:  # THC's narrow sums, every one fits (`early_codec`)
            wire = lane_ops.narrow_bytes(codec, np.concatenate(spans))
        nbytes = counts * LANE_BITS[codec][1] // 8
        starts = np.concatenate(([0], np.cumsum(nbytes)[:-1]))
        payloads = Slices(wire.data.cast("B"), starts, nbytes)
        h = self._early_heads(
            spec, op, early, offs, counts, int(Flags.EARLY), LOWEST_RELIABLE_CLASS
        )
        prio = h["priority"]
        h["aux"] = early.chain(np.flatnonzero(pick), prio, pick.size)
        dgs = encode_batch(h, payloads, self._mac(spec), gather=False)
        sent = _int_list(prio)
        for node in nodes:
            self.out.append(_batch(node, dgs, sent, None, "result"))
        self.stats["result_packets_sent"] += offs.size * len(nodes)
        self.stats["early_results"] += offs.size * len(nodes)
        return pick, dgs, sent

    def early_resend(
        self, spec: JobSpec, op: OpKey, early: EarlyResults, idx: list[int], node: int
    ) -> None:
        """Result packets `idx` of `early`'s shard, sent early and asked for
        before the shard completed, to `node` again (their first payloads)."""
        offs_all, counts_all = early.agg.layout.shard_result_arrays(early.agg.shard)[:2]
        h = self._early_heads(
            spec, op, early, offs_all[idx], counts_all[idx], int(Flags.RETRANSMIT), RETRANSMIT_CLASS
        )
        payloads = [_payload_of(early.datagrams[j][0]) for j in idx]
        dgs = encode_batch(h, payloads, self._mac(spec), gather=False)
        self.out.append(_batch(node, dgs, _int_list(h["priority"]), None, "result"))
        self.stats["result_retransmits"] += len(idx)

    def _early_heads(
        self,
        spec: JobSpec,
        op: OpKey,
        early: EarlyResults,
        offs: np.ndarray,
        counts: np.ndarray,
        flags: int,
        top: int,
    ) -> np.ndarray:
        """The header records of result packets `offs`/`counts` of `early`'s
        shard, whole (every contribution in), in their classes up to `top`."""
        agg = early.agg
        local = offs // agg.layout.per_packet - agg.layout.shard_packets(agg.shard).start
        return self._result_heads(
            spec,
            op,
            agg.layout,
            agg.shard,
            offs,
            counts,
            flags=flags,
            codec=agg.layout.codec if early.codec is None else early.codec,
            contributors=early.contributors(local),
            block_max=early.block_max(local),
            prio=np.minimum(agg.classes[local], top),
            layers=agg.layers[local],
        )

    def _result_heads(
        self,
        spec: JobSpec,
        op: OpKey,
        lay: Layout,
        shard: int,
        offs: np.ndarray,
        counts: np.ndarray,
        *,
        flags: int,
        codec: int,
        contributors: np.ndarray,
        block_max: np.ndarray,
        prio: np.ndarray,
        layers: np.ndarray,
    ) -> np.ndarray:
        """The header records of result packets `offs`/`counts` of a shard."""
        h = self._heads(
            offs.size,
            type=PacketType.RESULT,
            flags=flags,
            codec=codec,
            job=spec.job,
            round=op[1],
            bucket=op[2],
            shard=shard,
            sender=spec.me,
            total=lay.total,
        )
        h["offset"] = offs
        h["count"] = counts
        h["contributors"] = contributors
        h["param"] = block_max
        h["priority"] = prio
        h["layer"] = layers
        return h

    def result_done(self, f: _Finished, node: int, copies: int) -> None:
        header = Header(
            type=PacketType.DONE,
            job=f.spec.job,
            round=f.round,
            bucket=f.bucket,
            flags=Flags.RESULT_LEG | Flags.LAST,
            priority=CONTROL_CLASS,
            codec=f.layout.codec,
            shard=f.result.shard,
            sender=f.spec.me,
            total=f.layout.total,
            aux=f.result.lost_lanes,
        )
        dg = encode(header, b"", self._mac(f.spec))
        for _ in range(copies):
            self.out.append(_control(node, dg))

    def nack(self, spec: JobSpec, op: OpKey, lay: Layout, nack: Nack, result: bool) -> None:
        """Ask for `nack.packets` again in as many NACK datagrams as it takes
        for each to fit the job's payload budget (`nack_capacity`: one IP
        packet each, however many were lost; before, one NACK listed them all
        and more than about 16,000 could not be encoded). A part's `offset` is
        its place in the list, so the outbox does not take the parts for
        repeats of one another. NEED_MANIFEST: on the result leg the first
        part carries it when the DONE is asked for too; on the data leg every
        part, which tells the sender that this node lacks its DONE (a NACK
        without packets asks for it)."""
        flags = Flags.RESULT_LEG if result else Flags.NONE
        if nack.need_manifest:
            flags |= Flags.NEED_MANIFEST
        wanted = np.asarray(nack.packets, dtype=">u4")
        per = nack_capacity(lay.payload)
        key = self._mac(spec)
        datagrams = []
        for first in range(0, max(wanted.size, 1), per):
            part = wanted[first : first + per]
            header = Header(
                type=PacketType.NACK,
                job=op[0],
                round=op[1],
                bucket=op[2],
                flags=flags if first == 0 or not result else flags & ~Flags.NEED_MANIFEST,
                priority=CONTROL_CLASS,
                codec=lay.codec,
                shard=nack.shard,
                sender=spec.me,
                offset=first,  # the part's place in the list: each part a packet of its own
                count=part.size,
                total=lay.total,
            )
            datagrams.append(encode(header, part.tobytes(), key))
        self.out.append(
            _batch(nack.node, datagrams, [CONTROL_CLASS] * len(datagrams), None, "control")
        )
        self.stats["result_nacks_sent" if result else "data_nacks_sent"] += len(datagrams)

    def ack(
        self, spec: JobSpec, op: OpKey, lay: Layout, shard: int, owner: int, copies: int = 2
    ) -> None:
        """The ACK of result shard `shard` to its owner, in `copies` copies. It
        goes once and is never asked for again, and an owner whose round is
        complete holds it for every receiver's ACK (`Timing.ack_wait`): one lost
        ACK held a round for the whole wait (at 5 % loss, a fourth of the
        rounds of 3 hosts). A copy's `offset` is its number, so the outbox does
        not take the second for a repeat of the first."""
        key = self._mac(spec)
        for k in range(copies):
            header = Header(
                type=PacketType.ACK,
                job=op[0],
                round=op[1],
                bucket=op[2],
                flags=Flags.RESULT_LEG,
                priority=CONTROL_CLASS,
                codec=lay.codec,
                shard=shard,
                sender=spec.me,
                offset=k,
                total=lay.total,
            )
            self.out.append(_control(owner, encode(header, b"", key)))

    def control(self, spec: JobSpec, round: int, payload: bytes) -> bytes:
        """A CONTROL packet of `spec`'s job with `payload`, in round `round`."""
        header = Header(
            type=PacketType.CONTROL,
            job=spec.job,
            round=round,
            bucket=0,
            priority=CONTROL_CLASS,
            codec=Codec.FP32,
            shard=0,
            sender=spec.me,
            count=len(payload),
        )
        return encode(header, payload, self._mac(spec))
