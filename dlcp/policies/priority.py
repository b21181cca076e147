"""Priority policies: which class (and DSCP) each gradient packet travels in.

Class conventions (shared with the tc layout): 8 classes, 0 highest.
0 carries control packets (NACK, DONE, heartbeats); 1..5 non-droppable
gradient packets, 1 the most important; 6 is best effort, the tc default class
for unmarked traffic, never used by dlcp gradients; 7 droppable gradient
packets (short queue, scavenger). A priority policy picks 1..5; the drop
policy's droppable packets are then moved to 7 with `apply_droppable`.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from dlcp.errors import LocalError
from dlcp.policies._check import as_1d, check_float, check_int, check_same_length, density
from dlcp.policies.registry import register

__all__ = [
    "BEST_EFFORT_CLASS",
    "CONTROL_CLASS",
    "DEFAULT_DSCP",
    "DROPPABLE_CLASS",
    "GRADIENT_CLASSES",
    "N_CLASSES",
    "FlowPriority",
    "LayerMagnitudePriority",
    "PriorityPolicy",
    "apply_droppable",
    "check_dscp_table",
]

N_CLASSES = 8
CONTROL_CLASS = 0
GRADIENT_CLASSES = range(1, 6)  # non-droppable gradient classes, 1 most important
BEST_EFFORT_CLASS = 6
DROPPABLE_CLASS = 7
# CS6, CS5, AF41, AF31, AF21, AF11, CS0, CS1 for classes 0..7.
DEFAULT_DSCP: tuple[int, ...] = (48, 40, 34, 26, 18, 10, 0, 8)

_FIRST = GRADIENT_CLASSES.start
_N_GRADIENT = len(GRADIENT_CLASSES)


def check_dscp_table(table: Sequence[int]) -> tuple[int, ...]:
    """A validated class -> DSCP table: 8 integers in 0..63."""
    if isinstance(table, str | bytes) or not isinstance(table, Sequence | np.ndarray):
        raise LocalError(f"dscp table must be a list of {N_CLASSES} integers, got {table!r}")
    values = tuple(table)
    if len(values) != N_CLASSES:
        raise LocalError(f"dscp table needs {N_CLASSES} entries (one per class), got {len(values)}")
    return tuple(check_int(v, f"dscp[{i}]", lo=0, hi=63) for i, v in enumerate(values))


def apply_droppable(classes: npt.ArrayLike, droppable: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """`classes` with droppable packets moved to DROPPABLE_CLASS (a new array)."""
    c = as_1d(classes, "classes", np.uint8)
    d = as_1d(droppable, "droppable", np.bool_)
    check_same_length(classes=c, droppable=d)
    return np.where(d, np.uint8(DROPPABLE_CLASS), c).astype(np.uint8, copy=False)


class PriorityPolicy(ABC):
    """Maps a bucket's packets to priority classes 1..5 and classes to DSCP."""

    name: str = ""

    def __init__(self, *, dscp: Sequence[int] = DEFAULT_DSCP) -> None:
        self.dscp_table: tuple[int, ...] = check_dscp_table(dscp)
        self._dscp_lut = np.asarray(self.dscp_table, dtype=np.uint8)

    @abstractmethod
    def classify(
        self,
        *,
        layers: np.ndarray,
        n_layers: int,
        norms: np.ndarray,
        counts: np.ndarray,
    ) -> npt.NDArray[np.uint8]:
        """One class in 1..5 per packet of one bucket.

        `layers`: layer index of each packet (0 = the model's first layer),
        `n_layers`: layers in the model, `norms`: L2 norm of each packet's
        slice before encoding, `counts`: lanes (elements) per packet.
        """

    def lowest(self, *, layers: np.ndarray, n_layers: int) -> npt.NDArray[np.uint8]:
        """Per packet, the lowest class (highest number) `classify` gives it
        whatever its magnitude: what a receiver knows of another host's class
        for the packet (the layers are the bucket's, the same at every host;
        the norms are not). This base says only GRADIENT_CLASSES' last."""
        return np.full(len(layers), GRADIENT_CLASSES[-1], dtype=np.uint8)

    def dscp(self, classes: npt.ArrayLike) -> npt.NDArray[np.uint8]:
        """The configured DSCP (0..63) of each class (0..7)."""
        c = np.asarray(classes)
        if c.size and (c.min() < 0 or c.max() >= N_CLASSES):
            raise LocalError(f"priority classes must be in 0..{N_CLASSES - 1}")
        return self._dscp_lut[c.astype(np.intp, copy=False)]

    @staticmethod
    def _check_layers(layers: np.ndarray, n_layers: int, n: int) -> np.ndarray:
        n_layers = check_int(n_layers, "n_layers", lo=1)
        arr = as_1d(layers, "layers", np.int64)
        if len(arr) != n:
            raise LocalError(f"layers has {len(arr)} entries for {n} packets")
        if arr.size and (arr.min() < 0 or arr.max() >= n_layers):
            raise LocalError(f"layers must be in 0..{n_layers - 1}")
        return arr


