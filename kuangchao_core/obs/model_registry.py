"""The exported model in MLflow: logged as the run's ``model`` artifacts, registered under ``tracking.register_model``.

Each registration creates a new model version whose source is the run's ``model`` artifact directory, tagged with the
checkpoint's manifest sha256, step, format and the run's final ``eval_loss``; two aliases follow it:

- ``newest``: always the version just registered (MLflow reserves the alias name ``latest``; its own
  ``models:/NAME/latest`` URI resolves to the newest version as well);
- ``best``: the version with the lowest ``eval_loss`` — moved to the new version only when its eval loss is lower
  than the current best's (a run without an eval loss never takes it).

The run gets the tags ``kuangchao.registered_model`` and ``kuangchao.model_version``, which ``kc runs compare`` shows.

Nothing diverged is registered: before the registered model, the version or any alias is touched, the model's files
(the local directory, or a download of ``source``) and the run's final training loss pass
:func:`~kuangchao_core.obs.publish_gate.check_publishable`; a refusal raises
:class:`~kuangchao_core.obs.publish_gate.NotPublishable` and leaves the registry as it was.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

from kuangchao_core.obs.publish_gate import check_publishable
from kuangchao_core.obs.tracking import _client, tracking_uri

log = logging.getLogger("kuangchao.obs.model_registry")

MODEL_ARTIFACT_PATH = "model"
ALIAS_NEWEST = "newest"
ALIAS_BEST = "best"
EVAL_LOSS_TAG = "eval_loss"


def log_model_dir(cfg: Any, run_id: str, model_dir: str | Path, record: dict[str, Any]) -> str:
    """Upload ``model_dir`` as the run's ``model`` artifacts and tag the run with the checkpoint it came from;
    returns the artifact URI."""
    client = _client(tracking_uri(cfg))
    client.log_artifacts(run_id, str(model_dir), artifact_path=MODEL_ARTIFACT_PATH)
    client.set_tag(run_id, "kuangchao.model_manifest_sha256", record["manifest_sha256"])
    client.set_tag(run_id, "kuangchao.model_format", record["format"])
    return f"{client.get_run(run_id).info.artifact_uri}/{MODEL_ARTIFACT_PATH}"


def _eval_loss(version: Any) -> float | None:
    try:
        value = float(version.tags.get(EVAL_LOSS_TAG, "nan"))
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


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
    ``{"name", "version", "aliases", "eval_loss"}``. ``final_loss`` / ``model_dir``: the run's final training loss
    and the model's local files, when the caller has them (else read from MLflow). A model with a non-finite weight
    or final loss is refused first (:func:`check_registrable`): nothing is registered, no alias moves."""
    from mlflow.exceptions import MlflowException

    check_registrable(cfg, run_id, name, source, final_loss, model_dir)
    client = _client(tracking_uri(cfg))
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description=f"Kuangchao task {cfg.task.name}")
    tags = {
        "kuangchao.manifest_sha256": record["manifest_sha256"],
        "kuangchao.step": str(record["step"]),
        "kuangchao.format": record["format"],
        "kuangchao.task": cfg.task.name,
    }
    if eval_loss is not None:
        tags[EVAL_LOSS_TAG] = repr(float(eval_loss))
    version = client.create_model_version(name, source, run_id=run_id, tags=tags)
    aliases = [ALIAS_NEWEST]
    client.set_registered_model_alias(name, ALIAS_NEWEST, version.version)
    best = None
    try:
        best = client.get_model_version_by_alias(name, ALIAS_BEST)
    except MlflowException:
        pass
    best_loss = _eval_loss(best) if best is not None else None
    if eval_loss is not None and (best_loss is None or eval_loss < best_loss):
        client.set_registered_model_alias(name, ALIAS_BEST, version.version)
        aliases.append(ALIAS_BEST)
    elif eval_loss is None:
        log.warning("%s version %s has no eval_loss: the %r alias stays where it is", name, version.version, ALIAS_BEST)
    client.set_tag(run_id, "kuangchao.registered_model", name)
    client.set_tag(run_id, "kuangchao.model_version", str(version.version))
    return {"name": name, "version": int(version.version), "aliases": aliases, "eval_loss": eval_loss}


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


def resolve_model_uri(uri: str, tracking: str, download_root: str | Path) -> tuple[Path, dict[str, Any]]:
    """The local directory of a registered model version (``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``) in the
    MLflow store ``tracking``: its source directory when the artifact store is local, else a download into
    ``download_root/NAME-v<version>`` (reused when complete). Returns the directory and ``{"name", "version",
    "manifest_sha256", "format"}``; a version holding LoRA adapters is refused (merge it first)."""
    from mlflow.artifacts import download_artifacts
    from mlflow.exceptions import MlflowException

    from kuangchao_core.errors import ConfigError

    name, alias, number = _parse_model_uri(uri)
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
