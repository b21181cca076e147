"""The C extensions: dlcp.wire._ghash (the ghash-aes packet MAC over OpenSSL),
dlcp.daemon._keys (the outbox's packet identities), dlcp.daemon._udp (GSO
sends in batches of sendmmsg, GRO receives split), dlcp.wire._bulk (the
receive path's per-datagram header gathers, header checks and lane copies, one
call a batch) dlcp.daemon._arenas (freed object arenas kept for reuse), dlcp.codecs._thc
(THC's rotation, rounding and decode, a block at a time) and dlcp.codecs._fp16
(the fp16 encode in one pass).

Everything else is in pyproject.toml. All seven are optional: without a C compiler
or OpenSSL's headers the install goes on. `dlcp.wire.mac` then falls back to the
`cryptography` package (the same tags, slower; `dlcp status` and the daemon's
log say which one runs), the outbox to its Python definitions and the UDP
paths to one sendmsg per GSO super-datagram and a Python split of receives,
the header gathers and lane copies to Python loops, the daemon's object
arenas come and go as CPython makes them, and THC and the fp16 encode run in torch.
"""

from setuptools import Extension, setup

_CFLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"]

setup(
    ext_modules=[
        Extension(
            "dlcp.wire._ghash",
            sources=["dlcp/wire/_ghash.c"],
            # the Gathered datagram's layout; datagrams' bytes read in place
            depends=[
                "dlcp/wire/gathered.h",
                "dlcp/wire/bytes_of.h",
                "dlcp/wire/datagrams.h",
                "dlcp/wire/segment.h",
                "dlcp/wire/imported_type.h",
            ],
            libraries=["crypto"],
            extra_compile_args=_CFLAGS,
            optional=True,
        ),
        Extension(
            "dlcp.daemon._keys",
            sources=["dlcp/daemon/_keys.c"],
            depends=["dlcp/wire/gathered.h", "dlcp/wire/imported_type.h"],  # the Gathered layout
            extra_compile_args=_CFLAGS,
            optional=True,
        ),
        Extension(
            "dlcp.daemon._udp",
            sources=["dlcp/daemon/_udp.c"],
            # the Gathered datagram's layout, and the Datagrams it makes of receives
            depends=[
                "dlcp/wire/gathered.h",
                "dlcp/wire/datagrams.h",
                "dlcp/wire/bytes_of.h",
                "dlcp/wire/segment.h",
                "dlcp/wire/imported_type.h",
            ],
            extra_compile_args=_CFLAGS,
            optional=True,
        ),
        Extension(
            "dlcp.wire._bulk",
            sources=["dlcp/wire/_bulk.c"],
            # datagrams' bytes read in place; the Segment and Datagrams types;
            # the lane stores of the codecs whose wire lanes are not the sums'
            depends=[
                "dlcp/wire/lane_store.h",
                "dlcp/wire/bytes_of.h",
                "dlcp/wire/datagrams.h",
                "dlcp/wire/segment.h",
                "dlcp/wire/imported_type.h",
            ],
            extra_compile_args=_CFLAGS,
            optional=True,
        ),
        Extension(
            "dlcp.codecs._thc",
            sources=["dlcp/codecs/_thc.c"],
            # torch rounds every product and sum: no fused multiply-adds; no FP traps
            # assumed, so that the clamps and maxima vectorise (the same values)
            extra_compile_args=[*_CFLAGS, "-O3", "-ffp-contract=off", "-fno-trapping-math"],
            optional=True,
        ),
        Extension(
            "dlcp.codecs._fp16",
            sources=["dlcp/codecs/_fp16.c"],
            depends=["dlcp/wire/f16c.h"],
            extra_compile_args=[*_CFLAGS, "-O3"],
            optional=True,
        ),
        Extension(
            "dlcp.daemon._arenas",
            sources=["dlcp/daemon/_arenas.c"],
            extra_compile_args=_CFLAGS,
            optional=True,
        ),
    ]
)
