"""The ranks' agreement all-reduce, hedged over several Gloo groups.

After every collective the shim runs one tiny all-reduce (MAX) of [failed,
*maxima] (`dlcp.shim.pg.agree`) so that every rank takes the same path.
Over TCP a lost single-segment message waits for a retransmission timeout
(Linux's minimum is 200 ms): under 5 % loss on every port about one
agreement in five stalled for ~0.2 s, a second of a 2.7 s FSDP step.

`Hedge` issues the same all-reduce, asynchronously, on `ways` Gloo groups of
the same ranks (made from the store when the shim first attaches: their own
TCP connections) and takes whichever completes first, as "The Tail at Scale"
hedges requests: the chance that an agreement stalls goes from p to about
p^ways. Why this keeps the guarantee:

- The answer is the same whichever group wins: every group reduces the same
  inputs with the same algorithm over the same ranks, and MAX is exact.
- No deadlock: every rank issues every agreement on every group in the same
  order, so a slower op completes in the background and the next agreement
  on that group queues behind it as any Gloo op does; none waits for a rank
  that will not issue its part. The slower ops' tensors are kept until they
  complete.
- Failures: an op that fails is passed over for the next to complete; the
  agreement raises only when every group's op failed (the first error), as
  the single all-reduce raised when it failed.

The alternative, the agreement carried by the daemons' UDP rounds with
their fast NACK recovery, needs a second agreement on whether that round
reached every rank (a rank whose round failed cannot tell the others); the
hedge needs none. `ways` comes from DLCP_AGREE_HEDGE (default 3; 1 turns it
off: the process group alone, as before). Measured (FSDP gpt, 3 hosts,
200 Mbit/s, 5 % loss, 20 steps, 315 agreements a rank, a loaded machine):
agreements over 0.1 s a rank and their total seconds were 68-102 and
21-31 s with one group, 11-19 and 5.4-7.6 s with two, 4-6 and 3.5-4.7 s
with three, 2-7 and 3.5-4.5 s with four: three is where it stops paying.
A group whose tensors live on CUDA (NCCL) is not hedged. The hedge's own
groups' TCP connections are marked into the control class (CS6,
`dlcp.shim.sockmark`): unmarked, a congested port's best-effort queue held
them as long as any lost segment's timeout. `describe` counts the
agreements and their time, and the connections marked.
"""

from __future__ import annotations

import os
import queue
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dlcp.shim import pg, sockmark
from dlcp.shim.rendezvous import Store

__all__ = ["DEFAULT_WAYS", "HEDGE_ENV", "SLOW_S", "Hedge"]

HEDGE_ENV = "DLCP_AGREE_HEDGE"
DEFAULT_WAYS = 3
SLOW_S = 0.1  # an agreement slower than this counts as stalled (`describe`)


def ways_from_env() -> int:
    """DLCP_AGREE_HEDGE's number of groups (at least 1), else `DEFAULT_WAYS`."""
    raw = os.environ.get(HEDGE_ENV, "")
    return max(1, int(raw)) if raw.strip() else DEFAULT_WAYS


