"""Codecs: torch encode/decode on the worker, numpy lane arithmetic at aggregators.

`get_codec(name)` gives a worker-side codec (`base.Codec`); `lanes` is what
aggregators use. Importing this package does not import torch (the daemon and
the sans-IO core only need `lanes`); the torch parts load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dlcp.errors import LocalError
from dlcp.wire.header import Codec as WireCodec

if TYPE_CHECKING:
    from dlcp.codecs.base import (
        Codec,
        CodecState,
        Encoded,
        Scale,
        block_norms,
        next_scale,
    )

__all__ = [
    "CODEC_NAMES",
    "WORKER_CODEC_NAMES",
    "Codec",
    "CodecState",
    "Encoded",
    "Scale",
    "block_norms",
    "codec_for_wire",
    "get_codec",
    "next_scale",
]

# name -> (module, class, fixed constructor arguments)
_REGISTRY: dict[str, tuple[str, str, dict[str, Any]]] = {
    "fp32": ("dlcp.codecs.fp", "Fp32Codec", {}),
    "fp16": ("dlcp.codecs.fp", "Fp16Codec", {}),
    "thc8": ("dlcp.codecs.thc", "ThcCodec", {"bits": 8}),
    "thc4": ("dlcp.codecs.thc", "ThcCodec", {"bits": 4}),
    "fft": ("dlcp.codecs.fft_wire", "FftWireCodec", {}),
}
# sketch: two exchanges, the index union (wire UNION) then the cells (SKETCH)
_REGISTRY["sketch"] = ("dlcp.codecs.sketch", "SketchCodec", {})
CODEC_NAMES: tuple[str, ...] = tuple(_REGISTRY)
# Worker-side codecs without a wire codec yet (the daemon cannot carry them):
# get_codec builds them for simulation, benchmarks and the cost model.
# fft-sim: HPDC 2020's own format (each worker its own coefficients, owner decodes).
_REGISTRY["fft-sim"] = ("dlcp.codecs.fft", "FftCodec", {})
WORKER_CODEC_NAMES: tuple[str, ...] = tuple(_REGISTRY)
_WIRE_NAMES: dict[int, str] = {
    WireCodec.FP32: "fp32",
    WireCodec.FP16: "fp16",
    WireCodec.THC8: "thc8",
    WireCodec.THC4: "thc4",
    WireCodec.UNION: "sketch",
    WireCodec.SKETCH: "sketch",
    WireCodec.FFT8: "fft",
    WireCodec.THC8_SUM10: "thc8",
    WireCodec.THC4_SUM8: "thc4",
}
_BASE_NAMES = frozenset({"Codec", "CodecState", "Encoded", "Scale", "block_norms", "next_scale"})


def get_codec(name: str, **params: Any) -> Codec:
    """The worker-side codec called `name` (fp32, fp16, thc8, thc4, fft, fft-sim, sketch).

    `params` are the codec's options (thc: `rotate=False` to skip the rotation;
    fft: `theta`, `block`, `explore`, `headroom`; fft-sim: `theta`, `exp_bits`,
    `man_bits`, `block`; sketch: `keep`, `load`).
    Raises `LocalError` for an unknown name or option.
    """
    entry = _REGISTRY.get(name)
    if entry is None:
        raise LocalError(f"unknown codec {name!r}; valid codecs: {', '.join(_REGISTRY)}")
    module, cls_name, fixed = entry
    clash = sorted(set(params) & set(fixed))
    if clash:
        raise LocalError(f"codec {name!r} fixes {', '.join(clash)}")
    cls = getattr(importlib.import_module(module), cls_name)
    try:
        codec: Codec = cls(**fixed, **params)
    except TypeError as exc:
        raise LocalError(f"codec {name!r} does not take options {sorted(params)}") from exc
    return codec


def codec_for_wire(wire: int, **params: Any) -> Codec:
    """The codec of a packet header's codec field (`dlcp.wire.header.Codec`)."""
    name = _WIRE_NAMES.get(int(wire))
    if name is None:
        raise LocalError(f"no codec for wire codec {wire}")
    return get_codec(name, **params)


def __getattr__(attr: str) -> Any:
    if attr in _BASE_NAMES:
        return getattr(importlib.import_module("dlcp.codecs.base"), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
