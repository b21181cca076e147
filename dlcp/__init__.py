"""dlcp: a gradient-aware transport for data-parallel training."""

__version__ = "0.1.0"
