"""Kuangchao core engine: the six layers (hal, comm, parallel, sched, perm, config/UI support)."""

__version__ = "0.1.0"
