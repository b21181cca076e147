"""The one C extension (dlcp.wire._ghash, the ghash-aes packet MAC over OpenSSL).

Everything else is in pyproject.toml. The extension is optional: without a C
compiler or OpenSSL's headers the install goes on and `dlcp.wire.mac` falls back
to the `cryptography` package (the same tags, slower); `dlcp status` and the
daemon's log say which one runs.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dlcp.wire._ghash",
            sources=["dlcp/wire/_ghash.c"],
            libraries=["crypto"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
            optional=True,
        )
    ]
)
