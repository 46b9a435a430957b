"""Generate ``docs/config.md``, the job config reference, from the schema (``kuangchao_core/config/schema.py``).

    python docs/gen_config_md.py            # rewrite docs/config.md
    python docs/gen_config_md.py --check    # exit 1 when docs/config.md is not what the schema gives

Every field of every section gets its type (with its bounds), its default, what it means (its description or the
``#:`` / trailing comment beside it), an example the schema accepts, and what reads it: the source files outside the
schema where the field is read. Readers are found by searching the code: an attribute read through the section
(``cfg.parallel.zero_stage``), through a local name bound to the section (``par = cfg.parallel`` …
``par.zero_stage``; loop variables over lists or maps of sections too), or by name (``getattr(cfg.checkpoint,
"async_")``, ``setting(par, "hierarchical_allreduce")``); tests/test_config_doc.py compares it with the page."""

from __future__ import annotations

import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pydantic import BaseModel  # noqa: E402
from pydantic_core import PydanticUndefined  # noqa: E402

from docs.config_md_words import field_bounds, field_comments, field_default, to_plain, type_name, yaml_inline  # noqa: E402
from kuangchao_core import axes as mesh_axes  # noqa: E402
from kuangchao_core.config import schema  # noqa: E402
from kuangchao_core.config.schema import JobConfig, Section  # noqa: E402
from kuangchao_core.config.section import AxesSection  # noqa: E402

OUT = ROOT / "docs" / "config.md"
SCHEMA_FILES = tuple(
    f"kuangchao_core/config/{n}.py" for n in ("schema", "cluster_schema", "section", "vision_schema", "train_schema")
)
#: where readers are looked for (the tests are not readers)
SOURCE_DIRS = ("kuangchao_core", "kuangchao", "flows", "tasks", "blocks", "deployments", "benchmarks")


