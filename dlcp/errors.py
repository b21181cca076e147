"""Error types shared by the parts.

Two kinds, as in h11: `LocalError` when a caller misused an API, `RemoteError`
when a peer sent something bad. Every `RemoteError` carries a `Reason`, which is
what metrics count.
"""

from __future__ import annotations

import enum

__all__ = ["DlcpError", "LocalError", "Reason", "RemoteError", "WireError"]


class DlcpError(Exception):
    """Base of all dlcp errors."""


class LocalError(DlcpError, ValueError):
    """The caller misused an API (bad argument, bad configuration)."""


class Reason(enum.IntEnum):
    """Why a datagram or request was rejected; the label of reject metrics."""

    TRUNCATED = 1
    BAD_MAGIC = 2
    BAD_VERSION = 3
    BAD_TYPE = 4
    BAD_FLAGS = 5
    BAD_PRIORITY = 6
    BAD_CODEC = 7
    RESERVED = 8
    BAD_RANGE = 9
    BAD_LENGTH = 10
    BAD_MAC = 11
    UNKNOWN_JOB = 12
    BAD_SENDER = 13
    STALE_ROUND = 14
    MISMATCH = 15
    BAD_ADDRESS = 16

    @property
    def label(self) -> str:
        return self.name.lower()


class RemoteError(DlcpError):
    """A peer sent something we reject; `reason` says why."""

    def __init__(self, reason: Reason, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason.label}: {detail}" if detail else reason.label)


class WireError(RemoteError):
    """A datagram that is malformed, truncated, out of range or unauthenticated."""
