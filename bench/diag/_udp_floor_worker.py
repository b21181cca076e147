"""One side of the UDP floor of bench/diag/veth_busbw.py (`--floor`): send N bytes
to the peer while receiving its N.

Prints one JSON line: bytes sent and received, seconds from the start signal
to the last byte received, datagrams, and this process's CPU seconds (user,
system) over the exchange. Nothing but moving bytes: no header, no MAC, no
aggregation; UDP_SEGMENT batches of up to 64 KB on send, UDP_GRO on receive,
as dlcpd uses them. Flow control keeps the receiver's socket from overflowing
(which would make the time meaningless): the receiver reports the bytes it has
every ACK_EVERY on a second socket (port + 1), and the sender keeps at most
WINDOW bytes unacknowledged.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import resource
import select
import socket
import struct
import sys
import time

SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104
MAX_GSO_BYTES = 65000
SO_SNDBUFFORCE = 32
SO_RCVBUFFORCE = 33
WINDOW = 8 << 20
ACK_EVERY = 512 << 10


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--me", required=True)
    p.add_argument("--peer", required=True)
    p.add_argument("--port", type=int, default=7500)
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--segment", type=int, required=True, help="datagram size, bytes")
    a = p.parse_args()
    seg = a.segment
    per_call = max(1, MAX_GSO_BYTES // seg)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for opt, force in ((socket.SO_RCVBUF, SO_RCVBUFFORCE), (socket.SO_SNDBUF, SO_SNDBUFFORCE)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, 32 << 20)  # beyond rmem_max: root
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, opt, 32 << 20)
    gro = True
    try:
        sock.setsockopt(SOL_UDP, UDP_GRO, 1)
    except OSError:
        gro = False
    sock.bind((a.me, a.port))
    sock.setblocking(False)
    acks = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    acks.bind((a.me, a.port + 1))
    acks.setblocking(False)
    dest = (a.peer, a.port)
    ack_dest = (a.peer, a.port + 1)
    out = memoryview(os.urandom(seg * per_call))
    inbuf = bytearray(1 << 16)
    cmsg = socket.CMSG_SPACE(4)
    print("ready", flush=True)
    sys.stdin.readline()  # the start signal: both sides at once
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    sent = got = dgs = calls = 0
    acked = told = 0  # the peer has `acked` of ours; we told it `told` of its
    last_rx = t0
    gso = struct.pack("=H", seg)
    while True:
        progressed = False
        while True:  # the peer's reports of what it received
            try:
                acked = max(acked, struct.unpack("!Q", acks.recv(8))[0])
            except BlockingIOError:
                break
        if sent < a.bytes and sent - acked < WINDOW:
            k = min(per_call, -(-(a.bytes - sent) // seg))
            n = min(k * seg, a.bytes - sent)
            try:
                if k > 1:
                    sock.sendmsg([out[:n]], [(SOL_UDP, UDP_SEGMENT, gso)], 0, dest)
                else:
                    sock.sendto(out[:n], dest)
                sent += n
                calls += 1
                progressed = True
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
        for _ in range(64):
            try:
                nbytes, anc, _flags, _addr = sock.recvmsg_into([inbuf], cmsg)
            except BlockingIOError:
                break
            got += nbytes
            size = seg
            for level, kind, value in anc:
                if gro and level == SOL_UDP and kind == UDP_GRO:
                    size = struct.unpack("=i", value[:4].ljust(4, b"\0"))[0] or seg
            dgs += -(-nbytes // size)
            last_rx = time.perf_counter()
            progressed = True
        if got - told >= ACK_EVERY or (got >= a.bytes and told < got):
            acks.sendto(struct.pack("!Q", got), ack_dest)
            told = got
        if got >= a.bytes and acked >= a.bytes:
            break
        if not progressed:
            want_w = [sock] if sent < a.bytes and sent - acked < WINDOW else []
            ready = select.select([sock, acks], want_w, [], 0.2)
            if not any(ready):
                break  # nothing for 200 ms: the rest was lost
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print(
        json.dumps(
            {
                "sent": sent,
                "received": got,
                "datagrams": dgs,
                "sendmsg_calls": calls,
                "seconds": last_rx - t0,
                "user_s": r1.ru_utime - r0.ru_utime,
                "sys_s": r1.ru_stime - r0.ru_stime,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
