"""The groups this process has constructed, by name (SPEC L2.2).

``CommGroup`` registers itself here; the timeout diagnosis (``comm.diag``), the state dump (``comm.state``) and
``kc debug comm`` read it. A name stands for one set of ranks: tokens grant ``group:<name>``, so a second group
with the same name and other ranks is refused.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kuangchao_core.errors import CommError

if TYPE_CHECKING:
    from kuangchao_core.comm.group import CommGroup

_lock = threading.Lock()
_groups: list[CommGroup] = []  # construction order


def register(group: CommGroup) -> None:
    """Record ``group``; raises CommError if its name already names a group of other ranks."""
    with _lock:
        for known in _groups:
            if known.name == group.name and known.ranks != group.ranks:
                raise CommError(
                    f"a communication group named {group.name!r} already exists with ranks {known.ranks}; "
                    f"give the group over {group.ranks} another name"
                )
        _groups.append(group)


def all_groups() -> list[CommGroup]:
    """Every group this process constructed, in construction order (the world group first if used)."""
    with _lock:
        return list(_groups)


def group_named(name: str) -> CommGroup | None:
    """The first group constructed with ``name``, or None."""
    with _lock:
        return next((g for g in _groups if g.name == name), None)


def count() -> int:
    """How many groups this process has constructed."""
    with _lock:
        return len(_groups)


def clear() -> None:
    """Forget every group (for a process that re-initialises torch.distributed)."""
    with _lock:
        _groups.clear()
