"""Reading job configs (SPEC L6.1, L6.2): safe YAML, ``extends:`` inheritance, ``--set`` overrides, one error list.

Safety: files over 1 MiB are refused before parsing, duplicate keys are errors, aliases are capped in number and in
how far they expand (no "billion laughs"), YAML 1.1 surprises are switched off (``no``/``on`` stay strings,
dates stay strings, ``2e-5`` is a float). Loading never touches any path a config names except ``extends`` files.
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

import yaml
from pydantic import BaseModel, ValidationError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from kuangchao_core.config.checks import cross_checks
from kuangchao_core.config.schema import SECTIONS, JobConfig
from kuangchao_core.errors import ConfigError

MAX_FILE_BYTES = 1024 * 1024
MAX_ALIASES = 100
MAX_EXPANDED_NODES = 100_000
MAX_EXTENDS_DEPTH = 16

Errors = list[tuple[str, str]]

_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_TIMESTAMP = "tag:yaml.org,2002:timestamp"
_MERGE = "tag:yaml.org,2002:merge"


class ConfigYamlLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2-like scalars: true/false only, decimal ints, ``1e-3`` floats, no timestamps."""


ConfigYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL, _INT, _FLOAT, _TIMESTAMP)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigYamlLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
ConfigYamlLoader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+)$"), list("-+0123456789")
)
ConfigYamlLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[eE][-+]?[0-9]+)
            |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


# ----------------------------------------------------------------------------------------------------------- YAML


def _dotted(parts: Sequence[object]) -> str:
    return ".".join(str(p) for p in parts) or "(root)"


