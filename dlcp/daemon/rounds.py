"""Round lifecycle in the daemon: a rank's submitted round started in the engine,
completed or failed back to the ranks, and the jobs the rounds belong to
(made from a join or the config, left when the last rank goes).

`RoundLifecycle` owns the jobs table (`jobs`) and the rounds the local ranks
submit (`rounds`, each a `LocalRound` until its result or failure); it is
given the engine, the outbox (whose peers a job's hosts become), the
policies that classify a round's packets, the counters and the daemon's
callbacks: its clock, `pump`, `call_later` (the event loop's) and
`windows_changed` (`Credits.size_windows`, when the jobs change).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from dlcp.codecs import lanes as lane_ops
from dlcp.codecs.lanes_native import to_halves
from dlcp.core.engine import Engine, JobSpec, RoundComplete, RoundFailed
from dlcp.core.records import ALLREDUCE
from dlcp.daemon.config import Config
from dlcp.daemon.jobs import HostAddr, JobState, LocalPart, LocalRound, OpKey
from dlcp.daemon.outbox import Outbox
from dlcp.daemon.requests import RequestError, bad_request
from dlcp.daemon.shimservice import Client
from dlcp.daemon.shm import MappedSegment
from dlcp.errors import LocalError
from dlcp.policies import apply_droppable
from dlcp.wire.header import Codec

__all__ = ["RoundLifecycle"]

log = logging.getLogger("dlcpd")


class RoundLifecycle:
    """Starting, completing and failing rounds; making and leaving jobs."""

    def __init__(
        self,
        *,
        config: Config,
        engine: Engine,
        outbox: Outbox,
        priority: Any,
        drop: Any,
        counters: Counter[str],
        requests: Counter[tuple[str, str]],
        clock: Callable[[], float],
        pump: Callable[[], None],
        call_later: Callable[..., Any],
        windows_changed: Callable[[], None],
    ) -> None:
        self.config = config
        self.engine = engine
        self.outbox = outbox
        self.priority = priority  # the policies (`set_policies` on a reload)
        self.drop = drop
        self.counters = counters
        self.requests = requests
        self._clock = clock
        self._pump = pump
        self._call_later = call_later
        self._windows_changed = windows_changed
        self.jobs: dict[int, JobState] = {}
        self.rounds: dict[OpKey, LocalRound] = {}
        self.round_hist: Any = None  # /metrics' round duration histogram, once serving

    @property
    def now(self) -> float:
        return self._clock()

    def set_policies(self, priority: Any, drop: Any) -> None:
        self.priority, self.drop = priority, drop

    def complete(self, ev: RoundComplete) -> None:
        op = (ev.job, ev.round, ev.bucket)
        job = self.jobs.get(ev.job)
        if job is not None:
            job.rounds_completed += 1
        self.counters["rounds_completed"] += 1
        if ev.lost_lanes:
            self.counters["rounds_lossy"] += 1
        lr = self.rounds.pop(op, None)
        if lr is None:
            return
        elapsed = self.now - lr.started
        if self.round_hist is not None:
            self.round_hist.observe(elapsed)
        lay = ev.layout
        contrib = np.ascontiguousarray(ev.contributors, dtype="<u2")
        bmax = np.ascontiguousarray(ev.block_max, dtype="<f4")
        counts = lay.packet_counts()
        expected = len(job.spec.contributors) * job.local_ranks if job else 0
        self.counters["result_lanes"] += lay.total * len(lr.parts)
        if lr.kind == ALLREDUCE:  # a one-leg round's counts are its shards' (one sender's)
            lost = int(counts[contrib < expected].sum())
            self.counters["result_lanes_lost"] += lost * len(lr.parts)
        sums: np.ndarray | None = None  # the wire's summed lanes, made once
        for part in lr.parts:
            c = part.client
            if c.closed or c.segment is None:
                continue
            c.pending -= 1
            try:  # pwritev to a named segment, a copy into a mapped one
                if sums is None:
                    sums = self._wire_sums(ev, part)
                if c.segment.holds(part.out[0], sums):  # the engine stored them there
                    c.segment.write(part.out[0] + sums.nbytes, (contrib, bmax))
                    self.counters["results_in_place"] += 1
                else:
                    c.segment.write(part.out[0], (sums, contrib, bmax))
            except LocalError as exc:
                self.requests[("submit", "bad_request")] += 1
                c.error(part.rid, "bad_request", f"round completed, but {exc}")
                continue
            self.requests[("submit", "ok")] += 1
            c.reply(
                part.rid,
                lost_lanes=int(ev.lost_lanes),
                total_lanes=int(ev.total_lanes),
                packets=lay.packets,
                contributors_min=int(contrib.min()) if contrib.size else 0,
                elapsed_s=round(elapsed, 6),
            )

    def failed(self, ev: RoundFailed) -> None:
        op = (ev.job, ev.round, ev.bucket)
        job = self.jobs.get(ev.job)
        if job is not None:
            job.rounds_failed += 1
        self.counters["rounds_failed"] += 1
        log.warning("job %d round %d bucket %d failed: %s", *op, ev.reason)
        lr = self.rounds.pop(op, None)
        if lr is None:
            return
        for part in lr.parts:
            part.client.pending -= 1
            self.requests[("submit", "round_failed")] += 1
            part.client.error(part.rid, "round_failed", ev.reason)

    def _start_round(self, lr: LocalRound, job: JobState) -> None:
        """All local ranks are in: sum them and hand the contribution to the engine."""
        codec = Codec(lr.codec)
        spec = job.spec
        layout = spec.layout(lr.total, codec)
        parts = lr.parts
        out = None
        if len(parts) == 1:
            lanes: Any = parts[0].data
            summed = False
            out = self._mapped_out(parts[0], codec, lr.total)
        else:
            acc = None
            for p in parts:
                v = lane_ops.unpack(codec, p.data.tobytes(), lr.total, False).astype(
                    lane_ops.sum_dtype(codec)
                )
                acc = v if acc is None else acc + v
            lanes = lane_ops.pack(codec, acc, True)  # type: ignore[arg-type]
            summed = True
        n = layout.packets
        counts = layout.packet_counts()
        layers = next((p.layers for p in parts if p.layers is not None), None)
        norms_list = [p.norms for p in parts if p.norms is not None]
        if layers is None:
            layers = np.zeros(n, dtype=np.int64)
        norms = np.sum(norms_list, axis=0) if norms_list else np.zeros(n)
        bmaxes = [p.block_max for p in parts if p.block_max is not None]
        block_max = np.max(bmaxes, axis=0) if bmaxes else None
        n_layers = self._model_layers(parts, layers)
        classes = self.priority.classify(
            layers=layers.astype(np.int64), n_layers=n_layers, norms=norms, counts=counts
        )
        class_bounds = self.priority.lowest(layers=layers.astype(np.int64), n_layers=n_layers)
        droppable = np.zeros(n, dtype=bool)
        if lr.bound > 0:
            for s in range(layout.shards):
                r = layout.shard_packets(s)
                if len(r):
                    droppable[r.start : r.stop] = self.drop.droppable(
                        norms=norms[r.start : r.stop],
                        counts=counts[r.start : r.stop],
                        bound=lr.bound,
                    )
        classes = apply_droppable(classes, droppable)
        self.engine.submit(
            job=lr.job,
            round=lr.round,
            bucket=lr.bucket,
            codec=codec,
            total=lr.total,
            lanes=lanes,
            now=self.now,
            summed=summed,
            weight=len(parts),
            classes=classes,
            droppable=droppable,
            layers=layers,
            bound=lr.bound,
            scale=lr.scale,
            block_max=block_max,
            out=out,
            kind=lr.kind,
            class_bounds=class_bounds,
        )
        lr.submitted = True
        self._pump()

    @staticmethod
    def _model_layers(parts: list[LocalPart], layers: np.ndarray) -> int:
        """The layer count packets rank against: the model's, as the ranks sent it
        (so a front bucket's packets rank as front layers of the whole model), or,
        from a rank that did not send it, the bucket's own highest layer + 1."""
        own = int(layers.max()) + 1 if layers.size else 1
        sent = [p.n_layers for p in parts if p.n_layers is not None]
        return max(own, *sent) if sent else own

    @staticmethod
    def _wire_sums(ev: RoundComplete, part: LocalPart) -> np.ndarray:
        """`ev`'s sums as the wire and the ranks' out regions hold them; fp16's
        cast from the engine's fp32 sums straight into `part`'s out region where
        its segment is mapped (then `holds` them: no copy of the 5 MB of a
        10 MB bucket after the cast, on the way from the round's last packet
        to the ranks' replies)."""
        lay, seg = ev.layout, part.client.segment
        if lay.codec == Codec.FP16 and isinstance(seg, MappedSegment):
            out = seg.lanes(part.out[0], np.dtype("<f2"), lay.total)
            return to_halves(ev.sums, out=out)
        return lane_ops.summed_wire(lay.codec, ev.sums)

    @staticmethod
    def _mapped_out(part: LocalPart, codec: Codec, total: int) -> np.ndarray | None:
        """The rank's result lanes in its mapped segment, where the engine may
        store results as they arrive (no copy at the end), if the segment is
        mapped and the codec sums in the wire's dtype (not fp16's fp32 sums)."""
        seg = part.client.segment
        dtype = lane_ops.sum_dtype(codec)
        if not isinstance(seg, MappedSegment) or dtype != lane_ops.wire_summed_dtype(codec):
            return None
        return seg.lanes(part.out[0], dtype, total)

    def make_job(
        self,
        *,
        job: int,
        key: bytes,
        hosts: tuple[HostAddr, ...],
        me: int,
        local_ranks: int,
        mode: str,
        payload: int,
        ranks: int = 0,
        aggregators: tuple[int, ...] = (),
        contributors: tuple[int, ...] = (),
        shards: int | None = None,
        static: bool = False,
    ) -> JobState:
        H = len(hosts)
        if not 0 <= me < H:
            raise bad_request(f"me={me} is not an index of hosts")
        mine = hosts[me]
        if mine.udp_port != self.config.udp_port or not set(mine.addresses) & set(
            self.config.addresses
        ):
            raise RequestError(
                "conflict",
                f"hosts[{me}] {list(mine.addresses)}:{mine.udp_port} is not this daemon "
                f"({list(self.config.addresses)}:{self.config.udp_port})",
            )
        kw: dict[str, Any] = {"payload": payload, "mac": self.config.mac, "ranks": ranks}
        if mode == "transpose":
            spec = JobSpec.transpose(job, key, me, H, **kw)
        elif mode == "switch" and not aggregators and not contributors:
            # the last host is an aggregator in the switch (e.g. the testbed's
            # --switch-aggregator), not a host with a port of its own
            if H < 2:
                raise bad_request("a switch job needs hosts and the switch's aggregator last")
            spec = JobSpec.switch(job, key, me, H, **kw)
        elif mode in ("ps", "switch"):
            # the hosts that do not aggregate contribute, unless named
            contr = contributors or tuple(i for i in range(H) if i not in aggregators)
            try:
                spec = JobSpec.ps(job, key, me, H, aggregators, contr, shards, **kw)
            except LocalError as exc:
                raise bad_request(str(exc)) from None
        else:
            raise bad_request(f"mode must be transpose, ps or switch, not {mode!r}")
        state = JobState(spec=spec, hosts=hosts, local_ranks=local_ranks, mode=mode, static=static)
        now = self.now
        for node, h in enumerate(hosts):
            if node == me:
                continue
            state.peers[node] = self.outbox.peer(h.addresses, h.udp_port, now)
            for a in h.addresses:
                state.node_of[a] = node
        return state

    def add_static_job(self, jc: Any) -> None:
        hosts = tuple(HostAddr(h.addresses, h.udp_port) for h in jc.hosts)
        state = self.make_job(
            job=jc.job,
            key=jc.key,
            hosts=hosts,
            me=jc.me,
            local_ranks=1,
            mode=jc.mode,
            payload=self.config.payload,
            aggregators=jc.aggregators,
            contributors=jc.contributors,
            shards=jc.shards,
            static=True,
        )
        self.add_job(state)

    def add_job(self, state: JobState) -> None:
        """A job made by `make_job` joins: the engine's, and the windows resized."""
        self.jobs[state.spec.job] = state
        self.engine.add_job(state.spec)
        self._windows_changed()

    def leave(self, client: Client, job_id: int) -> None:
        client.jobs.discard(job_id)
        job = self.jobs.get(job_id)
        if job is None:
            return
        job.clients.discard(client)
        if not job.clients and not job.static:
            del self.jobs[job_id]
            self.engine.remove_job(job_id, self.now)
            self._windows_changed()
            for op in [op for op in self.rounds if op[0] == job_id]:
                del self.rounds[op]
            log.info("job %d left", job_id)
            self._pump()

    def drop_client(self, client: Client) -> None:
        """`client`'s connection closed: its parts of the rounds that wait for
        local ranks go, and it leaves its jobs."""
        for lr in self.rounds.values():
            lr.parts = [p for p in lr.parts if p.client is not client]
        for job_id in list(client.jobs):
            self.leave(client, job_id)

    def check_submit(
        self,
        op: OpKey,
        client: Client,
        codec: int,
        total: int,
        bound: float,
        scale: float,
        kind: str = ALLREDUCE,
    ) -> None:
        """Refuse (RequestError "conflict") a submit of `op` by `client` that
        cannot join its round: run already, started, of another shape, or a
        second from the same client."""
        lr = self.rounds.get(op)
        _, rnd, bucket = op
        if lr is None:
            if self.engine.has_round(*op):
                raise RequestError("conflict", f"round {rnd} bucket {bucket} was already run")
        elif lr.submitted:
            raise RequestError("conflict", f"round {rnd} bucket {bucket} already started")
        elif not lr.same(codec, total, bound, scale, kind):
            raise RequestError(
                "conflict", "local ranks disagree on codec, size, bound, scale or kind"
            )
        elif any(p.client is client for p in lr.parts):
            raise RequestError("conflict", "this client already submitted the bucket")

    def add_part(
        self,
        op: OpKey,
        job: JobState,
        part: LocalPart,
        codec: int,
        total: int,
        bound: float,
        scale: float,
        kind: str = ALLREDUCE,
    ) -> None:
        """A local rank's part of round `op` (checked by `check_submit`): the
        round starts when all local ranks are in, else the others have until
        the timeout."""
        client = part.client
        lr = self.rounds.get(op)
        if lr is None:
            job_id, rnd, bucket = op
            lr = LocalRound(
                job_id,
                rnd,
                bucket,
                codec,
                total,
                bound,
                scale,
                expected=job.local_ranks,
                started=self.now,
                kind=kind,
            )
            self.rounds[op] = lr
        lr.parts.append(part)
        client.pending += 1
        if len(lr.parts) >= lr.expected:
            try:
                self._start_round(lr, job)
            except LocalError as exc:
                self.rounds.pop(op, None)
                for p in lr.parts:
                    p.client.pending -= 1
                    if p.client is not client:
                        p.client.error(p.rid, "bad_request", str(exc))
                raise
        elif len(lr.parts) == 1:  # the other local ranks have until the timeout
            self._call_later(self.engine.timing.timeout, self._local_timeout, op, lr)

    def _local_timeout(self, op: OpKey, lr: LocalRound) -> None:
        """Not every local rank submitted (one died or hangs): fail the waiting ones."""
        if self.rounds.get(op) is not lr or lr.submitted:
            return
        del self.rounds[op]
        self.counters["rounds_failed"] += 1
        why = (
            f"only {len(lr.parts)} of {lr.expected} local ranks submitted round {op[1]} "
            f"bucket {op[2]} within {self.engine.timing.timeout:g}s"
        )
        log.warning("job %d: %s", op[0], why)
        for part in lr.parts:
            part.client.pending -= 1
            self.requests[("submit", "round_failed")] += 1
            part.client.error(part.rid, "round_failed", why)
