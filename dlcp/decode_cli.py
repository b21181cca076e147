"""`dlcp decode`: what the dlcp packets of a capture (pcap or pcapng) say.

    tcpdump -i h0p0 -w run.pcap udp port 7400   # e.g. on a testbed switch port
    dlcp decode run.pcap                         # summary tables
    dlcp decode run.pcap --json | jq .           # one object per dlcp datagram
    dlcp decode run.pcap --key-file job.key --job 7   # and check each MAC

Takes the UDP datagrams from or to --port (default 7400, dlcpd's `udp_port`)
in capture order and parses each with dlcp's own decoder, so a malformed one
shows with the decoder's reject reason (truncated, bad_magic, bad_version,
bad_type, bad_length, ...). IP fragments are counted, not reassembled; a UDP
GSO super-datagram captured before segmentation shows as bad_length.

The summary counts datagrams and their bytes (UDP payload: header + lanes) per
type, priority class, DSCP (IP TOS >> 2), sender (header index) and round;
retransmissions (RETRANSMIT flag); and per (job, round, bucket) the data,
result, DONE, NACK and ACK packets seen and the share of the bucket's elements
that result packets covered. A capture on one port sees one host's traffic.
Datagrams whose MAC fails are counted in the tables too (and as MAC failures).

--json prints per datagram: frame, time, src, dst, dscp, length, the header
fields (type, codec by name; class is the header's priority; flags a list of
names), `reject` and `detail` for malformed ones, and `mac` with --key-file.

The key file holds the job key the ranks joined with: 32 raw bytes, or 64 hex
digits (surrounding whitespace ignored). --mac picks the daemon's
`[network] mac` (default ghash-aes). Exit status 0, or 2 when the capture or
key cannot be read.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlcp.decode_stats import Summary
from dlcp.errors import Reason, WireError
from dlcp.wire.header import HEADER_SIZE, Codec, PacketType, decode
from dlcp.wire.mac import MAC_ALGORITHMS, MacKey, mac_state

__all__ = ["Datagram", "datagrams", "read_key", "register", "run"]

DEFAULT_PORT = 7400  # dlcp.daemon.config.Config.udp_port
_TYPE_NAME = {int(t): t.name for t in PacketType}
_CODEC_NAME = {int(c): c.name for c in Codec}


class DecodeError(Exception):
    """The capture or key cannot be read (exit status 2)."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "decode",
        help="decode the dlcp packets of a pcap/pcapng capture",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("file", metavar="FILE", help="capture file (pcap or pcapng, e.g. tcpdump -w)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="dlcp UDP port, either direction (7400)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per dlcp datagram")
    p.add_argument(
        "--key-file",
        type=Path,
        default=None,
        help="job key: 32 raw bytes or 64 hex digits; checks the MACs of --job",
    )
    p.add_argument("--job", type=int, default=None, help="job whose key --key-file holds")
    p.add_argument(
        "--mac",
        choices=MAC_ALGORITHMS,
        default="ghash-aes",
        help="the daemons' packet MAC, [network] mac (default ghash-aes)",
    )
    p.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class Datagram:
    """One UDP datagram on the dlcp port, checked by `dlcp.wire.decode`."""

    frame: int  # 1-based frame number in the capture
    time: float
    src: str  # "ip:port"
    dst: str
    dscp: int | None
    data: bytes  # the UDP payload
    reject: Reason | None  # why the decoder rejects it (not for the MAC, not an unknown job)
    detail: str
    mac: str | None  # "ok", "bad", or None: not checked (no key for its job, malformed)

    def fields(self) -> dict[str, Any]:
        """The header fields via the scapy layer; {} when shorter than a header."""
        if len(self.data) < HEADER_SIZE:
            return {}
        from dlcp.wire.dissector import DLCP, flag_names

        h = DLCP(self.data[:HEADER_SIZE])
        return {
            "type": _TYPE_NAME.get(h.type, h.type),
            "job": h.job,
            "round": h.round,
            "bucket": h.bucket,
            "shard": h.shard,
            "layer": h.layer,
            "sender": h.sender,
            "contributors": h.contributors,
            "offset": h.offset,
            "count": h.count,
            "total": h.total,
            "class": h.priority,
            "codec": _CODEC_NAME.get(h.codec, h.codec),
            "flags": flag_names(int(h.flags)),
            "param": h.param,
            "aux": h.aux,
        }


def check(data: bytes, keys: dict[int, MacKey]) -> tuple[Reason | None, str, str | None]:
    """(reject reason, detail, mac) of one datagram: `decode` with the keys given."""
    try:
        decode(data, keys)
    except WireError as exc:
        if exc.reason == Reason.UNKNOWN_JOB:  # well formed; no key for its job
            return None, "", None
        if exc.reason == Reason.BAD_MAC:
            return None, "", "bad"
        return exc.reason, exc.detail, None
    return None, "", "ok"


def datagrams(
    path: str | Path, port: int, keys: dict[int, MacKey], skipped: dict[str, int]
) -> Iterator[Datagram]:
    """The datagrams from or to `port` in `path`, streamed in capture order.
    IP fragments are not reassembled: `skipped["ip_fragments"]` counts them."""
    logging.getLogger("scapy.runtime").setLevel(logging.ERROR)
    from scapy.error import Scapy_Exception
    from scapy.layers.inet import IP, UDP
    from scapy.layers.inet6 import IPv6
    from scapy.utils import PcapReader

    try:
        reader = PcapReader(str(path))
    except (OSError, Scapy_Exception, EOFError) as exc:
        raise DecodeError(f"cannot read {path}: {exc}") from exc
    with reader:
        frames = iter(reader)
        n = 0
        while True:
            try:
                frame = next(frames)
            except StopIteration:
                return
            except (OSError, Scapy_Exception, EOFError, ValueError) as exc:
                raise DecodeError(f"cannot read {path} after frame {n}: {exc}") from exc
            n += 1
            ip = frame.getlayer(IP) or frame.getlayer(IPv6)
            if ip is None:
                continue
            udp = ip.payload
            if type(udp) is not UDP or port not in (udp.sport, udp.dport):
                if isinstance(ip, IP) and ip.proto == 17 and (ip.frag or ip.flags.MF):
                    skipped["ip_fragments"] = skipped.get("ip_fragments", 0) + 1
                continue
            if isinstance(ip, IP) and (ip.frag or ip.flags.MF):
                skipped["ip_fragments"] = skipped.get("ip_fragments", 0) + 1
                continue
            data = bytes(udp)[8 : udp.len] if udp.len and udp.len >= 8 else bytes(udp)[8:]
            tos = ip.tos if isinstance(ip, IP) else ip.tc
            reject, detail, mac = check(data, keys)
            yield Datagram(
                frame=n,
                time=float(frame.time),
                src=_endpoint(ip.src, udp.sport),
                dst=_endpoint(ip.dst, udp.dport),
                dscp=None if tos is None else int(tos) >> 2,
                data=data,
                reject=reject,
                detail=detail,
                mac=mac,
            )


def _endpoint(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def read_key(path: Path) -> bytes:
    """A job key file: 32 raw bytes, or 64 hex digits (whitespace around ignored)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DecodeError(f"cannot read key file {path}: {exc}") from exc
    if len(raw) == 32:
        return raw
    try:
        key = bytes.fromhex(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != 32:
        raise DecodeError(f"key file {path}: want 32 raw bytes or 64 hex digits")
    return key


def to_json(d: Datagram, with_mac: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "frame": d.frame,
        "time": d.time,
        "src": d.src,
        "dst": d.dst,
        "dscp": d.dscp,
        "length": len(d.data),
        **d.fields(),
        "reject": None if d.reject is None else d.reject.label,
    }
    if d.reject is not None:
        out["detail"] = d.detail
    if with_mac:
        out["mac"] = d.mac
    return out


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except DecodeError as exc:
        print(f"dlcp decode: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `| head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _run(args: argparse.Namespace) -> int:
    if not 1 <= args.port <= 65535:
        raise DecodeError(f"--port must be 1..65535, not {args.port}")
    if (args.key_file is None) != (args.job is None):
        raise DecodeError("--key-file and --job go together")
    keys: dict[int, MacKey] = {}
    if args.key_file is not None:
        keys[args.job] = mac_state(read_key(args.key_file), args.mac)
    skipped: dict[str, int] = {}
    summary = Summary(port=args.port, job=args.job)
    for d in datagrams(args.file, args.port, keys, skipped):
        if args.json:
            print(json.dumps(to_json(d, bool(keys))))
        else:
            summary.add(d)
    sys.stdout.flush()
    if not args.json:
        print(summary.render(str(args.file), skipped.get("ip_fragments", 0)))
    elif skipped.get("ip_fragments"):
        print(f"dlcp decode: {skipped['ip_fragments']} IP fragments skipped", file=sys.stderr)
    return 0
