"""The per-parameter optimizers overlap mode applies bucket by bucket: PyTorch's
functional SGD, Adam and AdamW (`torch.distributed.optim`, whose `step_param`
updates one parameter from one gradient), made from the arguments a user
would give `torch.optim.SGD/Adam/AdamW`, reading their hyperparameters from
the param group they serve (so LR schedulers act on them), and sharing one
state dict with the optimizer that holds them (so `state_dict()` has
torch.optim's layout).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from dlcp.errors import LocalError

__all__ = ["FUNCTIONAL", "Functional", "functional_for", "sync_hyper"]

Functional = Any  # a torch.distributed.optim._Functional* (a TorchScript class)

# the gradient must be whole before any update: not per-parameter
_WHOLE_GRADIENT = (
    "an optimizer that needs the whole gradient before any update (LAMB, LARS, "
    "global-norm clipping, GradScaler, LBFGS) cannot update layer by layer: call "
    "opt.flush() and use it in plain mode (dlcp.overlap(..., enabled=False), or "
    "the plain dlcp.hook with a torch.optim optimizer)"
)


def _sgd(params: list[torch.Tensor], group: dict[str, Any]) -> Functional:
    from torch.distributed.optim.functional_sgd import _FunctionalSGD

    return _FunctionalSGD(
        params,
        lr=float(group["lr"]),
        momentum=float(group.get("momentum", 0.0)),
        dampening=float(group.get("dampening", 0.0)),
        weight_decay=float(group.get("weight_decay", 0.0)),
        nesterov=bool(group.get("nesterov", False)),
        maximize=bool(group.get("maximize", False)),
        _allow_empty_param_list=True,
    )


def _adam_like(cls: Any) -> Callable[[list[torch.Tensor], dict[str, Any]], Functional]:
    def make(params: list[torch.Tensor], group: dict[str, Any]) -> Functional:
        b1, b2 = group.get("betas", (0.9, 0.999))
        kw: dict[str, Any] = {}
        if "weight_decay" in group:
            kw["weight_decay"] = float(group["weight_decay"])
        return cls(
            params,
            lr=float(group["lr"]),
            betas=(float(b1), float(b2)),
            eps=float(group.get("eps", 1e-8)),
            amsgrad=bool(group.get("amsgrad", False)),
            maximize=bool(group.get("maximize", False)),
            _allow_empty_param_list=True,
            **kw,
        )

    return make


def _functionals() -> dict[type, Callable[[list[torch.Tensor], dict[str, Any]], Functional]]:
    from torch.distributed.optim.functional_adam import _FunctionalAdam
    from torch.distributed.optim.functional_adamw import _FunctionalAdamW

    return {
        torch.optim.SGD: _sgd,
        torch.optim.Adam: _adam_like(_FunctionalAdam),
        torch.optim.AdamW: _adam_like(_FunctionalAdamW),
    }


FUNCTIONAL: tuple[str, ...] = ("SGD", "Adam", "AdamW")


def defaults_of(optimizer: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`optimizer`'s defaults with `kwargs` over them, checked the way
    `optimizer(...)` checks them (a throwaway instance on one parameter)."""
    if optimizer not in _functionals():
        raise LocalError(
            f"dlcp.overlap applies {', '.join(FUNCTIONAL)} layer by layer, not "
            f"{getattr(optimizer, '__name__', optimizer)!r}: {_WHOLE_GRADIENT}"
        )
    probe = optimizer([torch.nn.Parameter(torch.zeros(1))], **kwargs)
    group = dict(probe.param_groups[0])
    group.pop("params")
    for unsupported in ("foreach", "fused", "capturable", "differentiable"):
        if group.get(unsupported):
            raise LocalError(f"dlcp.overlap does not take {unsupported}=True")
    return group


def functional_for(
    optimizer: type, params: list[torch.Tensor], group: dict[str, Any], state: Any
) -> Functional:
    """The functional optimizer of `optimizer` for one param group, its state `state`."""
    with warnings.catch_warnings():  # "TorchScript support for functional optimizers is deprecated"
        warnings.simplefilter("ignore")
        f = _functionals()[optimizer](params, group)
    f.state = state
    return f


def sync_hyper(f: Functional, group: dict[str, Any]) -> None:
    """Copy a param group's hyperparameters (an LR scheduler's lr, say) into `f`."""
    d = f.defaults
    d["lr"] = float(group["lr"])
    if "momentum" in d:  # SGD
        d["momentum"] = float(group.get("momentum", 0.0))
        d["dampening"] = float(group.get("dampening", 0.0))
        f.nesterov = bool(group.get("nesterov", False))
    else:  # Adam, AdamW
        b1, b2 = group.get("betas", (d["beta1"], d["beta2"]))
        d["beta1"], d["beta2"] = float(b1), float(b2)
        d["eps"] = float(group.get("eps", d["eps"]))
    d["weight_decay"] = float(group.get("weight_decay", d["weight_decay"]))
    f.maximize = bool(group.get("maximize", False))


def whole_gradient_error(what: str) -> LocalError:
    return LocalError(f"dlcp.overlap: {what}: {_WHOLE_GRADIENT}")
