"""Reading job configs (SPEC L6.1, L6.2): ``extends:`` inheritance, ``--set`` overrides, validation, one error list.

Files are parsed by :mod:`kuangchao_core.config.safe_yaml` (size cap, duplicate keys, alias caps, YAML 1.2-like
scalars). Loading never touches any path a config names except ``extends`` files.
"""

from __future__ import annotations

import copy
import difflib
import re
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from kuangchao_core.config.checks import cross_checks
from kuangchao_core.config.safe_yaml import parse_yaml, read_text
from kuangchao_core.config.schema import SECTIONS, JobConfig
from kuangchao_core.errors import ConfigError

MAX_EXTENDS_DEPTH = 16

Errors = list[tuple[str, str]]


# ------------------------------------------------------------------------------------------------------- extends


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``: maps merge key by key, lists and scalars replace. Inputs are not modified."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _in_file(errors: Errors, path: Path, top: Path) -> Errors:
    if path == top:
        return errors
    return [(where, f"{msg} (in {path})") for where, msg in errors]


def _names_no_content(where: str) -> bool:
    """Whether an error path of a base file can be shown: a syntax error (PyYAML's fixed phrases) or a path inside a
    config section — never a key of a file that is not a config."""
    return where == "(file)" or where.split(".", 1)[0] in SECTIONS


def _resolved(path: Path) -> tuple[Path | None, str]:
    """``path`` with its symbolic links followed, or None and one line naming the file (a loop of links)."""
    try:
        return path.resolve(), ""
    except (RuntimeError, OSError) as exc:  # a loop: RuntimeError before Python 3.13, OSError (ELOOP) after
        return None, f"{path} cannot be resolved: a loop of symbolic links ({exc.__class__.__name__})"


#: one load's files by resolved path: (merged tree, errors, height = files on its longest ``extends`` chain)
Resolved = dict[Path, tuple[dict[str, Any], Errors, int]]


def _load_tree(path: Path, chain: list[Path], top: Path, seen: Resolved | None = None) -> tuple[dict[str, Any], Errors]:
    """The mapping of ``path`` merged over its ``extends:`` bases, and the errors. ``seen`` (one load's) makes a file
    that several routes reach (a diamond, a fan-out) read and merged once; None resolves it again on every route."""
    if seen is not None and path in seen:
        tree, errors, _ = seen[path]
        return copy.deepcopy(tree), list(errors)
    tree, errors, height = _read_tree(path, chain, top, seen)
    if seen is not None:
        seen[path] = (copy.deepcopy(tree), list(errors), height)
    return tree, errors


def _read_tree(path: Path, chain: list[Path], top: Path, seen: Resolved | None) -> tuple[dict[str, Any], Errors, int]:
    text, errors = read_text(path)
    if text is None:
        if path != top:
            return {}, [("extends", msg) for _, msg in errors], 1
        return {}, errors, 1
    data, errors = parse_yaml(text, str(path))
    if errors:
        if path != top and not all(_names_no_content(where) for where, _ in errors):
            # another file's keys are never echoed: it may not be a config at all
            msg = f"base config {path} is not a valid YAML config; check it on its own with `kc config validate`"
            return {}, [("extends", msg)], 1
        return {}, _in_file(errors, path, top), 1
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return (
            {},
            _in_file([("(root)", f"a config must be a mapping of sections, got {type(data).__name__}")], path, top),
            1,
        )
    if path != top and not set(data) <= {*SECTIONS, "extends"}:
        return (
            {},
            [
                (
                    "extends",
                    f"base config {path} is not a Kuangchao config: its top-level keys are not all sections "
                    f"({', '.join(SECTIONS)}); its content is not shown",
                )
            ],
            1,
        )

    extends = data.pop("extends", None)
    if extends is None:
        return data, [], 1
    bases = [extends] if isinstance(extends, str) else extends
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        return {}, _in_file([("extends", f"must be a file name or a list of them, got {extends!r}")], path, top), 1

    merged: dict[str, Any] = {}
    errors, height = [], 1
    for base in bases:
        base_path, why = _resolved(path.parent / base)
        if base_path is None:
            errors.append(("extends", f"base config {why} (extended from {path})"))
            continue
        shown = " -> ".join(str(p) for p in [*chain, base_path])
        if base_path in chain:
            errors.append(("extends", f"extends cycle: {shown}"))
            continue
        below = seen[base_path][2] if seen is not None and base_path in seen else 1
        if len(chain) + below > MAX_EXTENDS_DEPTH:
            errors.append(("extends", f"extends chain deeper than {MAX_EXTENDS_DEPTH} files: {shown}"))
            continue
        if not base_path.exists():
            errors.append(("extends", f"base config {base!r} not found (looked for {base_path}, extended from {path})"))
            continue
        tree, base_errors = _load_tree(base_path, [*chain, base_path], top, seen)
        errors.extend(e for e in base_errors if e not in errors)
        height = max(height, 1 + (seen[base_path][2] if seen is not None else 1))
        merged = deep_merge(merged, tree)
    return deep_merge(merged, data), errors, height


