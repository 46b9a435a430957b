"""The small Guard interface every lower layer calls before acting.

Layers below L5 import only this module. The permission layer installs a real guard per process
(from the module's capability token); until one is installed, a process has no rights at all
(default deny) unless the job runs in ``permission.mode: trusted``.
"""

from __future__ import annotations

from typing import Protocol

from kuangchao_core.errors import PermissionDenied


class Guard(Protocol):
    """Decides whether this process may call ``interface`` on ``resource``; raises PermissionDenied if not."""

    def check(self, interface: str, resource: str) -> None: ...


class DenyAll:
    """The guard of a process that holds no token: every operation is refused."""

    def check(self, interface: str, resource: str) -> None:
        raise PermissionDenied(interface, resource, "no capability token loaded")


class AllowAll:
    """Trusted mode: every operation is allowed (private clusters, unit tests of lower layers)."""

    def check(self, interface: str, resource: str) -> None:
        return None


_current: Guard = DenyAll()


def install_guard(guard: Guard) -> Guard:
    """Install ``guard`` for this process and return the previous one."""
    global _current
    previous, _current = _current, guard
    return previous


def current_guard() -> Guard:
    """The guard installed in this process."""
    return _current


def check(interface: str, resource: str) -> None:
    """Check ``interface`` on ``resource`` with this process's guard."""
    _current.check(interface, resource)


def current_token_id() -> str | None:
    """The token id (``jti``) behind this process's guard; None when no token backs it (``DenyAll``, ``AllowAll``)."""
    jti = getattr(getattr(_current, "claims", None), "jti", None)
    return jti if isinstance(jti, str) else None
