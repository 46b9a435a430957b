"""Safe YAML for job configs (SPEC L6.1): what a hostile or mistyped file cannot do.

Files over 1 MiB are refused before parsing, duplicate keys are errors, aliases are capped in number and in how far
they expand (no "billion laughs"), YAML 1.1 surprises are switched off (``no``/``on`` stay strings, dates stay
strings, ``2e-5`` is a float). Errors come back as ``(dotted path, message)`` pairs, never as exceptions.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

MAX_FILE_BYTES = 1024 * 1024
MAX_ALIASES = 100
MAX_EXPANDED_NODES = 100_000

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
    try:
        loader = ConfigYamlLoader(text)  # the reader refuses NUL and control characters right here
    except yaml.YAMLError as exc:
        return None, [("(file)", f"not a YAML text: {getattr(exc, 'reason', None) or exc}")]
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


def read_text(path: Path) -> tuple[str | None, Errors]:
    """The UTF-8 text of a config file of at most ``MAX_FILE_BYTES``, or the error that stops it.

    Only regular files are read: a FIFO, a device or a socket named as a config would block or never end."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None, [("(file)", f"file not found: {path}")]
    except OSError as exc:
        return None, [("(file)", f"cannot read {path}: {exc.strerror or exc}")]
    if stat.S_ISDIR(mode):
        return None, [("(file)", f"{path} is a directory, not a YAML file")]
    if not stat.S_ISREG(mode):
        return None, [("(file)", f"{path} is not a regular file (a pipe, device or socket); give a YAML file")]
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
