"""bench/diag/daemon_trace.py: a traced dlcpd's trace read back, split into rounds
and summed up; and the tracing itself on a real Daemon."""

from __future__ import annotations

from io import StringIO

import pytest

from bench.diag.daemon_trace import Event, install, parse, rounds, summary


def _line(
    end: float,
    name: str,
    us: float,
    rx: int = 0,
    data: int = 0,
    result: int = 0,
    sent: int = 0,
    backlog: int = 0,
) -> str:
    return f"{end:.6f} {name} {us:.1f} {rx} {data} {result} {sent} {backlog}"


def _round(t: float, wall_ms: float) -> list[str]:
    """The calls of one round of a 2-host job as dlcpd makes them, from `t` s."""
    ms = 1e-3
    return [
        _line(t + 20 * ms, "_start_round", 20000, sent=34000, backlog=1),
        _line(t + 3 * ms, "submit", 2000),
        _line(t + 20 * ms, "_pump", 16000, sent=34000, backlog=1),
        _line(t + 27 * ms, "_receive", 7000, rx=10000, data=10000),
        _line(t + 28 * ms, "_receive", 500, rx=500, data=500),
        _line(t + 45 * ms, "_pump", 16000, sent=35000),
        _line(t + 52 * ms, "_receive", 6000, rx=10000, result=10000),
        _line(t + wall_ms * ms, "_pump", 100, sent=1),
    ]


def test_parse_reads_each_field_and_names_a_bad_line() -> None:
    (e,) = parse([_line(2.5, "_receive", 1500.0, 10, 7, 2, 3, 1), "  "])
    assert e == Event(2.5, "_receive", 1500.0, 10, 7, 2, 3, 1)
    assert e.start == pytest.approx(2.4985)
    with pytest.raises(ValueError, match="trace line 2"):
        parse([_line(1, "_pump", 1), "1.0 _flush 2 0 0 0 0 0"])
    with pytest.raises(ValueError, match="trace line 1"):
        parse(["1.0 _pump 2 0 0"])


def test_rounds_start_at_each_start_round_by_start_time() -> None:
    lines = ["0.5 _pump 10 0 0 0 0 0", *_round(1.0, 60), *_round(2.0, 60)]
    rs = rounds(parse(lines))
    assert [len(r) for r in rs] == [8, 8]  # the pump before the first round is dropped
    # `_start_round` ends after the calls it makes but starts first: it opens the round
    assert [e.name for e in rs[0][:3]] == ["_start_round", "submit", "_pump"]
    assert rs[1][0].start == pytest.approx(2.0)


def test_summary_skips_the_warm_up_and_reports_per_datagram() -> None:
    lines = [*_round(1.0, 300), *_round(2.0, 60), *_round(3.0, 70), *_round(4.0, 80)]
    text = summary(parse(lines))
    assert text.startswith("3 rounds after the warm-up; per round:")
    assert "_receive          3.0 calls    13.50 ms" in text
    assert "DATA drains >= 1000    3 calls, 30000 datagrams, 21.00 ms, 700 ns a datagram" in text
    assert "DATA drains < 1000     3 calls, 1500 datagrams, 1.50 ms, 1000 ns a datagram" in text
    assert "RESULT drains >= 1000  3 calls, 30000 datagrams, 18.00 ms, 600 ns a datagram" in text
    assert "RESULT drains < 1000   none" in text
    # the pumps that sent 1000 or more: the start's (34000) and the results' (35000)
    assert "flushes >= 1000        6 calls, 207000 datagrams, 96.00 ms" in text
    assert "the median round (70.0 ms)" in text
    assert "took 10000 (10000 DATA, 0 RESULT), backlog 0" in text
    assert summary(parse(_round(1.0, 60))) == "no round after the warm-up in the trace"


def test_install_traces_a_real_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapped methods still run and write one line a call, with what the
    call took off its socket (here datagrams that are not dlcp's: taken,
    none accepted)."""
    import asyncio
    import socket

    from dlcp.core.engine import Engine
    from dlcp.daemon.config import Config
    from dlcp.daemon.netin import NetworkIn
    from dlcp.daemon.rounds import RoundLifecycle
    from dlcp.daemon.server import Daemon
    from dlcp.daemon.transport import UdpPath

    # monkeypatch puts them back
    monkeypatch.setattr(RoundLifecycle, "_start_round", RoundLifecycle._start_round)
    monkeypatch.setattr(NetworkIn, "_receive", NetworkIn._receive)
    monkeypatch.setattr(Daemon, "_pump", Daemon._pump)
    monkeypatch.setattr(Engine, "submit", Engine.submit)
    out = StringIO()
    install(out)
    d = Daemon(Config())
    loop = asyncio.new_event_loop()  # its clock only: never run
    d._loop = loop
    path = UdpPath("127.0.0.1", 0)
    d.paths.append(path)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
            for _ in range(3):
                tx.sendto(b"not dlcp" * 20, ("127.0.0.1", path.sock.getsockname()[1]))
        d._pump()
        d._receive(path)
    finally:
        path.close()
        loop.close()
    es = parse(out.getvalue().splitlines())
    assert [(e.name, e.rx, e.data, e.result, e.sent, e.backlog) for e in es] == [
        ("_pump", 0, 0, 0, 0, 0),
        ("_receive", 3, 0, 0, 0, 0),
    ]
    assert all(e.us >= 0 for e in es)
    assert es[0].end <= es[1].start
