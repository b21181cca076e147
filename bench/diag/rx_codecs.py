"""The receive path's CPU a datagram, codec by codec, without sockets.

    python bench/diag/rx_codecs.py [--hosts 2] [--size 20MB] [--rounds 3] [--payload 1408]
                                   [--codecs fp32,fp16,thc8,thc4,fft8,union] [--profile]

`--hosts` `Engine`s in one process run transpose all-reduce rounds of each
codec; every engine's datagrams reach the others as dlcpd's drains hand
them on: each sender's GRO-sized runs (44 datagrams) made into one
`_bulk.Datagrams` apiece (as `_udp.recv_runs` makes them), the runs of
every sender to one receiver interleaved into one `receive_many` call (a
drain from several peers at once), up to 448 datagrams a call. Only the
`receive_many` calls are timed, in CPU seconds of this thread
(`time.thread_time`), and counted: datagrams, and with `--profile` the
Python function calls they made (cProfile's count, which does not depend on
the machine's load). Prints per codec: us of CPU a datagram received and
Python calls a datagram. Compare runs with DLCP_NATIVE_BULK=0 and without.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.diag.veth_busbw import parse_size  # noqa: E402
from dlcp.core.engine import Engine, JobSpec, RoundComplete  # noqa: E402
from dlcp.daemon.memory import tune_process  # noqa: E402
from dlcp.wire import Codec  # noqa: E402
from dlcp.wire.batch import _bulk  # noqa: E402
from dlcp.wire.header import lane_bytes  # noqa: E402

try:
    from dlcp.daemon import _udp  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    _udp = None

GRO = 44  # datagrams of a GRO buffer at MTU 1500
RX_BATCH = 448
CODECS = {
    "fp32": Codec.FP32,
    "fp16": Codec.FP16,
    "thc8": Codec.THC8,
    "thc4": Codec.THC4,
    "fft8": Codec.FFT8,
    "union": Codec.UNION,
    "sketch": Codec.SKETCH,
}


def _lanes(codec: Codec, total: int, rng: np.random.Generator) -> np.ndarray:
    """A contribution of `total` lanes of `codec` as wire bytes."""
    if codec in (Codec.FP32, Codec.SKETCH):
        return rng.standard_normal(total).astype("<f4").view(np.uint8)
    if codec == Codec.FP16:
        return rng.standard_normal(total).astype("<f2").view(np.uint8)
    n = lane_bytes(codec, total, False)
    if codec == Codec.THC8:
        return rng.integers(0, 80, n, dtype=np.uint8)  # 3 hosts' sums fit 10 bits
    return rng.integers(0, 256, n, dtype=np.uint8)


def _as_drain(dgs: list) -> list:
    """A sender's datagrams as runs of at most GRO of one size, each a Datagrams
    (the daemon's form) where the C split is built, else lists of bytes."""
    out: list = []
    i = 0
    while i < len(dgs):
        size = len(dgs[i])
        j = i
        while j < len(dgs) and j - i < GRO and len(dgs[j]) == size:
            j += 1
        raw = [bytes(d) for d in dgs[i:j]]
        if _udp is not None and _bulk is not None:
            out.append(_udp.split_gro(b"".join(raw), size)[0])
        else:
            out.append(raw)
        i = j
    return out


class Meter:
    """CPU seconds and datagrams of the timed `receive_many` calls."""

    def __init__(self, prof: cProfile.Profile | None) -> None:
        self.cpu = 0.0
        self.datagrams = 0
        self.prof = prof

    def receive(self, e: Engine, dgs: object, now: float, srcs: np.ndarray) -> None:
        if self.prof is not None:
            self.prof.enable()
        t = time.thread_time()
        e.receive_many(dgs, now, srcs)  # type: ignore[arg-type]
        self.cpu += time.thread_time() - t
        if self.prof is not None:
            self.prof.disable()
        self.datagrams += len(srcs)


def one_round(
    engines: list[Engine], codec: Codec, lanes: np.ndarray, total: int, rnd: int, meter: Meter
) -> None:
    now = 0.0
    scale = 1.0 if codec in (Codec.THC8, Codec.THC4, Codec.FFT8) else 0.0
    for e in engines:
        e.submit(
            job=1, round=rnd, bucket=0, codec=codec, total=total, lanes=lanes, now=now, scale=scale
        )
    done = 0
    while done < len(engines):
        moved = False
        inbox: dict[int, list[tuple[int, list]]] = {}
        for src, e in enumerate(engines):
            for b in e.send_batches():
                inbox.setdefault(b.node, []).append((src, _as_drain(list(b.datagrams))))
        for node, parts in inbox.items():
            # the senders' runs interleaved, as one drain of several peers
            queue = [(src, list(runs)) for src, runs in parts]
            pending: list = []
            srcs: list[int] = []
            while any(runs for _, runs in queue):
                for src, runs in queue:
                    if runs:
                        run = runs.pop(0)
                        pending.append(run)
                        srcs += [src] * len(run)
                if len(srcs) >= RX_BATCH or not any(runs for _, runs in queue):
                    dgs = (
                        _bulk.join(pending)
                        if _bulk is not None and _udp is not None
                        else [d for r in pending for d in r]
                    )
                    meter.receive(engines[node], dgs, now, np.array(srcs, np.int64))
                    moved = True
                    pending, srcs = [], []
        for e in engines:
            while (ev := e.next_event()) is not None:
                if not isinstance(ev, RoundComplete):
                    raise RuntimeError(f"round {rnd} failed: {ev}")
                done += 1
        if not moved:
            now += 0.01
            for e in engines:
                e.handle_timer(now)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--size", default="20MB", help="bucket bytes as fp32 (lanes = size / 4)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--payload", type=int, default=1408, help="dlcp payload (MTU 1500 - 92)")
    p.add_argument("--codecs", default="fp32,fp16,thc8,thc4,fft8,union")
    p.add_argument("--profile", action="store_true", help="count Python calls (cProfile)")
    p.add_argument(
        "--top", type=int, default=0, help="with --profile: the N functions of most time"
    )
    a = p.parse_args()
    tune_process()
    total = parse_size(a.size) // 4 // 4096 * 4096  # whole blocks of every codec
    rng = np.random.default_rng(0)
    print(f"hosts {a.hosts}, {total} lanes, payload {a.payload}, native bulk: {_bulk is not None}")
    for name in a.codecs.split(","):
        codec = CODECS[name]
        engines = []
        for me in range(a.hosts):
            e = Engine()
            e.add_job(
                JobSpec.transpose(1, b"k" * 32, me, a.hosts, payload=a.payload, mac="ghash-aes")
            )
            engines.append(e)
        lanes = _lanes(codec, total, rng)
        one_round(engines, codec, lanes, total, 0, Meter(None))  # warm-up
        prof = cProfile.Profile() if a.profile else None
        meter = Meter(prof)
        for rnd in range(1, a.rounds + 1):
            one_round(engines, codec, lanes, total, rnd, meter)
        line = (
            f"{name:7s} {meter.datagrams:7d} datagrams  "
            f"{meter.cpu / meter.datagrams * 1e6:6.2f} us CPU each"
        )
        if prof is not None:
            st = pstats.Stats(prof)
            calls = sum(v[1] for v in st.stats.values())  # type: ignore[attr-defined]
            line += f"  {calls / meter.datagrams:6.2f} Python calls each"
            if a.top:
                st.sort_stats("tottime").print_stats(a.top)
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