def _band(score: np.ndarray) -> npt.NDArray[np.uint8]:
    """Scores in [0, 1] cut into the five gradient classes: 1 -> class 1, 0 -> 5."""
    band = np.floor((1.0 - score) * _N_GRADIENT)
    return (_FIRST + np.clip(band, 0, _N_GRADIENT - 1)).astype(np.uint8)


@register("priority", "layer_magnitude")
class LayerMagnitudePriority(PriorityPolicy):
    """Front layers and large magnitudes first (DLCP's gradient-aware priority).

    layer score = 1 - layer / (n_layers - 1): the next forward pass needs the
    front layers first. magnitude score = the fraction of the bucket's density
    quantiles (at `magnitude_quantiles`) that the packet's density
    (norm / sqrt(count)) exceeds. score = layer_weight * layer score +
    (1 - layer_weight) * magnitude score in [0, 1], cut into five equal bands:
    score 1 -> class 1, score 0 -> class 5.
    """

    def __init__(
        self,
        *,
        layer_weight: float = 0.5,
        magnitude_quantiles: Sequence[float] = (0.2, 0.4, 0.6, 0.8),
        dscp: Sequence[int] = DEFAULT_DSCP,
    ) -> None:
        super().__init__(dscp=dscp)
        self.layer_weight = check_float(layer_weight, "layer_weight", lo=0.0, hi=1.0)
        if isinstance(magnitude_quantiles, str) or not isinstance(
            magnitude_quantiles, Sequence | np.ndarray
        ):
            raise LocalError("magnitude_quantiles must be a list of levels in (0, 1)")
        levels = [
            check_float(q, "magnitude_quantiles[]", lo=0.0, hi=1.0, lo_open=True)
            for q in magnitude_quantiles
        ]
        if not levels or any(b <= a for a, b in itertools.pairwise(levels)):
            raise LocalError("magnitude_quantiles must be a non-empty increasing list")
        self.magnitude_quantiles: tuple[float, ...] = tuple(levels)
        self._levels = np.asarray(levels)

    def layer_score(self, layers: np.ndarray, n_layers: int) -> npt.NDArray[np.float64]:
        """1 for the first layer, 0 for the last, linear in between."""
        if n_layers <= 1:
            return np.ones(len(layers))
        return 1.0 - layers.astype(np.float64) / (n_layers - 1)

    def magnitude_score(self, dens: np.ndarray) -> npt.NDArray[np.float64]:
        """Fraction of the bucket's density quantiles each packet exceeds (0..1)."""
        if dens.size == 0:
            return np.zeros(0)
        # np.quantile(dens, levels, method="lower"), which picks sample values
        # (so +inf densities never make a NaN cut): one partition at those
        # ranks; then how many cuts each packet exceeds, a comparison a cut
        # (what searchsorted(cuts, dens, "left") counts, in a tenth the time)
        ranks = np.floor(self._levels * (dens.size - 1)).astype(np.intp)
        cuts = np.partition(dens, np.unique(ranks))[ranks]
        above = np.zeros(dens.size, dtype=np.intp)
        for cut in cuts.tolist():
            above += dens > cut
        return above / len(cuts)

    def classify(
        self,
        *,
        layers: np.ndarray,
        n_layers: int,
        norms: np.ndarray,
        counts: np.ndarray,
    ) -> npt.NDArray[np.uint8]:
        dens, _ = density(norms, counts)
        lay = self._check_layers(layers, n_layers, len(dens))
        w = self.layer_weight
        score = w * self.layer_score(lay, int(n_layers)) + (1.0 - w) * self.magnitude_score(dens)
        return _band(score)

    def lowest(self, *, layers: np.ndarray, n_layers: int) -> npt.NDArray[np.uint8]:
        """The class a packet of its layer gets with a magnitude score of 0."""
        lay = self._check_layers(layers, n_layers, len(layers))
        return _band(self.layer_weight * self.layer_score(lay, int(n_layers)))


@register("priority", "flow")
class FlowPriority(PriorityPolicy):
    """Every gradient packet in one class: the flow-level priority baseline."""

    def __init__(self, *, gradient_class: int = 1, dscp: Sequence[int] = DEFAULT_DSCP) -> None:
        super().__init__(dscp=dscp)
        self.gradient_class = check_int(
            gradient_class, "gradient_class", lo=GRADIENT_CLASSES.start, hi=GRADIENT_CLASSES[-1]
        )

    def classify(
        self,
        *,
        layers: np.ndarray,
        n_layers: int,
        norms: np.ndarray,
        counts: np.ndarray,
    ) -> npt.NDArray[np.uint8]:
        n = check_same_length(norms=np.asarray(norms), counts=np.asarray(counts))
        self._check_layers(layers, n_layers, n)
        return np.full(n, self.gradient_class, dtype=np.uint8)

    def lowest(self, *, layers: np.ndarray, n_layers: int) -> npt.NDArray[np.uint8]:
        return np.full(len(layers), self.gradient_class, dtype=np.uint8)
