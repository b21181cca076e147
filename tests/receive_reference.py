"""Frozen copies of the receive path as it was before the per-buffer and
vectorised versions (main at 027d2bc): `decode_batch` (dlcp/wire/batch.py,
three numpy calls per header check, per-packet indexing) and `NetworkIn._receive`
(dlcp/daemon/server.py, one Python step per datagram). The references that
tests/test_receive_fast.py holds the new code to, datagram for datagram. Not
used by dlcp itself; do not change them to follow the code.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dlcp.daemon.flow import CREDIT_STEP
from dlcp.errors import Reason
from dlcp.wire.batch import _DATA_BITS, _SUM_BITS, _VALID_CODEC, _VALID_TYPE, HEADER_DTYPE, Batch
from dlcp.wire.header import (
    ALL_FLAGS,
    HEADER_SIZE,
    MAC_OFFSET,
    MAC_SIZE,
    MAGIC,
    MAX_PAYLOAD,
    MAX_PRIORITY,
    VERSION,
    Flags,
    PacketType,
    header_of_valid,
)
from dlcp.wire.mac import MacKey

_JOB = struct.Struct("!I")
_DATA = int(PacketType.DATA)
_NACK = int(PacketType.NACK)
_ACKING = frozenset({int(PacketType.RESULT), int(PacketType.ACK), int(PacketType.DONE)})


def reference_decode_batch(
    datagrams: Sequence[bytes | memoryview], keys: Mapping[int, MacKey]
) -> Batch:
    """Validate and authenticate a batch of datagrams; never raises for bad input."""
    n = len(datagrams)
    views = [memoryview(d).cast("B") for d in datagrams]
    lengths = np.fromiter(map(len, views), dtype=np.int64, count=n)
    reasons = np.zeros(n, dtype=np.int64)
    full = lengths >= HEADER_SIZE
    reasons[~full] = Reason.TRUNCATED
    if full.all():  # the usual case: one join of the header views, no per-packet copies
        heads = np.frombuffer(b"".join([v[:HEADER_SIZE] for v in views]), dtype=HEADER_DTYPE)
        heads = heads.copy()  # writable, like the zeroed array below
    else:
        heads = np.zeros(n, dtype=HEADER_DTYPE)
        if full.any():
            raw = b"".join([views[i][:HEADER_SIZE] for i in np.flatnonzero(full).tolist()])
            heads[full] = np.frombuffer(raw, dtype=HEADER_DTYPE)

    def reject(mask: np.ndarray, reason: Reason) -> None:
        hit = mask & (reasons == 0)
        reasons[hit] = reason

    live = reasons == 0
    reject(live & (heads["magic"] != MAGIC), Reason.BAD_MAGIC)
    reject(heads["version"] != VERSION, Reason.BAD_VERSION)
    ptype = heads["type"].astype(np.int64)
    reject(~_VALID_TYPE[ptype], Reason.BAD_TYPE)
    flags = heads["flags"].astype(np.int64)
    reject((flags & ~ALL_FLAGS) != 0, Reason.BAD_FLAGS)
    codec = heads["codec"].astype(np.int64)
    reject(~_VALID_CODEC[codec], Reason.BAD_CODEC)
    reject(heads["reserved"] != 0, Reason.RESERVED)
    reject(heads["priority"] > MAX_PRIORITY, Reason.BAD_PRIORITY)

    count = heads["count"].astype(np.int64)
    offset = heads["offset"].astype(np.int64)
    total = heads["total"].astype(np.int64)
    lanes = (ptype == PacketType.DATA) | (ptype == PacketType.RESULT)
    reject(lanes & (count == 0), Reason.BAD_RANGE)
    reject(lanes & (offset + count > total), Reason.BAD_RANGE)
    reject((ptype == PacketType.DATA) & (heads["contributors"] == 0), Reason.BAD_RANGE)
    # same order as header._check: payload cap, payload length, then param
    reject(lengths - HEADER_SIZE > MAX_PAYLOAD, Reason.BAD_LENGTH)

    summed = (ptype == PacketType.RESULT) | ((flags & Flags.SUMMED) != 0)
    bits = np.where(summed, _SUM_BITS[codec], _DATA_BITS[codec])
    want = np.select(
        [
            lanes,
            ptype == PacketType.NACK,
            ptype == PacketType.DONE,
            ptype == PacketType.ACK,
        ],
        [(count * bits + 7) // 8, 4 * count, (count + 7) // 8, np.zeros_like(count)],
        default=count,
    )
    reject(want != lengths - HEADER_SIZE, Reason.BAD_LENGTH)
    reject(~np.isfinite(heads["param"]), Reason.BAD_RANGE)  # no cast: sNaN would warn

    candidates = np.flatnonzero(reasons == 0)
    jobs = heads["job"]
    verified = np.zeros(n, dtype=bool)
    if candidates.size:
        cand_jobs = jobs[candidates]
        for job in np.unique(cand_jobs).tolist():
            mine = candidates[cand_jobs == job].tolist()
            key = keys.get(job)
            if key is None:
                reasons[mine] = Reason.UNKNOWN_JOB
                continue
            if isinstance(key, bytes):
                base = hashlib.blake2b(key=key, digest_size=MAC_SIZE)
                for i in mine:
                    v = views[i]
                    h = base.copy()
                    h.update(v[:MAC_OFFSET])
                    h.update(v[HEADER_SIZE:])
                    verified[i] = hmac.compare_digest(h.digest(), v[MAC_OFFSET:HEADER_SIZE])
            else:  # one batched call for the job's packets, one array comparison
                tags = key.tags(
                    [views[i][:MAC_OFFSET] for i in mine], [views[i][HEADER_SIZE:] for i in mine]
                )
                want = np.frombuffer(tags, np.uint8).reshape(len(mine), MAC_SIZE)
                got = heads["mac"][mine].view(np.uint8).reshape(len(mine), MAC_SIZE)
                # every byte of every tag is compared (no early exit per tag), so the
                # time taken says nothing about where a forged tag goes wrong
                verified[mine] = (want == got).all(axis=1)
        bad_mac = candidates[~verified[candidates] & (reasons[candidates] == 0)]
        reasons[bad_mac] = Reason.BAD_MAC
    accepted = np.flatnonzero(verified).tolist()
    payloads = [views[i][HEADER_SIZE:] for i in accepted]

    rejects: Counter[Reason] = Counter()
    bad = reasons[reasons != 0]
    if bad.size:
        for code, k in zip(*np.unique(bad, return_counts=True), strict=True):
            rejects[Reason(int(code))] = int(k)
    idx = np.asarray(accepted, dtype=np.int64)
    return Batch(fields=heads[idx], payloads=payloads, index=idx, rejects=rejects)


def reference_receive(self: Any, path: Any) -> None:
    """`NetworkIn._receive` as it was (`self`: the daemon; `path.receive` yields datagrams)."""
    now = self.now
    engine = self.engine
    jobs = self.jobs
    rx = 0
    rx_bytes = 0
    dgs: list[memoryview] = []
    nodes: list[int | None] = []
    owners: list[Any] = []
    senders: dict[Any, Any] = {}  # added (flow control): peer -> a job of its datagrams
    for dg, src in path.receive(256):
        rx += 1
        rx_bytes += len(dg)
        node = None
        job = None
        if len(dg) >= HEADER_SIZE:
            job = jobs.get(_JOB.unpack_from(dg, 8)[0])
            if job is not None:
                node = job.node_of.get(src)
                if node is None:
                    self.daemon_rejects["bad_address"] += 1
                    continue
                peer = job.peers.get(node)
                if peer is not None:  # added: the bytes each peer's credits count
                    peer.rx_bytes += len(dg)
                    senders[peer] = job
        dgs.append(dg)
        nodes.append(node)
        owners.append(job)
    # changed: counted before the return, so that a batch rejected whole
    # (every datagram from an address outside its job) is counted as received
    self.counters["rx_packets"] += rx
    self.counters["rx_bytes"] += rx_bytes
    for peer, job in senders.items():  # added: credited every CREDIT_STEP bytes
        if peer.rx_bytes - peer.rx_credited >= CREDIT_STEP:
            self._credit(peer, job)
    if not dgs:
        return
    acked: dict[Any, int] = {}
    for i in engine.receive_many(dgs, now, nodes).tolist():
        dg = dgs[i]
        kind = dg[3]
        if kind == _DATA:
            continue
        job, node = owners[i], nodes[i]
        if job is None or node is None:
            continue
        peer = job.peers.get(node)
        if peer is None:
            continue
        if kind == _NACK:
            h = header_of_valid(dg)
            if h.count:  # changed: a NACK asking only for the DONE counted as one lost packet
                self.outbox.on_loss(peer, h.count, now)
            spec = job.spec
            self.outbox.on_nack(
                peer, h, dg, shards=len(spec.owners), payload=spec.payload, now=now,
                ranks=spec.ranks,
            )  # fmt: skip
        elif kind in _ACKING:
            acked[peer] = acked.get(peer, 0) + len(dg)
    for peer, nbytes in acked.items():  # once per peer and batch
        peer.rate.on_ack(nbytes, None, now)