# ---------------------------------------------------------------------------------------------- examples
def _candidates(tp: Any, default: Any) -> list[Any]:
    """Values to show, most telling first: another choice than the default, then the default, then by type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return _candidates(args[0], default)
    if origin in (typing.Union, types.UnionType):
        out = []
        for a in args:
            if a is not type(None):
                out += _candidates(a, default)
        return out
    if origin is typing.Literal:
        return [a for a in args if a != default] + list(args)
    if origin is list:
        inner = _candidates(args[0], None) if args else ["x"]
        return [inner[:2], inner[:1], inner[-1:]] if inner else [[]]
    if origin is tuple:
        return [list(default)] if default not in (None, PydanticUndefined) else [[0.9, 0.95]]
    if origin is dict:
        return [{}]
    if tp is bool:
        return [not default] if isinstance(default, bool) else [True]
    out = [] if default in (None, PydanticUndefined) else [default]
    if tp is int:
        return out + [1, 2, 100]
    if tp is float:
        return out + [0.5, 1.0, 1e-3, 10.0]
    if tp is str:
        return out + ["my-job", "checkpoints/run", "sqlite:///mlflow.db", "http://127.0.0.1:8080", "NCCL_DEBUG"]
    return out + ([{}] if isinstance(tp, type) and issubclass(tp, BaseModel) else [])  # a section: its defaults


#: examples the schema cannot find on its own (values whose shape a bare type does not tell)
EXAMPLES: dict[str, Any] = {
    "permission.operators": ["alice:" + "A" * 43],
    "permission.roles": {"trainer": ["all_reduce", "send", "recv"]},
    "permission.allowed_interfaces": ["broadcast", "all_reduce", "send", "recv"],
    "cluster.nodes": [{"host": "10.0.1.1", "gpus": 8}],
    "train.anomaly.actions": {"grad_norm": "stop"},
    "model.lora": {"rank": 8},
    "model.checkpoint": "/data/checkpoints/llama3-8b",
    "checkpoint.resume": "never",
    "data.path": "data/corpus.jsonl",
    "data.eval_path": "data/heldout.jsonl",
    "cluster.slurm": {"partition": "gpu", "time_limit": "01:00:00"},
    "cluster.slurm.time_limit": "01:00:00",
    "cluster.slurm.extra_sbatch_args": ["--mem=64G"],
}


_NODE = {"host": "10.0.1.1", "gpus": 1}
_STATIC = {"cluster": {"mode": "static", "nodes": [_NODE]}}
_COORDINATOR = {**_NODE, "host": "10.0.1.2", "role": "coordinator"}
#: whole fragments for fields in a list or map of sections (the path does not say where), or needing another field
FRAGMENTS: dict[str, dict[str, Any]] = {
    "permission.roles.interfaces": {"permission": {"roles": {"trainer": {"interfaces": ["all_reduce", "send"]}}}},
    "permission.roles.resources": {
        "permission": {"roles": {"monitor": {"interfaces": ["metrics_read"], "resources": ["metrics*"]}}}
    },
    "cluster.nodes": _STATIC,
    "cluster.nodes.host": _STATIC,
    "cluster.nodes.gpus": _STATIC,
    "cluster.nodes.role": {"cluster": {"mode": "static", "nodes": [_NODE, _COORDINATOR]}},
    "parallel.sequence_parallel": {"parallel": {"tensor_parallel_size": 2, "sequence_parallel": True}},
    "cluster.slurm.switches_wait": {"cluster": {"mode": "slurm", "slurm": {"switches": 1, "switches_wait": "10:00"}}},
    "cluster.slurm.export_env_allow_secrets": {
        "cluster": {"mode": "slurm", "slurm": {"export_env": ["HF_TOKEN"], "export_env_allow_secrets": ["HF_TOKEN"]}}
    },
    "checkpoint.uri": {"checkpoint": {"uri": "s3://bucket/kuangchao", "endpoint_url": "http://127.0.0.1:9000"}},
}


def _nest(path: str, value: Any) -> dict[str, Any]:
    out: Any = value
    for key in reversed(path.split(".")):
        out = {key: out}
    return out


def _accepted(path: str, value: Any, data: dict[str, Any] | None = None) -> bool:
    """Whether a job of only a name plus ``path: value`` (nested into its sections; or ``data``) passes the schema."""
    import copy

    from kuangchao_core.config import config_from_dict

    data = copy.deepcopy(data) if data is not None else _nest(path, to_plain(value))
    data.setdefault("task", {}).setdefault("name", "example")
    if path.startswith("cluster.") and path != "cluster.mode":  # in the mode that uses the field
        mode = data["cluster"].setdefault("mode", "slurm" if path.startswith("cluster.slurm") else "static")
        if mode == "static":
            data["cluster"].setdefault("nodes", [{"host": "10.0.1.1", "gpus": 1}])
    try:
        config_from_dict(data)
    except Exception:
        return False
    return True


def _example(path: str, tp: Any, default: Any) -> str:
    from kuangchao_core.config.presets import MODEL_PRESETS

    if path in FRAGMENTS:
        return yaml_inline(FRAGMENTS[path]) if _accepted(path, None, FRAGMENTS[path]) else "—"
    tries = [EXAMPLES[path]] if path in EXAMPLES else []
    section, _, field = path.partition(".")
    if section == "model":  # a shape field alone must fit the preset's other fields: the small preset's value
        tries += [MODEL_PRESETS[name][field] for name in ("small", "tiny") if field in MODEL_PRESETS[name]]
    tries += _candidates(tp, default)
    for value in tries:
        if _accepted(path, value):
            return yaml_inline(_nest(path, value))
    return "—"


# ---------------------------------------------------------------------------------------------- readers
def _sources() -> dict[str, str]:
    out = {}
    for top in SOURCE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in SCHEMA_FILES:
                out[rel] = path.read_text(encoding="utf-8")
    return out


def _aliases(text: str, section: str) -> set[str]:
    """Local names this file binds to a ``section`` object (assignments, tuple assignments, loop variables)."""
    s = re.escape(section)
    names: set[str] = set()
    for line in text.splitlines():
        if section not in line:
            continue
        line = line.strip()
        loop = re.match(rf"for\s+(?:\w+\s*,\s*)?(\w+)\s+in\s+(?:enumerate\()?[\w.]*\.{s}(?:\.items\(\)|\))?\s*:", line)
        if loop:
            names.add(loop.group(1))
            continue
        via_getattr = re.match(rf"(\w+)\s*=\s*getattr\([\w.]+,\s*[\"']{s}[\"']", line)
        if via_getattr:
            names.add(via_getattr.group(1))
            continue
        lhs, eq, rhs = line.partition("=")
        if not eq or rhs.startswith("=") or lhs.rstrip().endswith(("!", "<", ">")):
            continue
        targets = [t.strip() for t in lhs.split(",")]
        values = [v.strip() for v in rhs.split(",")]
        for target, value in zip(targets, values, strict=False):
            if not re.fullmatch(r"\w+", target):
                continue
            if re.fullmatch(rf"[\w.\[\]()\"']*\.{s}", value):
                names.add(target)
    names |= set(re.findall(rf"\b({s}_(?:cfg|config|section))\b", text))  # parameters named for the section
    names |= {alias for alias in CONVENTIONAL.get(section, ()) if re.search(rf"\b{alias}\b", text)}
    return names - {"self", "cls", "_"}


_ALIASES: dict[tuple[str, str], set[str]] = {}
#: the names the code gives a section where it is a function's parameter (``def fit_problems(par, ...)``)
CONVENTIONAL = {"parallel": ("par",)}
#: calls that take a section without reading its fields' meaning
BUILTIN_CALLS = frozenset(
    {"getattr", "setattr", "hasattr", "isinstance", "dict", "list", "print", "str", "repr", "id", "len", "sorted"}
    | {"enumerate", "setting", "_given", "bool", "type"}
)


def _readers(section: str, field: str, attr: str, sources: dict[str, str]) -> list[str]:
    """Files outside the schema that read ``<section>.<field>`` (``attr``: the Python attribute name)."""
    s, f = re.escape(section), re.escape(attr)
    found = []
    for rel, text in sources.items():
        if attr not in text and field not in text:
            continue
        hit = re.search(rf"\.{s}\.{f}\b", text) or re.search(rf"\bgetattr\([\w.]*\b{s},\s*[\"']{f}[\"']", text)
        if not hit:
            if (rel, section) not in _ALIASES:
                _ALIASES[rel, section] = _aliases(text, section) if section in text else set()
            for name in _ALIASES[rel, section]:
                n = re.escape(name)
                if re.search(rf"\b{n}\.{f}\b", text) or re.search(
                    rf"\b(?:getattr|setting|_given)\({n},\s*[\"']{f}[\"']", text
                ):
                    hit = True
                    break
        if not hit and field != attr:  # a field with an alias (``checkpoint.async``) is also read by that name
            hit = re.search(rf"[\"']{re.escape(field)}[\"']", text) and re.search(rf"\b{s}\b", text)
        if hit:
            found.append(rel)
    return found


def _whole_section_readers(path: str, sources: dict[str, str]) -> list[str]:
    """``function (file)`` per call taking the whole section (``cfg.<path>``); ``field= (file)`` per keyword passing it."""
    *parents, section = path.split(".")
    s = re.escape(section)
    owner = rf"(?:\w*cfg|config|{re.escape(parents[-1])})" if parents else r"(?:\w*cfg|config)"
    found = []
    for rel, text in sources.items():
        if f".{section}" not in text:
            continue
        calls = set()
        for line in text.splitlines():
            if f".{section}" in line:
                calls |= set(re.findall(rf"\b(\w+)\((?:[\w.]+,\s*)*(?:[\w.]*\.)?{owner}\.{s}\s*[,)]", line))
                calls |= {f"{k}=" for k in re.findall(rf"^\s+(\w+)=(?:[\w.]*\.)?{owner}\.{s}\s*,", line)}
        for func in sorted(calls):
            if func not in BUILTIN_CALLS:
                found.append(f"`{func}` (`{rel}`)")
    return found


# ---------------------------------------------------------------------------------------------- the page
def _section_rows(cls: type[Section], prefix: str, sources: dict[str, str], subs: list, whole: list) -> list[str]:
    comments = field_comments(cls)
    rows = []
    attr_of_section = prefix.rsplit(".", 1)[-1]
    for attr, info in cls.model_fields.items():
        field = info.alias or attr
        path = f"{prefix}.{field}"
        tp = info.annotation
        default = field_default(info)
        nested = _nested_section(tp)
        kind = type_name(tp)
        bounds = field_bounds(info)
        what = info.description or comments.get(attr, "")
        if nested is not None and typing.get_origin(tp) not in (list, dict):
            subs.append((path, nested))
            what = (what + " " if what else "") + f"A section: see [`{path}`](#{_anchor(path)})."
        elif nested is not None:
            subs.append((path, nested))
            what = (what + " " if what else "") + f"Each item: see [`{path}`](#{_anchor(path)})."
        shown_default = "required" if default is PydanticUndefined else f"`{yaml_inline(default)}`"
        if nested is not None and typing.get_origin(tp) not in (list, dict) and default is not None:
            shown_default = "its fields' defaults"
        readers = _readers(attr_of_section, field, attr, sources)
        read_by = ", ".join(f"`{r}`" for r in readers) if readers else "no direct read found"
        if not readers and whole:
            read_by = "through the whole section (above)"
        example = _example(path, tp, None if default is PydanticUndefined else default)
        type_cell = f"{kind}" + (f" ({bounds})" if bounds else "")
        rows.append(f"| `{path}` | {type_cell} | {shown_default} | {_cell(what)} | {read_by} | `{example}` |")
    return rows + _added_axis_rows(cls, prefix, sources)


def _added_axis_rows(cls: type[Section], prefix: str, sources: dict[str, str]) -> list[str]:
    """Rows for the sizes of the ``axes.TABLE`` entries an :class:`AxesSection` accepts beyond its own fields."""
    if not issubclass(cls, AxesSection):
        return []
    rows = []
    for axis in mesh_axes.TABLE:
        if axis.size_key in cls.model_fields:
            continue
        path = f"{prefix}.{axis.size_key}"
        what = f"ranks of the `{axis.name}` axis (`kuangchao_core/axes.py` `TABLE`)"
        what += f", carved out of `{axis.within}`: it divides that axis's size" if axis.within else ""
        readers = _readers(prefix.rsplit(".", 1)[-1], axis.size_key, axis.size_key, sources)
        read_by = ", ".join(f"`{r}`" for r in readers) if readers else "no direct read found"
        example = _example(path, int, 1)
        rows.append(f"| `{path}` | int (≥ 1) | `1` | {_cell(what)} | {read_by} | `{example}` |")
    return rows


def _nested_section(tp: Any) -> type[Section] | None:
    for a in (tp, *typing.get_args(tp)):
        for b in (a, *typing.get_args(a)):
            if isinstance(b, type) and issubclass(b, Section):
                return b
    return None


def _anchor(path: str) -> str:
    return path.replace(".", "")


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def render() -> str:
    """The whole page, from the schema and the code as they are."""
    sources = _sources()
    out = [
        "# Job configuration reference",
        "",
        "Generated by `python docs/gen_config_md.py` from `kuangchao_core/config/schema.py`; do not edit by hand",
        "(`tests/test_config_doc.py` fails when this page and the schema disagree). A job is one YAML file",
        "(`kc train --config FILE.yaml`); only `task.name` is required. Unknown keys are errors, numbers may be",
        "written as strings (`lr: 2e-5`), and a key the job's layout does not use is refused with its dotted path.",
        "",
        "Columns: the field's dotted path; its type and bounds; its default; what it means (the schema's own words);",
        "the files that read it (found by searching the code for reads of the field through its section; a field",
        "read only where code takes the whole section says so, one the search does not find says *no direct read",
        "found*); an example the schema accepts, as YAML.",
        "",
    ]
    queue = [(attr, _nested_section(info.annotation)) for attr, info in JobConfig.model_fields.items()]
    while queue:
        path, cls = queue.pop(0)
        doc = inspect.cleandoc(cls.__doc__ or "")
        out += [f"## `{path}`", "", f'<a id="{_anchor(path)}"></a>', ""]
        if doc:
            out += [" ".join(doc.split("\n\n")[0].split()), ""]
        whole = _whole_section_readers(path, sources)
        if whole:
            out += ["Code that takes the whole section: " + ", ".join(whole) + ".", ""]
        out += ["| field | type | default | meaning | read by | example |", "|---|---|---|---|---|---|"]
        subs: list = []
        out += _section_rows(cls, path, sources, subs, whole)
        out.append("")
        queue = subs + queue
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.is_file() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} is out of date: run python docs/gen_config_md.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    assert schema is not None  # the module the page describes
    raise SystemExit(main(sys.argv[1:]))
