"""Policies registered by kind and name, created from configuration.

As in aioquic's congestion control: each policy is a class registered under a
kind ("priority", "drop", "schedule", "balance") and a name; configuration
picks one by name, either as a bare string (`"spray"`) or as a TOML table whose
`name` key picks the class and whose other keys are its keyword parameters
(`{"name": "layer_magnitude", "layer_weight": 0.5}`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from dlcp.errors import LocalError

if TYPE_CHECKING:
    from dlcp.policies.balance import LoadBalancer
    from dlcp.policies.drop import DropPolicy
    from dlcp.policies.priority import PriorityPolicy
    from dlcp.policies.schedule import LossSchedule

__all__ = ["KINDS", "Kind", "create", "from_config", "names", "register"]

Kind = Literal["priority", "drop", "schedule", "balance"]
KINDS: tuple[str, ...] = ("priority", "drop", "schedule", "balance")

_T = TypeVar("_T", bound=type)
_REGISTRY: dict[str, dict[str, type]] = {kind: {} for kind in KINDS}


def _table(kind: str) -> dict[str, type]:
    try:
        return _REGISTRY[kind]
    except KeyError:
        raise LocalError(f"unknown policy kind {kind!r}; known: {', '.join(KINDS)}") from None


def register(kind: str, name: str) -> Callable[[_T], _T]:
    """Class decorator: register a policy class as `name` of `kind`.

    The class gets a `name` attribute. Registering a different class under a
    taken name is an error.
    """
    table = _table(kind)
    if not name or not isinstance(name, str):
        raise LocalError(f"{kind} policy name must be a non-empty string, got {name!r}")

    def decorate(cls: _T) -> _T:
        old = table.get(name)
        same = old is not None and (old.__module__, old.__qualname__) == (
            cls.__module__,
            cls.__qualname__,
        )
        if old is not None and not same:
            raise LocalError(f"{kind} policy {name!r} is already registered to {old.__qualname__}")
        table[name] = cls
        cls.name = name  # type: ignore[attr-defined]
        return cls

    return decorate


def names(kind: str) -> list[str]:
    """The registered names of `kind`, sorted."""
    return sorted(_table(kind))


@overload
def create(kind: Literal["priority"], name: str, **params: Any) -> PriorityPolicy: ...
@overload
def create(kind: Literal["drop"], name: str, **params: Any) -> DropPolicy: ...
@overload
def create(kind: Literal["schedule"], name: str, **params: Any) -> LossSchedule: ...
@overload
def create(kind: Literal["balance"], name: str, **params: Any) -> LoadBalancer: ...
@overload
def create(kind: str, name: str, **params: Any) -> Any: ...


def create(kind: str, name: str, **params: Any) -> Any:
    """A new policy of `kind` registered as `name`, built with `params`.

    Raises LocalError for an unknown kind or name (listing the known names),
    for parameters the policy does not take and for invalid values.
    """
    table = _table(kind)
    cls = table.get(name)
    if cls is None:
        known = ", ".join(sorted(table)) or "none"
        raise LocalError(f"unknown {kind} policy {name!r}; known: {known}")
    signature = inspect.signature(cls)
    try:
        signature.bind(**params)
    except TypeError as exc:
        accepted = [
            p.name
            for p in signature.parameters.values()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        raise LocalError(
            f"{kind} policy {name!r}: {exc}; parameters: {', '.join(accepted) or 'none'}"
        ) from None
    try:
        return cls(**params)
    except LocalError as exc:
        raise LocalError(f"{kind} policy {name!r}: {exc}") from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalError(f"{kind} policy {name!r}: bad parameter: {exc}") from None


@overload
def from_config(kind: Literal["priority"], cfg: Mapping[str, Any] | str) -> PriorityPolicy: ...
@overload
def from_config(kind: Literal["drop"], cfg: Mapping[str, Any] | str) -> DropPolicy: ...
@overload
def from_config(kind: Literal["schedule"], cfg: Mapping[str, Any] | str) -> LossSchedule: ...
@overload
def from_config(kind: Literal["balance"], cfg: Mapping[str, Any] | str) -> LoadBalancer: ...
@overload
def from_config(kind: str, cfg: Mapping[str, Any] | str) -> Any: ...


def from_config(kind: str, cfg: Mapping[str, Any] | str) -> Any:
    """A policy from configuration: a name, or a table with `name` and parameters.

    Dashes in parameter keys are read as underscores (`layer-weight`).
    """
    if isinstance(cfg, str):
        return create(kind, cfg)
    if not isinstance(cfg, Mapping):
        raise LocalError(
            f"{kind} policy config must be a name or a table, got {type(cfg).__name__}"
        )
    params = {str(k).replace("-", "_"): v for k, v in cfg.items()}
    name = params.pop("name", None)
    if not isinstance(name, str):
        raise LocalError(
            f"{kind} policy config needs a string 'name'; known: {', '.join(names(kind))}"
        )
    return create(kind, name, **params)
