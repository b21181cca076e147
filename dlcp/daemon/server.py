"""dlcpd: moves bytes between the shim, the protocol engine and the network.

Everything that decides (what to send, when a round is complete, which class
and path a packet takes) lives in the sans-IO core and the policies; the
daemon owns the sockets, the timers and the shared memory. `Daemon` is a
facade over objects that each own what they change, their collaborators
passed to their constructors:

* this module: start, drain and stop, SIGHUP reloads, the event loop's
  readers, writers and timer, and the way out (the engine's batches to the
  outbox, pacing);
* `NetworkIn` (`dlcp.daemon.netin`): the way in (socket drains to the
  engine, control packets, receive moderation);
* `Credits` (`dlcp.daemon.credits`): the window granted, the credits sent;
* `RoundLifecycle` (`dlcp.daemon.rounds`): the jobs and the local rounds, a
  round's start, completion and failure;
* `ShimService` (`dlcp.daemon.shimservice`): the ranks' connections and
  their requests;
* `dlcp.daemon.status` and `dlcp.daemon.metrics`: what `dlcp status` and
  /metrics show (through `status.DaemonView`, which `Daemon` is).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import struct
from collections import Counter
from collections.abc import Callable
from typing import Any

from dlcp import ipc
from dlcp.core.engine import Engine, RoundComplete
from dlcp.core.pathhealth import health_config
from dlcp.daemon import notify, status
from dlcp.daemon.config import Config
from dlcp.daemon.credits import Credits
from dlcp.daemon.jobs import JobState, LocalRound, OpKey
from dlcp.daemon.netin import (
    _RX_BUDGET,
    _RX_SENDING,
    _RX_SENDING_BYTES,
    MODERATION_BYTES,
    NetworkIn,
)
from dlcp.daemon.netout import NetworkOut
from dlcp.daemon.outbox import Outbox
from dlcp.daemon.probing import Prober
from dlcp.daemon.requests import RequestError
from dlcp.daemon.rounds import RoundLifecycle
from dlcp.daemon.shimservice import INPUT_BUFFERS, Client, ShimService
from dlcp.daemon.transport import NATIVE_SEND, UdpPath
from dlcp.errors import DlcpError
from dlcp.policies import from_config

# INPUT_BUFFERS, Client, MODERATION_BYTES and _RX_*: the parts' names, imported from here too
__all__ = [
    "INPUT_BUFFERS",
    "MODERATION_BYTES",
    "_RX_BUDGET",
    "_RX_SENDING",
    "_RX_SENDING_BYTES",
    "Client",
    "Daemon",
    "RequestError",
]

log = logging.getLogger("dlcpd")

_JOB = struct.Struct("!I")


class Daemon:
    """One host's daemon: its sockets, jobs, rounds and ranks (see the module docstring)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.id = f"{os.uname().nodename}-{os.getpid()}-{secrets.token_hex(4)}"
        # early results fill a paced link's idle time (dlcp.core.early); on a
        # link of unknown rate nothing is paced and the CPU is what is short
        early = config.early_results if config.rate.link_rate_bps is not None else 0
        self.engine = engine = Engine(timing=config.timing, gather=NATIVE_SEND, early_results=early)
        self.paths: list[UdpPath] = []
        self.counters: Counter[str] = Counter()
        self.requests: Counter[tuple[str, str]] = Counter()
        self.daemon_rejects: Counter[str] = Counter()
        self._load_policies()
        self.outbox = outbox = Outbox(
            self.paths,
            dscp=config.dscp,
            rate=config.rate,
            pacing=config.pacing,
            balancer_factory=self._balancer_factory,
            window_bytes=config.window_bytes,
            health=health_config(config.probe_interval_s),
        )
        self.prober = Prober(
            lambda: outbox.multipath,
            engine,
            lambda: outbox.tos[0],
            self._count,
            budget=config.probe_budget,
        )
        self.lifecycle = RoundLifecycle(
            config=config,
            engine=engine,
            outbox=outbox,
            priority=self.priority,
            drop=self.drop,
            counters=self.counters,
            requests=self.requests,
            clock=self._clock,
            pump=self._pump,
            call_later=self._call_later,
            windows_changed=self._size_windows,
        )
        self.credits = Credits(
            engine=engine,
            paths=self.paths,
            outbox=outbox,
            jobs=self.lifecycle.jobs,
            window_bytes=config.window_bytes,
            rate=config.rate,
            counters=self.counters,
        )
        self.netin = NetworkIn(
            engine=engine,
            paths=self.paths,
            jobs=self.lifecycle.jobs,
            outbox=outbox,
            prober=self.prober,
            counters=self.counters,
            daemon_rejects=self.daemon_rejects,
            moderation_s=config.moderation_s,
            clock=self._clock,
            pump=self._pump,
            credit=self.credits.send,
            watch=self._watch,
        )
        self.netout = NetworkOut(
            jobs=self.lifecycle.jobs, outbox=outbox, credits=self.credits, counters=self.counters
        )
        self.shim = ShimService(
            config=config,
            engine=engine,
            lifecycle=self.lifecycle,
            counters=self.counters,
            requests=self.requests,
            daemon_id=self.id,
            status=lambda: status.snapshot(self),
        )
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._writers: set[int] = set()
        self._server: asyncio.AbstractServer | None = None
        self._metrics_server: Any = None
        self.tc = status.TcStats(config.tc_devices)  # tc class stats for /metrics
        self._tc_task: asyncio.Task[None] | None = None
        self.stopped = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- the parts' state, by the names status, metrics and tests read --------
    @property
    def jobs(self) -> dict[int, JobState]:
        return self.lifecycle.jobs

    @property
    def rounds(self) -> dict[OpKey, LocalRound]:
        return self.lifecycle.rounds

    @property
    def clients(self) -> set[Client]:
        return self.shim.clients

    @property
    def draining(self) -> bool:
        return self.shim.draining

    def describe(self) -> dict[str, Any]:
        return self.shim.describe()

    def _receive(self, path: UdpPath) -> bool:
        return self.netin._receive(path)

    def _on_readable(self, path: UdpPath) -> None:
        self.netin.on_readable(path)

    def _make_job(self, **kw: Any) -> JobState:
        return self.lifecycle.make_job(**kw)

    def _size_windows(self) -> None:  # the lifecycle is made before the credits
        self.credits.size_windows()

    # -- the event loop, for the parts ----------------------------------------
    def _clock(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    def _call_later(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        self._loop.call_later(delay, fn, *args)

    def _watch(self, on: bool) -> None:
        """Watch the sockets for datagrams (`NetworkIn.on_readable`), or stop
        (receive moderation polls them instead)."""
        assert self._loop is not None
        for p in self.paths:
            if on:
                self._loop.add_reader(p.fileno(), self.netin.on_readable, p)
            else:
                self._loop.remove_reader(p.fileno())

    # -- policies -----------------------------------------------------------
    def _count(self, name: str) -> None:
        self.counters[name] += 1

    def _load_policies(self) -> None:
        cfg = self.config
        self.priority = from_config("priority", {**cfg.priority, "dscp": list(cfg.dscp)})
        self.drop = from_config("drop", cfg.drop)
        self._balance_cfg = self._adaptive_tolerance(dict(cfg.balance))
        if hasattr(self, "lifecycle"):  # a reload: the rounds classify by the new ones
            self.lifecycle.set_policies(self.priority, self.drop)

    def _balancer_factory(self) -> Any:
        return from_config("balance", self._balance_cfg)

    def _adaptive_tolerance(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """`adaptive` takes as random the loss the rate control takes as random
        (rate.loss_tolerance), unless its own table says otherwise."""
        keys = {str(k).replace("-", "_") for k in cfg}
        if cfg.get("name") == "adaptive" and "loss_tolerance" not in keys:
            return {**cfg, "loss_tolerance": self.config.rate.loss_tolerance}
        return cfg

    def reload(self, config: Config) -> None:
        """SIGHUP: new policies, DSCP table and timing; sockets and jobs stay."""
        self.config.priority, self.config.drop = config.priority, config.drop
        self.config.balance, self.config.dscp = config.balance, config.dscp
        self._load_policies()
        self.outbox.tos = [int(d) << 2 for d in config.dscp]
        self.outbox.set_balancer_factory(self._balancer_factory)
        self.prober.reset_usable()  # whether degraded paths carry data is the balancer's
        self.engine.timing = config.timing
        log.info("reloaded policies: %s %s %s", config.priority, config.drop, config.balance)

    # -- lifecycle ----------------------------------------------------------
    @property
    def now(self) -> float:
        assert self._loop is not None
        return self._loop.time()

    async def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        cfg = self.config
        for addr in cfg.addresses:
            path = UdpPath(
                addr, cfg.udp_port, gso=cfg.gso, gro=cfg.gro, buffer_bytes=cfg.socket_buffer_bytes
            )
            self.paths.append(path)
            loop.add_reader(path.fileno(), self.netin.on_readable, path)
        for job in cfg.jobs:
            self.lifecycle.add_static_job(job)
        # everything that can fail to bind comes before the control socket: a
        # client that sees the socket finds a daemon that stays up
        if cfg.metrics_port:
            from dlcp.daemon.metrics import make_registry, serve_metrics

            registry, self.lifecycle.round_hist = make_registry(self)
            self._metrics_server = await serve_metrics(
                registry, cfg.metrics_address, cfg.metrics_port
            )
            self._tc_task = loop.create_task(self.tc.refresh(self.stopped))
        sock_dir = os.path.dirname(cfg.socket)
        if sock_dir:
            os.makedirs(sock_dir, exist_ok=True)
        if os.path.exists(cfg.socket):
            os.unlink(cfg.socket)
        self._server = await asyncio.start_unix_server(
            self.shim._serve_client, path=cfg.socket, limit=ipc.MAX_MESSAGE + 4
        )
        os.chmod(cfg.socket, cfg.socket_mode)
        log.info(
            "dlcpd %s serving %s on %s udp/%d, metrics %s, MAC %s",
            self.id,
            cfg.socket,
            ",".join(cfg.addresses),
            cfg.udp_port,
            cfg.metrics_port or "off",
            status.mac_description(self.config.mac),
        )

    async def serve(self) -> None:
        """Run until SIGTERM/SIGINT (drain) ; SIGHUP reloads policies."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        # before the socket exists: whoever sees it may signal us at once
        loop.add_signal_handler(signal.SIGTERM, self.begin_drain)
        loop.add_signal_handler(signal.SIGINT, self.begin_drain)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        await self.start()
        notify.notify("READY=1", f"STATUS=serving {self.config.socket}")
        watchdog = notify.watchdog_interval()
        dog = loop.create_task(self._watchdog(watchdog)) if watchdog else None
        try:
            await self.stopped.wait()
        finally:
            if dog is not None:
                dog.cancel()
            await self.close()

    async def _watchdog(self, interval: float) -> None:
        while True:
            notify.notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    def _on_sighup(self) -> None:
        from dlcp.daemon.config import load

        if self.config.path is None:
            return
        try:
            self.reload(load(self.config.path))
        except DlcpError as exc:
            log.error("reload failed, keeping the old policies: %s", exc)

    def begin_drain(self) -> None:
        if self.draining:
            return
        self.shim.drain()
        notify.notify("STOPPING=1", "STATUS=draining")
        log.info("draining %d rounds in flight", self.engine.pending_rounds())
        assert self._loop is not None
        self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        deadline = self.now + self.config.drain_timeout_s
        while self.now < deadline and (
            self.engine.pending_rounds() or any(r.submitted for r in self.rounds.values())
        ):
            await asyncio.sleep(0.01)
        # let the last results and ACKs leave
        for _ in range(100):
            if not self.outbox.queued():
                break
            await asyncio.sleep(0.01)
        self.stopped.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self.clients):
            c.closed = True
            c.writer.close()
            self.shim._drop_client(c)
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        for p in self.paths:
            loop.remove_reader(p.fileno())
            if p.fileno() in self._writers:
                loop.remove_writer(p.fileno())
            p.close()
        if self._metrics_server is not None:
            self._metrics_server.close()
        with contextlib.suppress(OSError):
            os.unlink(self.config.socket)
        log.info("stopped")

    # -- engine out -----------------------------------------------------------
    def _pump(self) -> None:
        """Move the engine's output to the network and the ranks; re-arm timers."""
        now = self.now
        engine = self.engine
        sends = engine.send_batches()
        if sends:
            self.netout.enqueue(sends, now)
        lifecycle = self.lifecycle
        while (ev := engine.next_event()) is not None:
            if isinstance(ev, RoundComplete):
                lifecycle.complete(ev)
            else:
                lifecycle.failed(ev)
        if self.outbox.multipath:
            for peer, path in self.prober.run(now):
                self.netout.path_down(peer, path, now)
        if self.outbox.backlog and not self.outbox.blocked:
            self.netout.flush(now)
            if self.outbox.blocked:
                self._wait_writable()
        self._arm(now)
        engine.drop_settled()  # the ranks are told and the peers sent to: now free

    def _wait_writable(self) -> None:
        assert self._loop is not None
        for p in self.paths:
            if p.fileno() not in self._writers:
                self._writers.add(p.fileno())
                self._loop.add_writer(p.fileno(), self._on_writable)

    def _on_writable(self) -> None:
        assert self._loop is not None
        for fd in self._writers:
            self._loop.remove_writer(fd)
        self._writers.clear()
        self.outbox.blocked = False
        self._pump()

    def _arm(self, now: float) -> None:
        netin = self.netin
        if netin.polling:  # the poll takes the sockets, the timers and the pacers' due
            t: float | None = netin.poll_at
        else:
            t = self.engine.get_timer()
            wake = self.outbox.next_wake
            if wake is not None and not self.outbox.blocked and (t is None or wake < t):
                t = wake
            if self.outbox.multipath:
                probe = self.prober.next_timer()
                if probe is not None and (t is None or probe < t):
                    t = probe
        if t == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = t
        if t is not None:
            assert self._loop is not None
            self._timer = self._loop.call_at(max(t, now), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        netin = self.netin
        self.counters["wakeups_poll" if netin.polling else "wakeups_timer"] += 1
        # Datagrams may be waiting in the sockets (the loop runs timers before
        # IO callbacks): take them first, or a NACK timer fires for packets
        # that have already arrived.
        try:
            taken, full = netin.take_from(self.paths)
            now = self.now
            t = self.engine.get_timer()
            if t is not None and t <= now:
                self.engine.handle_timer(now)
            if netin.polling:
                netin.moderate(taken > 0 or bool(self.outbox.backlog), full, now)
        finally:
            # whatever went wrong above (it is logged by the loop), the timer
            # is armed again: without it no round would ever time out
            self._pump()
