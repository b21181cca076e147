"""Layer index (model order, 0 = first layer) of every parameter a bucket holds.

Priority policies rank packets by the layer they carry: front layers first,
because the next forward pass needs them first. The exact order comes from the
model (`LayerMap(model)`, parameter order of `model.parameters()`). Without a
model the map learns it from DDP's buckets: DDP reduces gradients in the order
they become ready, which is the reverse of the model's order once it has
rebuilt its buckets after the first step; so a parameter's layer is its
position counted from the end of the previous step's appearance order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["MAX_LAYER", "LayerMap", "packet_layers", "param_offsets"]

MAX_LAYER = 0xFFFF  # the header's layer field is a u16


class LayerMap:
    """Parameter -> layer index; exact from a model, learned from buckets otherwise."""

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self._fixed = model is not None
        self._layers: dict[int, int] = {}
        if model is not None:
            for i, p in enumerate(model.parameters()):
                self._layers.setdefault(id(p), min(i, MAX_LAYER))
        self._seen: list[int] = []
        self._seen_set: set[int] = set()
        self.version = 0  # bumped whenever layers change (callers cache on it)

    @property
    def learned(self) -> bool:
        return not self._fixed

    @property
    def n_layers(self) -> int:
        """Layers known (1 when none are)."""
        return max(1, min(len(self._layers), MAX_LAYER + 1))

    def layers_of(self, params: Iterable[torch.Tensor]) -> list[int]:
        """The layer of each parameter; 0 (most important) when not known yet."""
        return [self._layers.get(id(p), 0) for p in params]

    def observe(self, params: Iterable[torch.Tensor]) -> None:
        """Note the parameters of one bucket, in the order the bucket holds them."""
        if self._fixed:
            return
        for p in params:
            key = id(p)
            if key not in self._seen_set:
                self._seen_set.add(key)
                self._seen.append(key)

    def end_step(self) -> None:
        """A step's buckets are all seen: learn the order (reverse of appearance)."""
        if self._fixed or not self._seen:
            return
        n = len(self._seen)
        layers = {key: min(n - 1 - i, MAX_LAYER) for i, key in enumerate(self._seen)}
        self._seen = []
        self._seen_set = set()
        if layers != self._layers:
            self._layers = layers
            self.version += 1


def param_offsets(buffer: torch.Tensor, grads: Sequence[torch.Tensor]) -> list[int]:
    """Element offset of each gradient in the flat bucket `buffer`.

    DDP's bucket gradients are views into the buffer, so their data pointers
    give the offsets exactly; gradients that are not views are taken to be laid
    out back to back, in order.
    """
    base = buffer.data_ptr()
    size = buffer.element_size()
    end = base + buffer.numel() * size
    offsets: list[int] = []
    running = 0
    for g in grads:
        ptr = g.data_ptr()
        if g.numel() and base <= ptr < end and g.element_size() == size:
            running = (ptr - base) // size
        offsets.append(running)
        running += g.numel()
    return offsets


def packet_layers(
    spans: Sequence[tuple[int, int, int]], numel: int, per_packet: int, packets: int
) -> npt.NDArray[np.uint16]:
    """The layer of each packet: the smallest (most important) layer among the
    parameters whose elements the packet's slice holds.

    `spans` are (offset, numel, layer) of the parameters in the flat bucket;
    packet i holds elements [i * per_packet, (i + 1) * per_packet). Elements
    that no span covers (padding) do not count; a packet with none is layer 0.
    """
    out = np.full(packets, MAX_LAYER + 1, dtype=np.int64)
    for offset, count, layer in spans:
        if count <= 0:
            continue
        start = max(0, offset)
        stop = min(numel, offset + count)
        if stop <= start:
            continue
        first, last = start // per_packet, (stop - 1) // per_packet
        seg = out[first : last + 1]
        np.minimum(seg, layer, out=seg)
    out[out > MAX_LAYER] = 0
    return out.astype(np.uint16)
