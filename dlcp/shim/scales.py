"""THC's scales (`Scales`), the same on every rank.

THC needs one scale per packet that every rank shares (`scale_mode`):
"packet" (default) and "bucket" reuse the previous round's maxima (of each
packet, or of the bucket) times `scale_margin`, carried by the step's
agreement all-reduce, and clamp what exceeds them (error feedback resends
it); "exact" agrees this round's per-packet maxima before encoding, so
nothing saturates, at the price of a probe encode (THC's rotation) and one
blocking all-reduce (MAX) per bucket inside DDP's backward. A bucket's
first round always agrees exactly. The decision to run these collectives
depends only on state every rank shares, so every rank issues them, failed
or not.
"""

from __future__ import annotations

import torch

from dlcp.codecs import next_scale
from dlcp.shim.exchange import RoundPlan
from dlcp.shim.settings import check_scale
from dlcp.shim.stepstate import Key, _Pending

__all__ = ["Scales"]


class Scales:
    """The scales of the buckets that keep theirs across steps (pickled with
    the state: `by_key`)."""

    def __init__(
        self, mode: str, margin: float, by_key: dict[Key, torch.Tensor] | None = None
    ) -> None:
        check_scale(margin, mode)
        self.mode = mode
        self.margin = float(margin)
        self.by_key: dict[Key, torch.Tensor] = {} if by_key is None else by_key

    def known(self, key: Key, packets: int) -> torch.Tensor | None:
        """The scale bucket `key` carries from its last round; None when this
        round must agree one (its first, a new shape, or mode "exact")."""
        scale = self.by_key.get(key)
        if scale is None or scale.numel() != packets or self.mode == "exact":
            return None
        return scale

    def from_maxima(self, maxima: torch.Tensor) -> torch.Tensor:
        """The scale for agreed `maxima` (per packet), by the mode and margin."""
        clean = torch.nan_to_num(maxima.to(torch.float32), nan=0.0, posinf=0.0, neginf=0.0)
        clean = clean.clamp(min=0.0)
        if self.mode == "bucket" and clean.numel():
            clean = clean.max().expand(clean.numel())
        margin = 1.0 if self.mode == "exact" else self.margin
        return next_scale(clean, margin)

    def carried(self, pending: list[_Pending]) -> torch.Tensor | None:
        """What the agreement carries for the next scales: per bucket its max
        ("bucket") or its per-packet maxima ("packet"); nothing for "exact".
        Zeros where this rank has none: the length is the same on every rank."""
        if self.mode == "exact":
            return None
        parts = []
        for p in pending:
            if p.plan is None or not p.plan.scaled:
                continue
            n = p.plan.packets if self.mode == "packet" else 1
            if p.sub is None:
                parts.append(torch.zeros(n))
            elif n == 1:
                parts.append(p.sub.block_max.max().reshape(1))
            else:
                parts.append(p.sub.block_max)
        return torch.cat(parts) if parts else None

    def learn(self, p: _Pending, plan: RoundPlan, maxima: torch.Tensor, at: int) -> int:
        """Keep bucket `p`'s next scale (its round `plan`) from the agreed
        `maxima[at:]`; returns where its successor's maxima start."""
        if not plan.scaled or self.mode == "exact":
            return at
        n = plan.packets if self.mode == "packet" else 1
        if p.keep:
            self.by_key[p.key] = self.from_maxima(maxima[at : at + n].expand(plan.packets))
        return at + n

    def drop_codec(self, codec: str) -> None:
        """Forget the scales of `codec`'s buckets (auto left it)."""
        for k in [k for k in self.by_key if len(k) > 2 and k[1] == codec]:
            del self.by_key[k]
