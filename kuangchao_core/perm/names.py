"""Canonical resource names (docs/architecture.md) and their validation; the interface names are
:data:`kuangchao_core.guard_api.INTERFACE_KINDS` (the one registry, re-exported here).

Resource names are exact strings: no globs, no case folding, no whitespace, no path segments. A request spelled
any other way (``CUDA:0``, ``group:dp-1/../dp-2``, `` 0``) simply is not in the granted set and is denied.
"""

from __future__ import annotations

import re

from kuangchao_core.guard_api import INTERFACE_KINDS, INTERFACES

__all__ = [
    "CLAIM_KINDS",
    "COLLECTIVES",
    "INTERFACES",
    "INTERFACE_KINDS",
    "KINDS",
    "OBJECT_KINDS",
    "is_canonical_resource",
    "is_canonical_value",
    "resource",
]

KINDS = frozenset(INTERFACE_KINDS.values())
COLLECTIVES = frozenset(i for i, k in INTERFACE_KINDS.items() if k == "group")

_DEVICE = re.compile(r"(cpu|cuda:(0|[1-9][0-9]{0,3}))\Z")
_REGION = re.compile(r"[a-z][a-z0-9_]{0,63}\Z")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}\Z")
# group names may spell their member ranks, as the comm layer's defaults do: ``g3[0,2]``
_GROUP = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:,\[\]-]{0,255}\Z")
# dataset names are the configured path (``data/train.jsonl``): plain segments, no ``.``/``..``, no ``//``
_PATH = re.compile(r"/?[A-Za-z0-9_.:-]+(/[A-Za-z0-9_.:-]+){0,31}\Z")

# token claim field -> resource kind
CLAIM_KINDS = {"devices": "device", "regions": "memory", "groups": "group"}
OBJECT_KINDS = frozenset({"checkpoint", "dataset", "metrics", "config"})


def is_canonical_value(kind: str, value: str) -> bool:
    """Whether ``value`` is the canonical spelling of a ``kind`` resource name (without the ``kind:`` prefix)."""
    if not isinstance(value, str):
        return False
    if kind == "device":
        return _DEVICE.match(value) is not None
    if kind == "memory":
        return _REGION.match(value) is not None
    if kind == "group":
        return _GROUP.match(value) is not None and ".." not in value
    if kind == "dataset":
        return _PATH.match(value) is not None and not any(seg in (".", "..") for seg in value.split("/"))
    if kind in OBJECT_KINDS:
        return _NAME.match(value) is not None and ".." not in value
    return False


def is_canonical_resource(resource: str) -> bool:
    """Whether ``resource`` (``kind:value``) is canonical."""
    kind, sep, value = resource.partition(":") if isinstance(resource, str) else ("", "", "")
    return bool(sep) and kind in KINDS and is_canonical_value(kind, value)


def resource(kind: str, value: str) -> str:
    """Build the canonical resource name ``kind:value``; ValueError if ``value`` is not canonical."""
    if not is_canonical_value(kind, value):
        raise ValueError(f"{value!r} is not a canonical {kind} name (see docs/architecture.md resource names)")
    return f"{kind}:{value}"
