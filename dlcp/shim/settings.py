"""The settings of a `dlcp.shim.state.DlcpState` (its hyperparameters), checked
once; the state's parts read them and only the state's user changes them
(`state.loss_bound = ...` writes here, `Setting`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from dlcp.codecs import CODEC_NAMES, get_codec
from dlcp.errors import LocalError
from dlcp.shim.auto import AUTO
from dlcp.shim.placement import Placement, placement

__all__ = ["MODES", "SCALE_MODES", "Owned", "Setting", "ShimSettings"]

MODES = ("transpose", "ps", "switch")
# THC scale: this round's exact per-packet maxima, or the previous round's
# bucket max / per-packet maxima times the margin (`dlcp.shim.scales`).
SCALE_MODES = ("exact", "bucket", "packet")

T = TypeVar("T")


def _check_fraction(name: str, value: float, hi: float) -> float:
    v = float(value)
    if not (math.isfinite(v) and 0.0 <= v <= hi):
        raise LocalError(f"{name} must be in 0..{hi}, got {value!r}")
    return v


@dataclass
class ShimSettings:
    """What `DlcpState(...)` was given, checked (see its docstring)."""

    codec: str = "fp32"
    codec_options: dict[str, Any] = field(default_factory=dict)
    loss_bound: float = 0.0
    socket: str | None = None
    strict: bool = False
    retry_steps: int | None = 50
    retry_s: float | None = None
    round_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    rendezvous_timeout_s: float = 300.0
    mode: str = "transpose"
    switch_socket: str | None = None
    placement: Placement | None = None
    link_bps: float | str | None = None
    auto_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def checked(
        cls,
        *,
        codec: str,
        loss_bound: float,
        socket: str | None,
        strict: bool,
        retry_steps: int | None,
        retry_s: float | None,
        round_timeout_s: float,
        connect_timeout_s: float,
        rendezvous_timeout_s: float,
        mode: str,
        switch_socket: str | None,
        servers: Sequence[str] | str | None,
        colocate: bool | None,
        codec_options: dict[str, Any] | None,
        link_bps: float | str | None,
        auto_options: dict[str, Any] | None,
    ) -> ShimSettings:
        """The settings of `DlcpState(...)`'s arguments; raises `LocalError` on a bad one."""
        if codec not in CODEC_NAMES and codec != AUTO:
            raise LocalError(
                f"unknown codec {codec!r}; valid codecs: {', '.join(CODEC_NAMES)}, {AUTO}"
            )
        if mode not in MODES:
            raise LocalError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        if retry_steps is not None and (not isinstance(retry_steps, int) or retry_steps < 1):
            raise LocalError(f"retry_steps must be a positive int or None, got {retry_steps!r}")
        if retry_s is not None and not (math.isfinite(retry_s) and retry_s >= 0):
            raise LocalError(f"retry_s must be >= 0 or None, got {retry_s!r}")
        for name, value in (
            ("round_timeout_s", round_timeout_s),
            ("connect_timeout_s", connect_timeout_s),
            ("rendezvous_timeout_s", rendezvous_timeout_s),
        ):
            if not (math.isfinite(value) and value > 0):
                raise LocalError(f"{name} must be > 0, got {value!r}")
        options = dict(codec_options or {})
        if codec != AUTO:
            get_codec(codec, **options)  # fail early on bad options
        return cls(
            codec=codec,
            codec_options=options,
            loss_bound=_check_fraction("loss_bound", loss_bound, 0.5),
            socket=socket,
            strict=bool(strict),
            retry_steps=retry_steps,
            retry_s=retry_s,
            round_timeout_s=float(round_timeout_s),
            connect_timeout_s=float(connect_timeout_s),
            rendezvous_timeout_s=float(rendezvous_timeout_s),
            mode=mode,
            # mode "switch": the switch aggregator's socket (rank 0 puts the job there)
            switch_socket=switch_socket or os.environ.get("DLCP_SWITCH_SOCKET"),
            placement=placement(mode, servers, colocate),  # mode "ps": its aggregators
            link_bps=link_bps,
            auto_options=dict(auto_options or {}),
        )


def check_scale(scale_margin: float, scale_mode: str) -> None:
    """Raise `LocalError` unless THC's scale settings are valid."""
    if not (math.isfinite(scale_margin) and scale_margin >= 1.0):
        raise LocalError(f"scale_margin must be >= 1, got {scale_margin!r}")
    if scale_mode not in SCALE_MODES:
        raise LocalError(f"scale_mode must be one of {', '.join(SCALE_MODES)}, not {scale_mode!r}")


class Setting(Generic[T]):
    """A `DlcpState` attribute that is a field of its `ShimSettings` (`_settings`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> T:
        if obj is None:
            return self  # type: ignore[return-value]
        value: T = getattr(obj._settings, self.name)
        return value

    def __set__(self, obj: Any, value: T) -> None:
        setattr(obj._settings, self.name, value)


class Owned(Generic[T]):
    """A `DlcpState` attribute that one of its parts owns (`_parts.<part>.<attr>`,
    `attr` by default the attribute's own name): reading and writing it is the
    part's."""

    def __init__(self, part: str, attr: str | None = None) -> None:
        self.part = part
        self.attr = attr

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = self.attr or name

    def __get__(self, obj: Any, objtype: type | None = None) -> T:
        if obj is None:
            return self  # type: ignore[return-value]
        value: T = getattr(getattr(obj._parts, self.part), str(self.attr))
        return value

    def __set__(self, obj: Any, value: T) -> None:
        setattr(getattr(obj._parts, self.part), str(self.attr), value)
