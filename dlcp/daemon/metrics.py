"""Prometheus metrics of the daemon (names prefixed dlcp_, counters end in _total).

Counters live in plain Python counters on the hot path and are turned into
metric families only when Prometheus scrapes (a custom collector), so sending
a packet costs no metrics locking. docs/metrics.md lists every name.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dlcp.core.pathhealth import PathStatus
from dlcp.daemon import status
from dlcp.daemon.status import DaemonView

__all__ = ["DaemonCollector", "make_registry", "serve_metrics"]

ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

# engine.stats key -> (metric, help, labels)
_ENGINE: dict[str, tuple[str, str, dict[str, str]]] = {
    "data_packets_sent": ("dlcp_engine_packets_total", "Packets the engine made", {"kind": "data"}),
    "result_packets_sent": ("dlcp_engine_packets_total", "", {"kind": "result"}),
    "early_results": (
        "dlcp_early_results_total",
        "Result packets sent before their shard completed (every copy of their data in)",
        {},
    ),
    "data_retransmits": (
        "dlcp_retransmits_total",
        "Packets sent again after a NACK",
        {"leg": "data"},
    ),
    "result_retransmits": ("dlcp_retransmits_total", "", {"leg": "result"}),
    "data_nacks_sent": ("dlcp_nacks_sent_total", "NACKs sent", {"leg": "data"}),
    "result_nacks_sent": ("dlcp_nacks_sent_total", "", {"leg": "result"}),
    "duplicate_packets": ("dlcp_ignored_packets_total", "Packets ignored", {"why": "duplicate"}),
    "late_packets": ("dlcp_ignored_packets_total", "", {"why": "late"}),
    "shards_aggregated": ("dlcp_shards_aggregated_total", "Shards summed here", {}),
    "lanes_lost": ("dlcp_lanes_lost_total", "Droppable lanes left out of sums here", {}),
    "lanes_expected": ("dlcp_lanes_expected_total", "Lanes the shards summed here expected", {}),
    "completions_held": (
        "dlcp_completions_held_total",
        "Rounds whose completion waited for receivers' ACKs of results sent in place",
        {},
    ),
    "gathered_bytes_copied": (
        "dlcp_gathered_copied_bytes_total",
        "Payload bytes copied out of ranks' memory as rounds ended (still to send or resend)",
        {},
    ),
}


def make_registry(daemon: DaemonView) -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(daemon))
    hist = Histogram(
        "dlcp_round_duration_seconds",
        "Time from the first local submit of a bucket to its result on this host",
        buckets=ROUND_BUCKETS,
        registry=registry,
    )
    return registry, hist


class DaemonCollector(Collector):
    def __init__(self, daemon: DaemonView) -> None:
        self.d = daemon

    def collect(self) -> Iterator[Metric]:
        d = self.d
        fams: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}

        def counter(name: str, doc: str, labels: dict[str, str], value: float) -> None:
            fam = fams.get(name)
            if not isinstance(fam, CounterMetricFamily):
                base = name[: -len("_total")] if name.endswith("_total") else name
                fam = fams[name] = CounterMetricFamily(base, doc or name, labels=list(labels))
            fam.add_metric(list(labels.values()), value)

        def gauge(name: str, doc: str, labels: dict[str, str], value: float) -> None:
            fam = fams.get(name)
            if not isinstance(fam, GaugeMetricFamily):
                fam = fams[name] = GaugeMetricFamily(name, doc or name, labels=list(labels))
            fam.add_metric(list(labels.values()), value)

        gauge("dlcp_up", "1 while the daemon serves", {}, 1.0)
        gauge("dlcp_jobs", "Jobs this daemon takes part in", {}, len(d.jobs))
        gauge("dlcp_clients", "Connected shim clients", {}, len(d.clients))
        gauge(
            "dlcp_rounds_in_flight",
            "Rounds started and not yet ended",
            {},
            d.engine.pending_rounds(),
        )
        gauge(
            "dlcp_send_queue_packets", "Packets waiting in the send queues", {}, d.outbox.queued()
        )
        docs: dict[str, str] = {}
        for key, (name, doc, labels) in _ENGINE.items():
            docs.setdefault(name, doc)
            counter(name, docs[name], labels, d.engine.stats.get(key, 0))
        for reason in status.reject_reasons(d):
            counter(
                "dlcp_rejected_packets_total",
                "Received datagrams rejected, by reason",
                {"reason": reason},
                status.rejected(d, reason),
            )
        for outcome in ("completed", "failed"):
            counter(
                "dlcp_rounds_total",
                "Buckets all-reduced on this host, by outcome",
                {"outcome": outcome},
                d.counters[f"rounds_{outcome}"],
            )
        counter(
            "dlcp_loss_bound_rounds_total",
            "Rounds that completed with droppable data left out (within the bound)",
            {},
            d.counters["rounds_lossy"],
        )
        counter(
            "dlcp_result_lanes_total",
            "Result lanes delivered to ranks",
            {},
            d.counters["result_lanes"],
        )
        counter(
            "dlcp_result_lanes_lost_total",
            "Result lanes missing some contribution",
            {},
            d.counters["result_lanes_lost"],
        )
        for op, n in sorted(d.requests.items()):
            counter(
                "dlcp_shim_requests_total",
                "Shim requests, by op and outcome",
                {"op": op[0], "outcome": op[1]},
                n,
            )
        counter(
            "dlcp_shim_fallbacks_total",
            "Buckets ranks all-reduced over the process group instead (reported by shims)",
            {},
            d.counters["fallbacks"],
        )
        counter(
            "dlcp_received_packets_total",
            "Datagrams received, by path",
            {"path": "all"},
            d.counters["rx_packets"],
        )
        counter(
            "dlcp_received_bytes_total", "Bytes received", {"path": "all"}, d.counters["rx_bytes"]
        )
        for kind in ("readable", "poll", "timer"):
            counter(
                "dlcp_wakeups_total",
                "Times the event loop ran the daemon's network work, by what woke it",
                {"kind": kind},
                d.counters[f"wakeups_{kind}"],
            )
        for i, p in enumerate(d.paths):
            gauge(
                "dlcp_path_info", "Local path addresses", {"path": str(i), "address": p.address}, 1
            )
            gauge(
                "dlcp_path_gso",
                "1 when UDP GSO is used on the path",
                {"path": str(i)},
                float(p.gso),
            )
        # exposed without series too: a peer has one once it answered a NACK
        for name, doc in (
            ("dlcp_nack_answer_seconds", "How soon the peer answers NACKs (smoothed mean)"),
            ("dlcp_nack_repeat_seconds", "Wait before an unanswered NACK to the peer is repeated"),
        ):
            fams[name] = GaugeMetricFamily(name, doc, labels=["job", "peer"])
        for job in d.jobs.values():
            for answer in status.nack_answers(d, job):
                if answer["answer_s"] is None or answer["peer"] is None:
                    continue
                labels = {"job": str(job.spec.job), "peer": answer["peer"]}
                gauge("dlcp_nack_answer_seconds", "", labels, answer["answer_s"])
                gauge("dlcp_nack_repeat_seconds", "", labels, answer["repeat_after_s"])
        for peer in d.outbox.peers.values():
            gauge(
                "dlcp_peer_rate_bps",
                "Pacing rate towards a peer, bit/s",
                {"peer": peer.name},
                peer.rate.rate_bps,
            )
            counter(
                "dlcp_peer_losses_total",
                "Packets a peer reported missing (NACKed)",
                {"peer": peer.name},
                peer.rate.lost_packets,
            )
            gauge(
                "dlcp_peer_queue_packets",
                "Packets queued towards a peer",
                {"peer": peer.name},
                peer.queued,
            )
            gauge(
                "dlcp_peer_in_flight_bytes",
                "Bytes sent to a peer that it has not yet credited (flow control)",
                {"peer": peer.name},
                peer.in_flight,
            )
            gauge(
                "dlcp_peer_window_bytes",
                "Bytes that may be in flight to a peer: this daemon's window for it, "
                "or the peer's grant where smaller (flow control; 0: none)",
                {"peer": peer.name},
                peer.limit,
            )
            counter(
                "dlcp_peer_window_stalls_total",
                "Times sending to a peer stopped at its full flow-control window",
                {"peer": peer.name},
                peer.window_stalls,
            )
            counter(
                "dlcp_peer_window_resets_total",
                "Probes sent after 50 ms at a full flow-control window without a credit",
                {"peer": peer.name},
                peer.window_resets,
            )
            for (cls, path), n in sorted(peer.sent_packets.items()):
                labels = {"class": str(cls), "path": str(path), "peer": peer.name}
                counter(
                    "dlcp_sent_packets_total", "Datagrams sent, by class, path and peer", labels, n
                )
                counter(
                    "dlcp_sent_bytes_total",
                    "Bytes sent, by class, path and peer",
                    labels,
                    peer.sent_bytes[(cls, path)],
                )
            for i, ps in enumerate(peer.paths):
                gauge(
                    "dlcp_path_weight",
                    "Share of a peer's traffic the balancer gives a path",
                    {"path": str(i), "peer": peer.name},
                    ps.weight,
                )
                gauge(
                    "dlcp_path_loss_ratio",
                    "Recent loss rate of a path",
                    {"path": str(i), "peer": peer.name},
                    ps.loss_rate,
                )
                # a peer's one path is not probed: always in use (up), with no
                # transitions and no probe round trip (NaN), but a path all the same
                health = peer.health
                now_state = PathStatus.UP if health is None else health.status(i)
                for st in PathStatus:
                    gauge(
                        "dlcp_path_state",
                        "1 for a path's current state (up, suspect, down, probing, degraded), "
                        "0 for the others; a peer's only path is not probed and always up",
                        {"path": str(i), "peer": peer.name, "state": st.label},
                        1.0 if st == now_state else 0.0,
                    )
                    counter(
                        "dlcp_path_transitions_total",
                        "Times a path entered a state",
                        {"path": str(i), "peer": peer.name, "to": st.label},
                        0 if health is None else health.transitions[(i, st)],
                    )
                rtt = None if health is None else health.rtt(i)
                gauge(
                    "dlcp_path_probe_rtt_seconds",
                    "Smoothed round trip of a path's probes (NaN until one is answered; "
                    "a peer's only path is not probed)",
                    {"path": str(i), "peer": peer.name},
                    math.nan if rtt is None else rtt,
                )
            if peer.health is not None:
                for kind, n in (("sent", peer.health.probes_sent), ("echoed", peer.health.echoes)):
                    counter(
                        "dlcp_path_probes_total",
                        "Path probes sent to a peer, and echoes of them received",
                        {"peer": peer.name, "kind": kind},
                        n,
                    )
        for sample in d.tc.samples:
            name = sample["name"]
            if sample["type"] == "counter":
                counter(name, sample["help"], sample["labels"], sample["value"])
            else:
                gauge(name, sample["help"], sample["labels"], sample["value"])
        yield from fams.values()


async def serve_metrics(registry: CollectorRegistry, address: str, port: int) -> asyncio.Server:
    """A minimal HTTP/1.0 server for GET /metrics, on the daemon's own event loop.

    Scrapes run in the loop thread, so collectors read the daemon's state
    without locks.
    """

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            if (
                len(line) >= 2
                and line[0] in ("GET", "HEAD")
                and line[1].split("?")[0]
                in (
                    "/metrics",
                    "/",
                )
            ):
                body = generate_latest(registry)
                status = "200 OK"
            else:
                body, status = b"not found\n", "404 Not Found"
            writer.write(
                f"HTTP/1.0 {status}\r\nContent-Type: {CONTENT_TYPE_LATEST}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            )
            if line and line[0] != "HEAD":
                writer.write(body)
            await writer.drain()
        except (
            TimeoutError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
            UnicodeDecodeError,
        ):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, address, port, reuse_address=True)
