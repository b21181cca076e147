"""Per-datagram cost of the receive path's Python, without sockets or the MAC.

    python bench/diag/rx_micro.py [--payload 8908] [--calls 2000]

Datagrams of a real 25 MB fp32 round (one engine's data packets) are grouped
as many to a 64 KiB buffer as fit, as GRO would (every other buffer relabelled
as results), and timed through:
- `decode_batch` in batches of 448 with the ghash-aes MAC (in C where
  dlcp.wire._ghash is built, and through the cryptography package), and with
  the verdicts replaced by precomputed ones (the rest of decode_batch alone);
- `NetworkIn._receive` on 64 of those buffers a call (its recvmsg budget) with
  the engine stubbed out (it accepts every datagram): splitting (`_udp`'s C
  split where built), job and node lookup, control packets.
Prints medians (and the fastest call for the daemon) in us per datagram. Run
it under the bench lock, alternated with another checkout, as with any timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if not os.environ.get("PYTHONPATH"):  # else the checkout PYTHONPATH names (to time another one)
    sys.path.insert(0, str(ROOT))

from dlcp.core.engine import Engine, JobSpec  # noqa: E402
from dlcp.daemon.netin import NetworkIn  # noqa: E402
from dlcp.daemon.transport import _udp, split_gro  # noqa: E402
from dlcp.wire import Codec  # noqa: E402
from dlcp.wire.batch import decode_batch  # noqa: E402
from dlcp.wire.mac import GhashAesKey, mac_state  # noqa: E402

BATCH = 448  # datagrams a decode_batch call
GRO_BYTES = 65535  # a GRO buffer holds as many datagrams as fit in this
READS = 64  # buffers a timed NetworkIn._receive call (its recvmsg budget)


class _CachedVerdicts:
    """A MAC key whose verdicts were computed once per batch (no AES-GCM when timed)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.cache: dict[bytes, Any] = {}

    def verify(self, datagrams: Sequence[memoryview]) -> Any:
        k = b"".join([d[:64] for d in datagrams])
        got = self.cache.get(k)
        if got is None:
            got = self.cache[k] = self.real.verify(datagrams)
        return got


class _Rate:
    def on_ack(self, nbytes: int, rtt: float | None, now: float) -> None:
        self.acked = nbytes


class _Peer:
    rate = _Rate()
    health = None
    rx_job = None

    def __init__(self) -> None:
        self.rx_bytes = self.rx_credited = 0  # credits: one each CREDIT_STEP taken


class _Spec:
    job = 1


class _Job:
    node_of = {"10.0.0.1": 0}
    peers = {0: _Peer()}
    spec = _Spec()


class _Engine:
    def receive_many(self, dgs: list[memoryview], now: float, nodes: list[int | None]) -> Any:
        return np.arange(len(dgs))


class _Outbox:
    backlog: set[Any] = set()


class _Loop:
    def time(self) -> float:
        return 0.0


class _Path:
    def __init__(self, buffers: list[tuple[bytes, int, str]]) -> None:
        self.buffers = buffers
        self.recvmsg_calls = 0  # buffers taken, as `UdpPath` counts them

    def receive_buffers(self, budget: int = 64) -> list[tuple[bytes, int, str]]:
        return self.buffers

    def receive_split(self, budget: int = 64) -> list[Any]:
        """What `UdpPath.receive_split` returns for the buffers (split in C
        where `_udp` is built, as the daemon's receive does)."""
        split = _udp.split_gro if _udp is not None else split_gro
        self.recvmsg_calls += len(self.buffers)
        return [(*split(data, seg), src) for data, seg, src in self.buffers]

    def receive(self, budget: int = 64) -> Iterator[tuple[memoryview, str]]:
        """What `UdpPath.receive` yields (the daemon before `receive_buffers`)."""
        for data, seg, src in self.buffers:
            view = memoryview(data)
            for off in range(0, len(data), seg):
                yield view[off : off + seg], src


def _time(f: Callable[[], object], calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        f()
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--payload", type=int, default=8908)
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()
    total = 25_000_000 // 4
    e = Engine()
    e.add_job(JobSpec.transpose(1, b"k" * 32, 0, 2, payload=a.payload, mac="ghash-aes"))
    lanes = np.random.default_rng(0).standard_normal(total).astype("<f4").view(np.uint8)
    e.submit(job=1, round=0, bucket=0, codec=Codec.FP32, total=total, lanes=lanes, now=0.0)
    outs = [s.datagram for s in e.datagrams_to_send()]
    seg = len(outs[0])
    outs = [o for o in outs if len(o) == seg]  # data packets of full size only
    buffers = []
    per_buffer = GRO_BYTES // seg
    for j, i in enumerate(range(0, len(outs) - per_buffer + 1, per_buffer)):
        buf = bytearray(b"".join(outs[i : i + per_buffer]))
        if j % 2:
            for o in range(0, len(buf), seg):
                buf[o + 3] = 2  # RESULT: the daemon acknowledges its bytes
        buffers.append((bytes(buf), seg, "10.0.0.1"))
    views = [memoryview(o) for o in outs]  # as sent: the relabelled ones would fail the MAC
    batches = [views[i : i + BATCH] for i in range(0, len(views) - BATCH + 1, BATCH)]
    n = sum(map(len, batches))
    keys: dict[int, Any] = {1: mac_state(b"k" * 32, "ghash-aes")}
    py_keys: dict[int, Any] = {1: GhashAesKey(b"k" * 32, native=False)}
    cached: dict[int, Any] = {1: _CachedVerdicts(keys[1])}
    for batch in batches:
        assert len(decode_batch(batch, cached)) == len(batch)

    def dec(k: dict[int, Any]) -> Callable[[], None]:
        def run() -> None:
            for batch in batches:
                decode_batch(batch, k)

        return run

    reps = max(3, a.calls // 100)
    t = statistics.median(_time(dec(keys), reps))
    where = "C" if keys[1].native else "Python"
    print(f"decode_batch, ghash-aes ({where}): {t / n * 1e6:.3f} us per datagram ({seg} B)")
    if keys[1].native:
        t = statistics.median(_time(dec(py_keys), reps))
        print(f"decode_batch, ghash-aes (Python): {t / n * 1e6:.3f} us per datagram")
    t = statistics.median(_time(dec(cached), reps))
    print(f"decode_batch, MAC precomputed: {t / n * 1e6:.3f} us per datagram")

    d = NetworkIn(
        engine=_Engine(),  # type: ignore[arg-type]
        paths=[],
        jobs={1: _Job()},  # type: ignore[dict-item]
        outbox=_Outbox(),  # type: ignore[arg-type]
        prober=None,  # type: ignore[arg-type]
        counters=Counter(),
        daemon_rejects=Counter(),
        moderation_s=0.0,
        clock=_Loop().time,
        pump=lambda: None,
        credit=lambda peer, job: None,  # no sockets: the credits a drain sends are not sent
        watch=lambda on: None,
    )
    path = _Path(buffers[:READS])
    m = sum(len(b) // seg for b, _, _ in path.buffers)
    ts = _time(lambda: d._receive(path), a.calls)  # type: ignore[arg-type]
    print(
        f"NetworkIn._receive, engine stubbed: median {statistics.median(ts) / m * 1e6:.3f}, "
        f"fastest {min(ts) / m * 1e6:.3f} us per datagram ({m} a call)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