class Hedge:
    """The agreement's MAX over `groups` (one: that group alone, synchronously;
    several: each the same ranks, the first to complete taken)."""

    def __init__(self, groups: list[pg.Group]) -> None:
        if not groups:
            raise ValueError("a hedge needs at least one group")
        self._groups = groups
        self._inflight: list[tuple[Any, torch.Tensor]] = []  # losers still running
        self.count = 0
        self.seconds = 0.0
        self.slow = 0
        self.max_s = 0.0
        self.wins = [0] * len(groups)
        self.recent: deque[float] = deque(maxlen=512)
        self.marked = 0  # TCP connections of the groups marked (`make`)
        self.dscp = 0  # their DSCP

    @classmethod
    def make(
        cls,
        group: pg.Group,
        store: Store,
        prefix: str,
        *,
        ways: int | None = None,
        timeout: timedelta | None = None,
        dscp: int | None = None,
    ) -> Hedge:
        """Collective over `group`'s ranks (through `store`, keys under
        `prefix`): `ways` new Gloo groups of those ranks, or `group` alone when
        `ways` is 1, the group has one rank or its tensors live on CUDA. The
        new groups' TCP connections are marked `dscp` (default: the control
        class's, or DLCP_AGREE_DSCP: `dlcp.shim.sockmark`)."""
        n = ways_from_env() if ways is None else max(1, ways)
        dscp = sockmark.dscp_from_env() if dscp is None else dscp
        size = pg.group_size(group)
        if n < 2 or size < 2 or not pg.on_cpu(group):
            return cls([group])
        rank = pg.group_rank(group)
        wait = dist.default_pg_timeout if timeout is None else timeout

        def groups() -> list[pg.Group]:
            made: list[pg.Group] = []
            for i in range(n):
                sub = dist.PrefixStore(f"{prefix}/{i}", store)  # type: ignore[arg-type]
                gloo = dist.ProcessGroupGloo(sub, rank, size, wait)
                made.append(pg.DirectGroup(gloo, rank, size))
            return made

        made, marked = sockmark.mark_new(groups, dscp)
        hedge = cls(made)
        hedge.marked, hedge.dscp = marked, dscp
        return hedge

    @property
    def ways(self) -> int:
        return len(self._groups)

    @property
    def in_flight(self) -> int:
        """Slower ops of earlier agreements not yet completed."""
        self._prune()
        return len(self._inflight)

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        """The element-wise max of CPU float32 `t` over all ranks; the same
        bytes on every rank (see the module's docstring)."""
        return self.start(t)()

    def start(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """`max_` begun: every group's op issued now; the function returned
        waits for the first to complete and gives its maxima. Call it once,
        before the next agreement starts."""
        began = time.perf_counter()
        if len(self._groups) == 1:
            result = pg.global_max_start(t, self._groups[0])

            def one() -> torch.Tensor:
                out = result()
                self._record(0, time.perf_counter() - began)
                return out

            return one
        self._prune()
        done: queue.SimpleQueue[int] = queue.SimpleQueue()
        issued: list[tuple[Any, torch.Tensor]] = []
        for i, group in enumerate(self._groups):
            mine = t.reshape(-1).to(torch.float32, copy=True)  # each op its own buffer
            work = pg.all_reduce_async(mine, group, dist.ReduceOp.MAX)
            issued.append((work, mine))
            work.get_future().add_done_callback(lambda _f, i=i: done.put(i))

        def first() -> torch.Tensor:
            winner, first_error = -1, None
            for _ in issued:
                i = done.get()
                try:
                    issued[i][0].wait()
                except Exception as exc:  # passed over: another group may still answer
                    first_error = first_error or exc
                    continue
                winner = i
                break
            # the others keep their buffers until they complete (Gloo writes into them)
            self._inflight += [w for j, w in enumerate(issued) if j != winner]
            if winner < 0:
                assert first_error is not None
                raise first_error
            self._record(winner, time.perf_counter() - began)
            return issued[winner][1]

        return first

    def _prune(self) -> None:
        self._inflight = [w for w in self._inflight if not w[0].is_completed()]

    def _record(self, winner: int, seconds: float) -> None:
        self.count += 1
        self.seconds += seconds
        self.max_s = max(self.max_s, seconds)
        self.slow += seconds > SLOW_S
        self.wins[winner] += 1
        self.recent.append(seconds)

    def describe(self) -> dict[str, Any]:
        """The agreements so far: how many, their seconds (total, median of the
        last ones, max), how many took over `SLOW_S`, which group won each."""
        recent = sorted(self.recent)
        return {
            "ways": self.ways,
            "count": self.count,
            "seconds": self.seconds,
            "p50_s": recent[len(recent) // 2] if recent else None,
            "max_s": self.max_s,
            "slow": self.slow,
            "slow_s": SLOW_S,
            "wins": list(self.wins),
            "marked": self.marked,
            "dscp": self.dscp,
        }
