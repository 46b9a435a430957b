"""The schema's own words for ``docs/config.md`` (``docs/gen_config_md.py``): a field's comment, its type's short
name, its bounds, its default and a value as inline YAML."""

from __future__ import annotations

import ast
import inspect
import json
import re
import types
import typing
from typing import Any

from pydantic import BaseModel


def field_comments(cls: type) -> dict[str, str]:
    """field name -> the ``#:`` comment lines above it or the trailing ``#`` comment of its line."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    tree = ast.parse(inspect.cleandoc("".join(lines)) if lines[0].startswith(" ") else "".join(lines))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for node in body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        idx = node.lineno - 1
        above: list[str] = []
        j = idx - 1
        while j >= 0 and lines[j].strip().startswith("#:"):
            above.insert(0, lines[j].strip()[2:].strip())
            j -= 1
        text = " ".join(above)
        if not text:
            trailing = re.search(r"#\s*(?!noqa)(.+)$", lines[idx])
            if trailing and "Field(" not in trailing.group(1):
                text = trailing.group(1).strip()
        if text:
            out[node.target.id] = text
    return out


def type_name(tp: Any) -> str:
    """A short, readable name of an annotation (``int``, ``"a" | "b"``, ``list[str]``, ``section``)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(parts) + (" \\| null" if type(None) in args else "")
    if origin in (list, tuple, dict):
        inner = ", ".join(type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "section"
    return getattr(tp, "__name__", str(tp))


def field_bounds(info: Any) -> str:
    """``≥ 1``, ``> 0, ≤ 1``, ``length ≤ 64``, ``pattern …`` from the field's constraints."""
    words = []
    for m in info.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            value = getattr(m, attr, None)
            if value is not None:
                words.append(f"{sign} {value:g}" if isinstance(value, float) else f"{sign} {value}")
        if getattr(m, "min_length", None) is not None:
            words.append(f"length ≥ {m.min_length}")
        if getattr(m, "max_length", None) is not None:
            words.append(f"length ≤ {m.max_length}")
        if getattr(m, "pattern", None) is not None:
            words.append(f"pattern `{m.pattern}`")
    return ", ".join(words)


def field_default(info: Any) -> Any:
    if info.default_factory is not None:
        return info.default_factory()
    return info.default  # PydanticUndefined for a required field


def to_plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True)
    if isinstance(value, tuple):
        return list(value)
    return value


def yaml_inline(value: Any) -> str:
    value = to_plain(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        plain = re.fullmatch(r"[A-Za-z0-9_./:*@-]+", value) and value not in ("null", "true")
        return value if plain else json.dumps(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(yaml_inline(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_inline(v)}" for k, v in value.items()) + "}"
    return str(value)
