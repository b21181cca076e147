"""Pluggable policies, registered by kind and name and chosen in configuration.

Kinds: "priority" (packet -> class -> DSCP), "drop" (which packets may be
lost), "schedule" (the loss bound per round), "balance" (path per packet).
Importing this package registers the built-in policies.
"""

from dlcp.policies.balance import (
    AdaptiveBalancer,
    FlowBalancer,
    LoadBalancer,
    PathState,
    SprayBalancer,
    WeightedBalancer,
)
from dlcp.policies.drop import DropPolicy, NoDrop, SmallestNormDrop, deadline_drops, lane_budget
from dlcp.policies.priority import (
    BEST_EFFORT_CLASS,
    CONTROL_CLASS,
    DEFAULT_DSCP,
    DROPPABLE_CLASS,
    GRADIENT_CLASSES,
    N_CLASSES,
    FlowPriority,
    LayerMagnitudePriority,
    PriorityPolicy,
    apply_droppable,
    check_dscp_table,
)
from dlcp.policies.registry import KINDS, create, from_config, names, register
from dlcp.policies.schedule import (
    MAX_BOUND,
    ConstantSchedule,
    DiminishingSchedule,
    LossSchedule,
    PhaseSchedule,
)

__all__ = [
    "BEST_EFFORT_CLASS",
    "CONTROL_CLASS",
    "DEFAULT_DSCP",
    "DROPPABLE_CLASS",
    "GRADIENT_CLASSES",
    "KINDS",
    "MAX_BOUND",
    "N_CLASSES",
    "AdaptiveBalancer",
    "ConstantSchedule",
    "DiminishingSchedule",
    "DropPolicy",
    "FlowBalancer",
    "FlowPriority",
    "LayerMagnitudePriority",
    "LoadBalancer",
    "LossSchedule",
    "NoDrop",
    "PathState",
    "PhaseSchedule",
    "PriorityPolicy",
    "SmallestNormDrop",
    "SprayBalancer",
    "WeightedBalancer",
    "apply_droppable",
    "check_dscp_table",
    "create",
    "deadline_drops",
    "from_config",
    "lane_budget",
    "names",
    "register",
]
