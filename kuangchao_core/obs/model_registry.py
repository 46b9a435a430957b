"""The exported model in MLflow: logged as the run's ``model`` artifacts, registered under ``tracking.register_model``.

Each registration creates a new model version whose source is the run's ``model`` artifact directory, tagged with the
checkpoint's manifest sha256, step, format, the run's final ``eval_loss`` and its held-out evaluation (which set,
which metric, what value: :mod:`kuangchao_core.obs.champion`); two aliases follow it:

- ``newest``: always the version just registered (MLflow reserves the alias name ``latest``; its own
  ``models:/NAME/latest`` URI resolves to the newest version as well);
- ``champion``: moved to the new version only when its ``tracking.champion_metric`` beats the current champion's on
  the same held-out evaluation (ties keep the incumbent; the first version with the metric takes it). Fine-tunes
  start from ``models:/NAME@champion``, so a short or weak run never becomes their base.

``tracking.register_if: champion`` registers only a run that takes ``champion``. The result names the aliases that
moved and, in ``decision``, why ``champion`` moved or stayed (the run summary shows it).

The run gets the tags ``kuangchao.registered_model`` and ``kuangchao.model_version``, which ``kc runs compare`` shows.

Nothing diverged is registered: before the registered model, the version or any alias is touched, the model's files
(the local directory, or a download of ``source``) and the run's final training loss pass
:func:`~kuangchao_core.obs.publish_gate.check_publishable`; a refusal raises
:class:`~kuangchao_core.obs.publish_gate.NotPublishable` and leaves the registry as it was.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from kuangchao_core.obs.champion import ALIAS_CHAMPION, ALIAS_NEWEST, Candidate, decide, evaluation_identity
from kuangchao_core.obs.publish_gate import check_publishable
from kuangchao_core.obs.tracking import _client, tracking_uri

log = logging.getLogger("kuangchao.obs.model_registry")

MODEL_ARTIFACT_PATH = "model"
EVAL_LOSS_TAG = "eval_loss"


def log_model_dir(cfg: Any, run_id: str, model_dir: str | Path, record: dict[str, Any]) -> str:
    """Upload ``model_dir`` as the run's ``model`` artifacts and tag the run with the checkpoint it came from;
    returns the artifact URI."""
    client = _client(tracking_uri(cfg))
    client.log_artifacts(run_id, str(model_dir), artifact_path=MODEL_ARTIFACT_PATH)
    client.set_tag(run_id, "kuangchao.model_manifest_sha256", record["manifest_sha256"])
    client.set_tag(run_id, "kuangchao.model_format", record["format"])
    return f"{client.get_run(run_id).info.artifact_uri}/{MODEL_ARTIFACT_PATH}"


def run_final_loss(client: Any, run_id: str) -> float | None:
    """The run's final training loss as MLflow holds it: its ``final_loss`` metric, else its last ``loss``; None when
    it logged neither."""
    for key in ("final_loss", "loss"):
        history = client.get_metric_history(run_id, key)
        if history:
            last = max(history, key=lambda m: (m.step, m.timestamp))
            return float(last.value)
    return None


def _local_model_dir(source: str) -> Path | None:
    local = Path(source.removeprefix("file://"))
    return local if local.is_dir() else None


def check_registrable(
    cfg: Any,
    run_id: str,
    name: str,
    source: str,
    final_loss: float | None = None,
    model_dir: str | Path | None = None,
) -> None:
    """Raise :class:`~kuangchao_core.obs.publish_gate.NotPublishable` when the model at ``source`` (read from
    ``model_dir`` when given, else from the local artifact directory or a download) or the run's final training loss
    (``final_loss``, else the run's own metrics) is not finite. Registration and any alias move call it first."""
    import tempfile

    client = _client(tracking_uri(cfg))
    loss = final_loss if final_loss is not None else run_final_loss(client, run_id)
    what = f"registration of {name} from run {run_id}"
    local = Path(model_dir) if model_dir is not None else _local_model_dir(source)
    if local is not None:
        check_publishable(local, loss, what=what)
        return
    from mlflow.artifacts import download_artifacts

    with tempfile.TemporaryDirectory(prefix="kc-gate-") as tmp:
        got = download_artifacts(artifact_uri=source, dst_path=tmp)
        check_publishable(got, loss, what=what)


def candidate_of(cfg: Any, client: Any, run_id: str) -> Candidate:
    """The run as the champion rule sees it: its ``tracking.champion_metric`` (the run's last value; None when it
    logged none) and the identity of its held-out evaluation (:func:`~kuangchao_core.obs.champion.evaluation_identity`)."""
    metric = cfg.tracking.champion_metric
    value = client.get_run(run_id).data.metrics.get(metric)
    eval_set, about = evaluation_identity(cfg)
    return Candidate(metric, None if value is None else float(value), eval_set, about)


def _current(client: Any, name: str, alias: str) -> Any | None:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def register_model(
    cfg: Any,
    run_id: str,
    name: str,
    source: str,
    record: dict[str, Any],
    eval_loss: float | None,
    final_loss: float | None = None,
    model_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Register ``source`` (the run's model artifacts) as a new version of ``name`` and move the aliases; returns
    ``{"name", "version", "aliases", "eval_loss", "decision"}`` (``version`` None and ``aliases`` empty when
    ``tracking.register_if: champion`` registered nothing; ``decision``: which aliases moved and why).
    ``final_loss`` / ``model_dir``: the run's final training loss and the model's local files, when the caller has
    them (else read from MLflow). A model with a non-finite weight or final loss is refused first
    (:func:`check_registrable`): nothing is registered, no alias moves."""
    from mlflow.exceptions import MlflowException

    check_registrable(cfg, run_id, name, source, final_loss, model_dir)
    client = _client(tracking_uri(cfg))
    candidate = candidate_of(cfg, client, run_id)
    champion = _current(client, name, ALIAS_CHAMPION)
    verdict = decide(candidate, champion, cfg.tracking.champion_min)
    if cfg.tracking.register_if == "champion" and not verdict.takes_champion:
        decision = f"not registered (tracking.register_if: champion); {verdict.why}"
        log.info("%s: %s", name, decision)
        return {"name": name, "version": None, "aliases": [], "eval_loss": eval_loss, "decision": decision}
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description=f"Kuangchao task {cfg.task.name}")
    tags = {
        "kuangchao.manifest_sha256": record["manifest_sha256"],
        "kuangchao.step": str(record["step"]),
        "kuangchao.format": record["format"],
        "kuangchao.task": cfg.task.name,
        **candidate.tags(),
    }
    if eval_loss is not None:
        tags[EVAL_LOSS_TAG] = repr(float(eval_loss))
    version = client.create_model_version(name, source, run_id=run_id, tags=tags)
    aliases = [ALIAS_NEWEST]
    client.set_registered_model_alias(name, ALIAS_NEWEST, version.version)
    if verdict.takes_champion:
        client.set_registered_model_alias(name, ALIAS_CHAMPION, version.version)
        aliases.append(ALIAS_CHAMPION)
    decision = f"{name} v{version.version}: {' and '.join(aliases)} moved; {verdict.why}"
    log.info("%s", decision)
    client.set_tag(run_id, "kuangchao.registered_model", name)
    client.set_tag(run_id, "kuangchao.model_version", str(version.version))
    client.set_tag(run_id, "kuangchao.registry_decision", decision[:5000])
    return {
        "name": name,
        "version": int(version.version),
        "aliases": aliases,
        "eval_loss": eval_loss,
        "decision": decision,
    }


MODEL_URI_PREFIX = "models:/"


def _parse_model_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``models:/NAME@ALIAS`` -> (NAME, ALIAS, None); ``models:/NAME/VERSION`` -> (NAME, None, VERSION)."""
    from kuangchao_core.errors import ConfigError

    rest = uri[len(MODEL_URI_PREFIX) :]
    if "@" in rest:
        name, alias = rest.rsplit("@", 1)
        if name and alias:
            return name, alias, None
    elif "/" in rest:
        name, version = rest.rsplit("/", 1)
        if name and version.isdigit():
            return name, None, version
    raise ConfigError([("model.checkpoint", f"{uri!r}: use models:/NAME@ALIAS or models:/NAME/VERSION")])


def _require_store_file(uri: str, tracking: str) -> None:
    """Refuse a ``sqlite:///`` store whose file is not there (opening it would create an empty one), saying where a
    relative path was looked for: it is read from the working directory, not from the config's."""
    from kuangchao_core.errors import ConfigError
    from kuangchao_core.obs.tracking_store import sqlite_path

    path = sqlite_path(tracking)
    if path is None or Path(path).is_file():
        return
    where = "" if Path(path).is_absolute() else f" (a relative path, read from the working directory {Path.cwd()})"
    raise ConfigError(
        [
            (
                "model.checkpoint",
                f"{uri}: the tracking store {tracking} has no database at {Path(path).absolute()}{where}; run from the "
                "directory that holds it or give tracking.uri an absolute path",
            )
        ]
    )


def resolve_model_uri(uri: str, tracking: str, download_root: str | Path) -> tuple[Path, dict[str, Any]]:
    """The local directory of a registered model version (``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``) in the
    MLflow store ``tracking``: its source directory when the artifact store is local, else a download into
    ``download_root/NAME-v<version>`` (reused when complete). Returns the directory and ``{"name", "version",
    "manifest_sha256", "format"}``; a version holding LoRA adapters is refused (merge it first)."""
    from mlflow.artifacts import download_artifacts
    from mlflow.exceptions import MlflowException

    from kuangchao_core.errors import ConfigError

    name, alias, number = _parse_model_uri(uri)
    _require_store_file(uri, tracking)
    client = _client(tracking)
    try:
        version = (
            client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, str(number))
        )
    except MlflowException as exc:
        raise ConfigError(
            [("model.checkpoint", f"{uri}: no such model version in {tracking} ({exc.message})")]
        ) from None
    info = {
        "name": name,
        "version": int(version.version),
        "manifest_sha256": version.tags.get("kuangchao.manifest_sha256"),
        "format": version.tags.get("kuangchao.format", "hf"),
    }
    if info["format"] != "hf":
        raise ConfigError(
            [
                (
                    "model.checkpoint",
                    f"{uri} is version {version.version}: {info['format']} adapters, not a whole model; export the "
                    "LoRA checkpoint merged (kc checkpoint convert --format hf) to start from it",
                )
            ]
        )
    source = str(version.source)
    local = Path(source.removeprefix("file://"))
    if local.is_dir() and (local / "config.json").is_file():
        return local, info
    dst = Path(download_root) / f"{name}-v{version.version}"
    if not (dst / "config.json").is_file():
        tmp = dst.with_name(f".{dst.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        got = Path(download_artifacts(artifact_uri=source, dst_path=str(tmp)))
        os.replace(got, dst)
        shutil.rmtree(tmp, ignore_errors=True)
    return dst, info
