"""The guard interface under its former name, for callers above the engine (CLI, SDK, flows, tasks, tests).

The interface lives in :mod:`kuangchao_core.guard_api`, beside ``errors``; inside ``kuangchao_core`` import it from
there (``tests/test_import_rules.py`` refuses an import of ``perm`` from a lower layer). The names below are the same
objects, so a guard installed through either name is the one every check sees.
"""

from __future__ import annotations

from kuangchao_core.guard_api import (
    INTERFACE_KINDS,
    INTERFACES,
    AllowAll,
    DenyAll,
    Guard,
    check,
    check_as,
    current_guard,
    current_token_id,
    guard_for,
    install_guard,
    install_module_guard,
    thread_guard,
)

__all__ = [
    "INTERFACES",
    "INTERFACE_KINDS",
    "AllowAll",
    "DenyAll",
    "Guard",
    "check",
    "check_as",
    "current_guard",
    "current_token_id",
    "guard_for",
    "install_guard",
    "install_module_guard",
    "thread_guard",
]
