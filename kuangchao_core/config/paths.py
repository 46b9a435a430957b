"""Every path a job uses, made absolute once by the orchestrator (issue 32 §8).

A job's processes do not share a working directory: a node agent runs where it was started, a Slurm task wherever
``srun`` puts it. So the orchestrator resolves each relative path of the config against the directory where the
user ran ``kc train``, once, before it writes the resolved config; the nodes and ranks read exactly those paths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: config fields that name a local file or directory (None or empty: unset)
PATH_FIELDS = (
    "checkpoint.dir",
    "data.path",
    "data.cache_dir",
    "data.eval_path",
    "permission.audit_log",
    "logging.json_file",
)
_SQLITE = "sqlite:///"


def _absolute(value: str, base: Path) -> str:
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base / path).absolute())


def _remote(value: str) -> bool:
    return "://" in value or value.startswith(("models:/", "s3:"))


def absolute_sqlite_uri(uri: str, base: Path) -> str:
    """``sqlite:///mlflow.db`` (relative to the working directory) as ``sqlite:////<base>/mlflow.db``; other URIs
    (an absolute sqlite path, http, file) unchanged."""
    if not uri.startswith(_SQLITE) or uri.startswith(_SQLITE + "/") or uri == _SQLITE + ":memory:":
        return uri
    return _SQLITE + _absolute(uri[len(_SQLITE) :], base)


def make_paths_absolute(cfg: Any, base: str | Path | None = None) -> list[str]:
    """Rewrite ``cfg``'s relative local paths (``PATH_FIELDS``, ``tracking.uri``'s sqlite file, a tokenizer or
    ``model.checkpoint`` that exists as a local path) as absolute paths under ``base`` (default: the current
    directory), in place; returns the dotted fields it changed."""
    base = Path(base or Path.cwd()).absolute()
    changed: list[str] = []

    def rewrite(dotted: str, value: str | None) -> None:
        section, name = dotted.split(".")
        if value != getattr(getattr(cfg, section), name):
            setattr(getattr(cfg, section), name, value)
            changed.append(dotted)

    for dotted in PATH_FIELDS:
        section, name = dotted.split(".")
        value = getattr(getattr(cfg, section), name, None)
        if value and not _remote(str(value)):
            rewrite(dotted, _absolute(str(value), base))
    rewrite("tracking.uri", absolute_sqlite_uri(str(cfg.tracking.uri), base))
    # names that may also be something other than a path (``byte``, ``models:/…``): only when they exist here
    for dotted, value in (("data.tokenizer", cfg.data.tokenizer), ("model.checkpoint", cfg.model.checkpoint)):
        if value and not _remote(str(value)) and not Path(value).is_absolute() and (base / value).exists():
            rewrite(dotted, _absolute(str(value), base))
    return changed


def relative_paths(cfg: Any) -> list[str]:
    """The dotted fields of ``cfg`` that still hold a relative local path (empty once resolved)."""
    out = []
    for dotted in PATH_FIELDS:
        section, name = dotted.split(".")
        value = getattr(getattr(cfg, section), name, None)
        if value and not _remote(str(value)) and not Path(value).is_absolute():
            out.append(dotted)
    uri = str(cfg.tracking.uri)
    if uri.startswith(_SQLITE) and absolute_sqlite_uri(uri, Path("/")) != uri:
        out.append("tracking.uri")
    return out


def machine_cache_dir() -> Path:
    """Where Kuangchao keeps what it measures or builds once per machine (``$KC_CACHE_DIR``, default
    ``~/.cache/kuangchao``): the Gloo check's memo, measured topologies, an empty MLflow store, validation outcomes."""
    import os

    return Path(os.environ.get("KC_CACHE_DIR") or Path.home() / ".cache" / "kuangchao")
