"""One way to read a setting from a job config, a section of it, or the plain dict of either.

Lower layers take a section (``cfg.parallel``) or a whole config that may arrive as a validated object or as
the dict a worker read from JSON; :func:`setting` reads both the same way.
"""

from __future__ import annotations

from typing import Any


def setting(obj: Any, dotted: str, default: Any = None) -> Any:
    """The value at ``dotted`` (``"train.device"``, or ``"seq_len"`` inside a section) of ``obj``.

    ``obj`` may be a pydantic model, any object with attributes, a dict, or None; ``default`` comes back where a
    part of the path is missing or the value is None.
    """
    for part in dotted.split("."):
        if obj is None:
            return default
        obj = obj.get(part) if isinstance(obj, dict) else getattr(obj, part, None)
    return default if obj is None else obj
