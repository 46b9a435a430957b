"""A new SQLite MLflow store made by copying an empty one of the same MLflow version (issue 45 item 2: start-up).

MLflow builds a new SQLite store by running every Alembic migration since its first schema: seconds on a 2-core
machine, at the first run in every new directory (and in nearly every test of a job). What the migrations build
depends only on MLflow's version, so the first new store of a version is built once into the cache
(``$KC_CACHE_DIR``, default ``~/.cache/kuangchao``: ``mlflow-store-<version>.db``, its default experiment removed so
that each copy makes its own, with its own artifact location, when MLflow first opens it) and every later new store
is a copy of it. A store that exists is never touched: the copy is linked into place only where no file is yet
(another process's store wins). Anything that fails here leaves the store to MLflow, as before.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import sqlite3
import uuid
from pathlib import Path

from kuangchao_core.config.paths import machine_cache_dir

log = logging.getLogger(__name__)


def seed_new_store(path: str) -> bool:
    """Make the absent SQLite store file ``path`` a copy of this MLflow version's empty store; True when it did.
    Nothing happens (False) when the file exists, its directory does not, or the empty store cannot be made."""
    target = Path(path)
    if target.exists() or not target.absolute().parent.is_dir():
        return False
    try:
        template = empty_store()
        staged = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.seed")
        try:
            shutil.copyfile(template, staged)
            os.link(staged, target)  # never over a store another process made meanwhile
        except FileExistsError:
            return False
        finally:
            staged.unlink(missing_ok=True)
    except Exception as exc:  # noqa: BLE001 - a seed is only a shortcut: MLflow builds the store itself
        log.debug("MLflow store %s not seeded (%s: %s): MLflow builds it", path, type(exc).__name__, exc)
        return False
    return True


def empty_store() -> Path:
    """This MLflow version's empty SQLite store in the machine's cache (``config.paths.machine_cache_dir``), built
    on first use: MLflow's own tables at its newest revision, no experiment."""
    version = importlib.metadata.version("mlflow")
    template = machine_cache_dir() / f"mlflow-store-{version}.db"
    if _usable(template):
        return template
    template.parent.mkdir(parents=True, exist_ok=True)
    staged = template.with_name(f".{template.name}.{uuid.uuid4().hex[:12]}.build")
    try:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        store = SqlAlchemyStore(f"sqlite:///{staged}", str(template.parent / "unused-artifacts"))
        store.engine.dispose()
        conn = sqlite3.connect(staged)
        try:
            with conn:  # the default experiment (and its tags): each copy makes its own where it is opened
                conn.execute("DELETE FROM experiment_tags")
                conn.execute("DELETE FROM experiments")
            conn.execute("VACUUM")
        finally:
            conn.close()
        os.replace(staged, template)  # atomic: a reader sees no half-built store
    finally:
        staged.unlink(missing_ok=True)
    return template


def _usable(template: Path) -> bool:
    """The cached empty store opens as SQLite and names its Alembic revision (else it is built again)."""
    if not template.is_file():
        return False
    try:
        conn = sqlite3.connect(f"file:{template}?mode=ro", uri=True)
        try:
            return conn.execute("SELECT version_num FROM alembic_version").fetchone() is not None
        finally:
            conn.close()
    except sqlite3.Error:
        return False
