"""The shim protocol's request errors and field checks (docs/shim-protocol.md).

A request the daemon cannot take is answered with an error code and a one-line
message (`RequestError`); malformed fields are "bad_request".
"""

from __future__ import annotations

from typing import Any

from dlcp.errors import DlcpError

__all__ = ["RequestError", "bad_request", "float_field", "int_field"]


class RequestError(DlcpError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def bad_request(msg: str) -> RequestError:
    return RequestError("bad_request", msg)


def int_field(req: dict[str, Any], name: str, lo: int, hi: int) -> int:
    v = req.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise bad_request(f"{name} must be an integer in {lo}..{hi}")
    return v


def float_field(req: dict[str, Any], name: str, lo: float, hi: float, default: float) -> float:
    v = req.get(name, default)
    if not isinstance(v, int | float) or isinstance(v, bool) or not lo <= v <= hi:
        raise bad_request(f"{name} must be a number in {lo}..{hi}")
    return float(v)
