"""dlcp.tc: Linux traffic control for dlcp's priority classes.

A pure plan (`build_plan`) of HTB classes, u32 DSCP filters and fifo leaves,
a thin pyroute2 applier (`apply_plan`, `clear`, `read_stats`) and the
`dlcp tc apply|show|clear` commands.
"""

from dlcp.tc.apply import apply_plan, clear, is_applied, read_stats, root_qdisc
from dlcp.tc.plan import (
    DEFAULT_DSCP,
    NUM_CLASSES,
    Op,
    TcConfig,
    build_plan,
    classid,
    leaf_handle,
    parse_dscp_list,
    parse_rate,
)
from dlcp.tc.stats import ClassStats, format_table, stats_as_dict, stats_as_samples

__all__ = [
    "DEFAULT_DSCP",
    "NUM_CLASSES",
    "ClassStats",
    "Op",
    "TcConfig",
    "apply_plan",
    "build_plan",
    "classid",
    "clear",
    "format_table",
    "is_applied",
    "leaf_handle",
    "parse_dscp_list",
    "parse_rate",
    "read_stats",
    "root_qdisc",
    "stats_as_dict",
    "stats_as_samples",
]