def _inspect(root: Node) -> Errors:
    """Duplicate keys, non-string keys, alias count and alias expansion of a composed YAML document."""
    errors: Errors = []
    seen: set[int] = set()
    aliases = 0

    def visit(node: Node, path: list[object]) -> None:
        nonlocal aliases
        if id(node) in seen:
            aliases += 1
            if aliases == MAX_ALIASES + 1:
                errors.append(
                    (_dotted(path), f"more than {MAX_ALIASES} alias references (line {node.start_mark.line + 1})")
                )
            return
        seen.add(id(node))
        if isinstance(node, MappingNode):
            first_line: dict[str, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE:
                    visit(value_node, path)
                    continue
                if not isinstance(key_node, ScalarNode) or key_node.tag not in ("tag:yaml.org,2002:str",):
                    errors.append(
                        (
                            _dotted(path),
                            f"keys must be plain strings, got {_describe_key(key_node)} "
                            f"at line {key_node.start_mark.line + 1}",
                        )
                    )
                    continue
                name = key_node.value
                line = key_node.start_mark.line + 1
                if name in first_line:
                    errors.append(
                        (_dotted([*path, name]), f"duplicate key at line {line} (first set at line {first_line[name]})")
                    )
                else:
                    first_line[name] = line
                visit(value_node, [*path, name])
        elif isinstance(node, SequenceNode):
            for index, item in enumerate(node.value):
                visit(item, [*path, index])

    visit(root, [])
    if any("alias" in msg for _, msg in errors):
        return errors

    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise _Recursive(node)
        active.add(key)
        total = 1
        if isinstance(node, MappingNode):
            for key_node, value_node in node.value:
                total += size(key_node) + size(value_node)
                if total > MAX_EXPANDED_NODES:
                    break
        elif isinstance(node, SequenceNode):
            for item in node.value:
                total += size(item)
                if total > MAX_EXPANDED_NODES:
                    break
        active.discard(key)
        sizes[key] = total
        return total

    try:
        if size(root) > MAX_EXPANDED_NODES:
            # walk down to the smallest value that alone is too big, to name where the expansion happens
            node, path = root, []
            while True:
                children: list[tuple[object, Node]] = []
                if isinstance(node, MappingNode):
                    children = [(k.value, v) for k, v in node.value]
                elif isinstance(node, SequenceNode):
                    children = list(enumerate(node.value))
                big = [(name, child) for name, child in children if size(child) > MAX_EXPANDED_NODES]
                if not big:
                    break
                name, node = big[0]
                if name != "<<":
                    path.append(name)
            errors.append(
                (
                    _dotted(path),
                    f"aliases expand this value (line {node.start_mark.line + 1}) past {MAX_EXPANDED_NODES} nodes; "
                    "write the values out instead",
                )
            )
    except _Recursive as exc:
        errors.append(("(file)", f"recursive alias at line {exc.node.start_mark.line + 1}"))
    return errors


class _Recursive(Exception):
    def __init__(self, node: Node):
        super().__init__("recursive alias")
        self.node = node


def _describe_key(node: Node) -> str:
    if isinstance(node, ScalarNode):
        return f"{node.value!r} ({node.tag.rsplit(':', 1)[-1]})"
    return type(node).__name__.replace("Node", "").lower()


def parse_yaml(text: str, name: str = "<string>") -> tuple[Any, Errors]:
    """Parse one YAML document safely; return ``(data, errors)`` (data is None when there are errors)."""
    loader = ConfigYamlLoader(text)
    loader.name = name
    try:
        node = loader.get_single_node()
        if node is None:
            return None, []
        errors = _inspect(node)
        if errors:
            return None, errors
        return loader.construct_document(node), []
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        return None, [("(file)", f"YAML syntax error{where}: {problem}")]
    except yaml.YAMLError as exc:
        return None, [("(file)", f"YAML error: {exc}")]
    except RecursionError:
        return None, [("(file)", "YAML nested too deeply")]
    finally:
        loader.dispose()


def _read_text(path: Path) -> tuple[str | None, Errors]:
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None, [("(file)", f"file not found: {path}")]
    except IsADirectoryError:
        return None, [("(file)", f"{path} is a directory, not a YAML file")]
    except OSError as exc:
        return None, [("(file)", f"cannot read {path}: {exc.strerror or exc}")]
    if len(raw) > MAX_FILE_BYTES:
        return None, [("(file)", f"file is larger than the {MAX_FILE_BYTES}-byte limit for configs")]
    try:
        return raw.decode("utf-8"), []
    except UnicodeDecodeError as exc:
        return None, [("(file)", f"not UTF-8 text (byte {exc.start})")]


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


def _load_tree(path: Path, chain: list[Path], top: Path) -> tuple[dict[str, Any], Errors]:
    text, errors = _read_text(path)
    if text is None:
        return {}, _in_file(errors, path, top)
    data, errors = parse_yaml(text, str(path))
    if errors:
        return {}, _in_file(errors, path, top)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return {}, _in_file(
            [("(root)", f"a config must be a mapping of sections, got {type(data).__name__}")], path, top
        )

    extends = data.pop("extends", None)
    if extends is None:
        return data, []
    bases = [extends] if isinstance(extends, str) else extends
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        return {}, _in_file([("extends", f"must be a file name or a list of them, got {extends!r}")], path, top)

    merged: dict[str, Any] = {}
    errors = []
    for base in bases:
        base_path = (path.parent / base).resolve()
        shown = " -> ".join(str(p) for p in [*chain, base_path])
        if base_path in chain:
            errors.append(("extends", f"extends cycle: {shown}"))
            continue
        if len(chain) >= MAX_EXTENDS_DEPTH:
            errors.append(("extends", f"extends chain deeper than {MAX_EXTENDS_DEPTH} files: {shown}"))
            continue
        if not base_path.exists():
            errors.append(("extends", f"base config {base!r} not found (looked for {base_path}, extended from {path})"))
            continue
        tree, base_errors = _load_tree(base_path, [*chain, base_path], top)
        errors.extend(base_errors)
        merged = deep_merge(merged, tree)
    return deep_merge(merged, data), errors


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
            fields = list(alt.model_fields)
            allowed.extend(fields)
            if part in alt.model_fields:
                return alt.model_fields[part].annotation, allowed
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
    top = Path(path).resolve()
    if not top.exists():
        raise ConfigError([("(file)", f"file not found: {top}")], source)
    data, errors = _load_tree(top, [top], top)
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