# ------------------------------------------------------------------------------------------------------ schema walk


def _unwrap(tp: Any) -> list[Any]:
    """The concrete alternatives of an annotation (Annotated and Optional peeled)."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        out: list[Any] = []
        for arg in typing.get_args(tp):
            if arg is not type(None):
                out.extend(_unwrap(arg))
        return out
    return [tp]


def _child(tp: Any, part: str) -> tuple[Any | None, list[str]]:
    """Descend one dotted-path step in the schema; returns (type, keys allowed here)."""
    allowed: list[str] = []
    for alt in _unwrap(tp):
        if isinstance(alt, type) and issubclass(alt, BaseModel):
            by_key = {f.alias or name: f for name, f in alt.model_fields.items()}  # YAML keys (``async``)
            allowed.extend(by_key)
            if part in by_key:
                return by_key[part].annotation, allowed
        origin = typing.get_origin(alt)
        if origin is dict:
            return typing.get_args(alt)[1], allowed
        if origin in (list, tuple) and part.isdigit():
            args = typing.get_args(alt)
            return (args[int(part)] if origin is tuple and int(part) < len(args) else args[0]), allowed
    return None, allowed


def _hint(name: str, allowed: Iterable[str]) -> str:
    allowed = list(dict.fromkeys(allowed))
    close = difflib.get_close_matches(name, allowed, n=1)
    if close:
        return f"did you mean {close[0]!r}?"
    return f"allowed: {', '.join(allowed)}" if allowed else "this value has no sub-keys"


def _schema_path_error(parts: list[str]) -> str | None:
    tp: Any = JobConfig
    for index, part in enumerate(parts):
        nxt, allowed = _child(tp, part)
        if nxt is None:
            where = ".".join(parts[:index]) or "the top level"
            return f"no setting {part!r} under {where}; {_hint(part, allowed)}"
        tp = nxt
    return None


# ------------------------------------------------------------------------------------------------------ overrides


_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*(?:\.(?:[A-Za-z0-9_-]+))*$")


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> tuple[dict[str, Any], Errors]:
    """Apply ``a.b=c`` settings; values are typed as YAML scalars (``3`` int, ``2e-5`` float, ``[a, b]`` list)."""
    data = copy.deepcopy(data)
    errors: Errors = []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not _KEY.match(key):
            errors.append(("--set", f"expected KEY=VALUE with a dotted key such as optimizer.lr=1e-4, got {item!r}"))
            continue
        parts = key.split(".")
        problem = _schema_path_error(parts)
        if problem:
            errors.append((key, f"unknown setting in --set {item!r}: {problem}"))
            continue
        value, value_errors = parse_yaml(text, f"--set {key}")
        if value_errors:
            errors.append((key, f"cannot read the value in --set {item!r}: {value_errors[0][1]}"))
            continue
        node: Any = data
        for depth, part in enumerate(parts[:-1]):
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
                continue
            if isinstance(node, dict):
                if not isinstance(node.get(part), dict | list):
                    node[part] = {}
                node = node[part]
                continue
            errors.append((key, f"cannot set inside {'.'.join(parts[: depth + 1])}: it is not a mapping"))
            break
        else:
            last = parts[-1]
            if isinstance(node, list):
                if not (last.isdigit() and int(last) < len(node)):
                    errors.append((key, f"index {last} is outside the list of {len(node)} items"))
                    continue
                node[int(last)] = value
            else:
                node[last] = value
    return data, errors


# ----------------------------------------------------------------------------------------------------- validation


_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def _convert(exc: ValidationError, prefix: str, model: type[BaseModel]) -> Errors:
    out: Errors = []
    for err in exc.errors(include_url=False):
        loc = [part for part in (prefix, *(str(p) for p in err["loc"])) if part]
        path = ".".join(loc)
        kind = err["type"]
        msg = err["msg"]
        for tag in _PYDANTIC_PREFIXES:
            if msg.startswith(tag):
                msg = msg[len(tag) :]
        if kind == "extra_forbidden":
            tp: Any = JobConfig
            allowed: list[str] = []
            for part in loc[:-1]:
                tp, _ = _child(tp, part)
            if tp is not None:
                _, allowed = _child(tp, "\0")
            msg = f"unknown key; {_hint(loc[-1], allowed)}"
        elif kind == "missing":
            msg = "required, but not set"
        elif "input" in err and not isinstance(err["input"], dict | list):
            shown = repr(err["input"])
            msg = f"{msg} (got {shown if len(shown) <= 60 else shown[:57] + '...'})"
        out.append((path, msg))
    return out


def config_from_dict(data: Any, source: str | None = None) -> JobConfig:
    """Validate a plain mapping (already merged and overridden) into a ``JobConfig``; raise ``ConfigError`` with every error."""
    if not isinstance(data, dict):
        raise ConfigError([("(root)", f"a config must be a mapping of sections, got {type(data).__name__}")], source)
    errors: Errors = []
    for key in data:
        if key not in SECTIONS:
            hint = "it is only read in files" if key == "extends" else _hint(str(key), SECTIONS)
            errors.append((str(key), f"unknown section; {hint}"))
    sections: dict[str, Any] = {}
    for name, model in SECTIONS.items():
        raw = data.get(name)
        if raw is None:
            raw = {}
        try:
            sections[name] = model.model_validate(raw)
        except ValidationError as exc:
            errors.extend(_convert(exc, name, model))
    errors.extend(cross_checks(sections))
    if errors:
        raise ConfigError(errors, source)
    try:
        return JobConfig.model_validate(sections)
    except ConfigError as exc:
        raise ConfigError(exc.errors, source) from None
    except ValidationError as exc:  # not expected once every section validated
        raise ConfigError(_convert(exc, "", JobConfig), source) from None


def load_config(
    path: str | Path,
    overrides: Sequence[str] = (),
    resolve: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> JobConfig:
    """Read ``path`` (resolving ``extends:``), apply ``--set`` ``overrides``, validate; raise ``ConfigError`` listing every error.

    ``resolve`` may rewrite the merged mapping before validation (the flow replaces Prefect block references there).
    """
    source = str(path)
    top, why = _resolved(Path(path))
    if top is None:
        raise ConfigError([("(file)", why)], source)
    if not top.exists():
        raise ConfigError([("(file)", f"file not found: {top}")], source)
    data, errors = _load_tree(top, [top], top, {})
    if errors:
        raise ConfigError(errors, source)
    data, errors = apply_overrides(data, overrides)
    try:
        if resolve is not None:
            data = resolve(data)
        cfg = config_from_dict(data, source)
    except ConfigError as exc:
        raise ConfigError([*errors, *exc.errors], source) from None
    if errors:
        raise ConfigError(errors, source)
    return cfg
