"""The backends of `--backends`: one table, name -> how the benches run it.

A row says which family runs the backend (dlcp: daemons and the shim's hook;
gloo: torch.distributed over Gloo), which DDP communication hook or cast a
Gloo row uses (`hook`), whether its TCP is marked into the top class during
the run (`prio`, nftables DSCP as gloo-prio), and in which benches it cannot
run (`refused`: bench -> the one-line reason). A new baseline or ablation
(e.g. `dlcp-nooverlap`) is one more row; the benches read everything else from
here. Pure: no imports of the benches (dlcp.bench.common imports this).

PowerSGD: PyTorch's `powerSGD_hook` chains its all-reduces in `.then`
callbacks; with several DDP buckets in flight over Gloo the ranks issue them
in different orders and abort ("Received data size doesn't match expected
size"), and `batched_powerSGD_hook` fails on CPU tensors (its
`_orthogonalize` asserts a batch of matrices, torch 2.13). The benches run
`powerSGD_hook` with each bucket's chain started only after the previous
bucket's future completed (`dlcp.bench.hooks`), the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "BENCHES",
    "HOOK_CODECS",
    "NOMINAL_BITS",
    "POWERSGD_RANK",
    "TABLE",
    "Backend",
    "gloo_ifnames",
]

BENCHES: tuple[str, ...] = ("allreduce", "train", "ddp")
# A Gloo row's hook -> the codec its records carry (their dtype on the wire).
HOOK_CODECS: Mapping[str, str] = {
    "default": "fp32",
    "fp16": "fp16",
    "bf16": "bf16",
    "powersgd": "powersgd",
}
# PowerSGD's matrix_approximation_rank (every record carries it as powersgd_rank).
POWERSGD_RANK = 4
# Significant bits a gradient value keeps on the wire, by codec (fp32 24,
# fp16 11, bf16 8: their mantissas and the implicit bit; THC's levels): the
# nominal precision a report falls back on when a record measured no accuracy
# (bench ddp, or allreduce with --no-check). 0: lossy by selection (low rank,
# top frequencies, sketches), not by precision.
NOMINAL_BITS: Mapping[str, int] = {
    "fp32": 24,
    "fp16": 11,
    "bf16": 8,
    "thc8": 8,
    "thc4": 4,
    "fft": 0,
    "sketch": 0,
    "powersgd": 0,
}

_POWERSGD_ALLREDUCE = (
    "PowerSGD compresses a layer's gradient matrix to low rank; bench allreduce's "
    "buffer is one plain tensor with no such structure: run it in bench train or bench ddp"
)
_DDP_ABLATION = (
    "bench ddp runs one daemon configuration (dlcp's); the ablations run in "
    "bench allreduce and bench train"
)


@dataclass(frozen=True)
class Backend:
    """How the benches run one `--backends` name."""

    name: str
    family: str  # "dlcp" or "gloo"
    help: str
    hook: str = "default"  # gloo: a HOOK_CODECS key
    prio: bool = False  # gloo: its TCP marked into the top gradient class
    refused: Mapping[str, str] = field(default_factory=dict)  # bench -> why not

    @property
    def is_dlcp(self) -> bool:
        return self.family == "dlcp"

    def codec(self, dlcp_codec: str) -> str:
        """The `codec` of this backend's records when dlcp runs `dlcp_codec`."""
        return dlcp_codec if self.is_dlcp else HOOK_CODECS[self.hook]


def _gloo(hook: str, what: str, **kw: object) -> list[Backend]:
    """A Gloo baseline and its -prio variant."""
    name = "gloo" if hook == "default" else f"gloo-{hook}"
    plain = Backend(name, "gloo", what, hook=hook, **kw)  # type: ignore[arg-type]
    prio = Backend(
        f"{name}-prio", "gloo", f"{what}, its TCP marked into the top class",
        hook=hook, prio=True, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    return [plain, prio]


_ROWS: list[Backend] = [
    Backend("dlcp", "dlcp", "dlcp's daemons and DDP hook"),
    *_gloo("default", "DDP's default hook, Gloo fp32"),
    *_gloo("fp16", "DDP's fp16_compress_hook, in allreduce the buffer cast to fp16"),
    *_gloo("bf16", "DDP's bf16_compress_hook, in allreduce the buffer cast to bf16"),
    *_gloo(
        "powersgd",
        f"DDP's powerSGD_hook, rank {POWERSGD_RANK}, buckets one after another",
        refused={"allreduce": _POWERSGD_ALLREDUCE},
    ),
    Backend(
        "dlcp-noprio", "dlcp", "ablation, every gradient packet in one class",
        refused={"ddp": _DDP_ABLATION},
    ),
    Backend(
        "dlcp-nobound", "dlcp", "ablation, loss bound 0, every packet recovered",
        refused={"ddp": _DDP_ABLATION},
    ),
    Backend(
        "dlcp-1path", "dlcp", "ablation, one address per daemon",
        refused={"ddp": _DDP_ABLATION},
    ),
    Backend(
        "dlcp-nooverlap", "dlcp",
        "ablation (train --overlap on): the same codec and bound, the optimizer after backward",
        refused={"ddp": _DDP_ABLATION, "allreduce": "overlap is a training mode: bench train"},
    ),
]  # fmt: skip
TABLE: Mapping[str, Backend] = {b.name: b for b in _ROWS}


def gloo_ifnames(paths: int) -> str:
    """GLOO_SOCKET_IFNAME for a testbed with `paths` paths: every interface
    (eth0,eth1 with two), so Gloo is not held to one NIC beside dlcp on two."""
    return ",".join(f"eth{p}" for p in range(max(1, paths)))


def help_text(bench: str) -> str:
    """`--backends`' help for `bench`: the names it runs, what each is."""
    names = [f"{b.name} = {b.help}" for b in _ROWS if bench not in b.refused and not b.prio]
    return (
        "comma-separated, of: "
        + "; ".join(names)
        + "; and each gloo name with -prio (gloo-prio, gloo-fp16-prio, ...): its TCP "
        "marked into the top class (default: %(default)s)"
    )
