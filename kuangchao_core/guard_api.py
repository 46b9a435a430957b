"""The ground floor of the permission check: the Guard interface every layer calls before acting, and the one
registry of interface names.

A leaf beside :mod:`kuangchao_core.errors` (it imports nothing else of Kuangchao), so every layer may import it and
no layer reaches up into the permission package (L5) to ask permission. The permission layer
(:mod:`kuangchao_core.perm`) installs a real guard per process (from the module's capability token); until one is
installed, a process has no rights at all (default deny) unless the job runs in ``permission.mode: trusted``.
The config schema (``permission.roles``, ``permission.allowed_interfaces``) and the permission layer (tokens, roles,
the guard) read :data:`INTERFACE_KINDS`; nothing else spells the list.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from kuangchao_core.errors import PermissionDenied

#: every interface the guard decides on (docs/architecture.md) -> the kind of resource it acts on
INTERFACE_KINDS: dict[str, str] = {
    "device_init": "device",
    "stream_create": "device",
    "memory_alloc": "memory",
    "memory_free": "memory",
    "broadcast": "group",
    "all_reduce": "group",
    "all_gather": "group",
    "reduce_scatter": "group",
    "all_to_all": "group",
    "send": "group",
    "recv": "group",
    "checkpoint_read": "checkpoint",
    "checkpoint_write": "checkpoint",
    "dataset_read": "dataset",
    "metrics_read": "metrics",
    "metrics_write": "metrics",
    "config_write": "config",
}
#: the interface names alone
INTERFACES: frozenset[str] = frozenset(INTERFACE_KINDS)


class Guard(Protocol):
    """Decides whether this process may call ``interface`` on ``resource``; raises PermissionDenied if not."""

    def check(self, interface: str, resource: str) -> None: ...


class DenyAll:
    """The guard of a process that holds no token: every operation is refused."""

    def check(self, interface: str, resource: str) -> None:
        raise PermissionDenied(
            interface,
            resource,
            "no capability token loaded: start the script with `kc launch` (or the job with `kc train`), which "
            "issues each rank its token, or call kc.init(trusted=True) on a private cluster",
        )


class AllowAll:
    """Trusted mode: every operation is allowed (private clusters, unit tests of lower layers)."""

    def check(self, interface: str, resource: str) -> None:
        return None


_current: Guard = DenyAll()
_thread = threading.local()  # a module that runs in its own thread (the data loader) has its own guard
_modules: dict[str, Guard] = {}  # the guards of the process's other modules, by kind ("data_loader")


def install_guard(guard: Guard) -> Guard:
    """Install ``guard`` for this process and return the previous one."""
    global _current
    previous, _current = _current, guard
    return previous


@contextmanager
def thread_guard(guard: Guard) -> Iterator[Guard]:
    """Within the block, this thread's checks go to ``guard`` instead of the process's (other threads unchanged)."""
    previous = getattr(_thread, "guard", None)
    _thread.guard = guard
    try:
        yield guard
    finally:
        _thread.guard = previous


def current_guard() -> Guard:
    """The guard this thread's checks go to: its own (:func:`thread_guard`) or the process's."""
    return getattr(_thread, "guard", None) or _current


def check(interface: str, resource: str) -> None:
    """Check ``interface`` on ``resource`` with this thread's guard."""
    current_guard().check(interface, resource)


def install_module_guard(kind: str, guard: Guard | None) -> None:
    """Register the guard of this process's ``kind`` module (``data_loader``); None removes it."""
    if guard is None:
        _modules.pop(kind, None)
    else:
        _modules[kind] = guard


def guard_for(kind: str) -> Guard:
    """The guard of this process's ``kind`` module when one is registered, else this thread's guard."""
    return _modules.get(kind) or current_guard()


def check_as(kind: str, interface: str, resource: str) -> None:
    """Check ``interface`` on ``resource`` as the process's ``kind`` module (see :func:`guard_for`)."""
    guard_for(kind).check(interface, resource)


def current_token_id() -> str | None:
    """The token id (``jti``) behind this thread's guard; None when no token backs it (``DenyAll``, ``AllowAll``)."""
    jti = getattr(getattr(current_guard(), "claims", None), "jti", None)
    return jti if isinstance(jti, str) else None
