"""A new SQLite MLflow store is a copy of an empty one of the same MLflow version (kuangchao_core/obs/store_seed.py):
the same schema MLflow's migrations build, a default experiment of its own, and never a store that exists."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from kuangchao_core.obs import store_seed
from kuangchao_core.obs.tracking_store import preflight


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _schema(path: Path) -> dict[str, object]:
    """The store's table and index definitions and its Alembic revision."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT name, sql FROM sqlite_master WHERE type IN ('table', 'index')")
        # each definition's clauses as a set: MLflow's migrations write a table's constraints in varying order
        tables = {name: sorted(part.strip().rstrip(",") for part in (sql or "").splitlines()) for name, sql in rows}
        revision = conn.execute("SELECT version_num FROM alembic_version").fetchall()
    finally:
        conn.close()
    return {"tables": tables, "revision": revision}


def test_a_seeded_store_is_the_store_mlflow_builds_with_its_own_default_experiment(tmp_path, cache, monkeypatch):
    from mlflow.tracking import MlflowClient

    built = tmp_path / "built" / "mlflow.db"  # MLflow's own migrations, run here
    built.parent.mkdir()
    MlflowClient(f"sqlite:///{built}").search_experiments()
    seeded = tmp_path / "job" / "mlflow.db"
    seeded.parent.mkdir()
    monkeypatch.chdir(seeded.parent)

    assert store_seed.seed_new_store("mlflow.db") is True  # relative, as sqlite:///mlflow.db names it
    assert (cache / f"mlflow-store-{store_seed.importlib.metadata.version('mlflow')}.db").is_file()
    assert _schema(seeded) == _schema(built)

    client = preflight(f"sqlite:///{seeded}")
    default = client.get_experiment("0")  # made when the copy was first opened, where it was opened
    assert Path(default.artifact_location.removeprefix("file://")) == seeded.parent / "mlruns" / "0"
    run = client.create_run(client.create_experiment("kc-seeded"))
    client.log_metric(run.info.run_id, "loss", 1.5, step=3)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(3, 1.5)]

    # the control: a template one revision behind is a different schema, which the comparison sees
    template = store_seed.empty_store()
    stale = tmp_path / "stale.db"
    stale.write_bytes(template.read_bytes())
    with sqlite3.connect(stale) as conn:
        conn.execute("UPDATE alembic_version SET version_num = 'an-older-one'")
    assert _schema(stale) != _schema(built)


def test_an_existing_store_or_a_missing_directory_is_left_alone(tmp_path, cache):
    existing = tmp_path / "mlflow.db"
    existing.write_bytes(b"whatever the user keeps here")
    assert store_seed.seed_new_store(str(existing)) is False
    assert existing.read_bytes() == b"whatever the user keeps here"
    assert store_seed.seed_new_store(str(tmp_path / "no-such-dir" / "mlflow.db")) is False
    assert not (tmp_path / "no-such-dir").exists()
    assert not cache.exists()  # nothing was built for a store that was not made


def test_a_seed_that_cannot_be_made_leaves_the_store_to_mlflow(tmp_path, monkeypatch):
    blocked = tmp_path / "cache-is-a-file"
    blocked.write_text("")
    monkeypatch.setenv("KC_CACHE_DIR", str(blocked))  # the cache cannot be created
    assert store_seed.seed_new_store(str(tmp_path / "mlflow.db")) is False
    assert not (tmp_path / "mlflow.db").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["cache-is-a-file"]  # no staged copy left behind


def test_a_damaged_cached_store_is_built_again_before_it_is_copied(tmp_path, cache):
    template = store_seed.empty_store()
    good = _schema(template)
    template.write_bytes(b"not a database")  # a half-written or tampered cache entry
    assert store_seed.seed_new_store(str(tmp_path / "mlflow.db")) is True
    assert _schema(tmp_path / "mlflow.db") == good
    assert _schema(template) == good
