"""The audit pins kept outside the run directory, read back for ``kc audit --verify`` (issue 26).

The orchestrator publishes every pin (:mod:`~kuangchao_core.perm.audit_pins`) to the job's MLflow run (tag
``kuangchao.audit_pin``, artifact ``audit/pins.json``), as a Prefect artifact ``kc-audit-pin`` of the flow run and,
when one is configured, to an append-only pin store (:mod:`~kuangchao_core.perm.pin_store`: the one place a worker
with the job's uid cannot rewrite). :func:`collect_external_pins` reads them back from the pin store
(``--pin-store``, ``$KC_AUDIT_PIN_STORE``), the tracking store (``--tracking-uri``, ``$KC_TRACKING_URI``,
``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``; never the run's own ``config.yaml``, which a worker's uid can
point at a forged store) and from the Prefect API this shell is configured for (only when ``PREFECT_API_URL`` is
set: an ephemeral server would know nothing), through the caller's :class:`ArtifactSource`. :class:`ExternalPins` then picks those of one job (by the job id a log
names: a copy of a log at another path still meets its job's pins), one run (by the run directory each pin names),
one log (by its resolved path) or one task. Every record is parsed with the bounded JSON reader, and one record that
cannot be read (too deep, malformed) is a note that voids only itself (issue 38).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kuangchao_core.config.bounded_json import loads_bounded
from kuangchao_core.perm.audit_pins import (
    MLFLOW_PIN_TAG,
    MLFLOW_PINS_ARTIFACT,
    PREFECT_PIN_KEY,
    AuditPin,
    AuditPinError,
    load_pins_file,
)
from kuangchao_core.perm.pin_store import configured_store, is_append_only, read_store, store_file

log = logging.getLogger("kuangchao.perm.audit_external")
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
MAX_RUNS = 5000
MAX_ARTIFACTS = 5000
_NO_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


@dataclass
class ExternalPins:
    """Pins found outside every run directory, each with where it was found; ``notes``: sources not reachable."""

    found: list[tuple[AuditPin, str]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, pin: AuditPin, source: str) -> None:
        """Keep ``pin`` (found at ``source``) unless the same pin is already kept."""
        if all(p != pin for p, _ in self.found):
            self.found.append((pin, source))

    def for_run(self, run_dir: str | os.PathLike, job_id: str | None = None) -> list[tuple[AuditPin, str]]:
        """The pins of the run in ``run_dir``: those naming it, and pins of an older format (no ``run_dir``) of
        ``job_id``."""
        run = str(Path(run_dir).resolve())
        return [(p, s) for p, s in self.found if p.run_dir == run or (not p.run_dir and job_id and p.job_id == job_id)]

    def for_log(self, log_path: str | os.PathLike) -> list[tuple[AuditPin, str]]:
        """The pins of the log at ``log_path`` (matched by its resolved path)."""
        path = str(Path(log_path).resolve())
        return [(p, s) for p, s in self.found if p.log_path == path]

    def for_job(self, job_id: str | None) -> list[tuple[AuditPin, str]]:
        """The pins of job ``job_id`` wherever its log or run lies (``[]`` for None)."""
        return [(p, s) for p, s in self.found if job_id and (p.job_id == job_id or p.log_id == job_id)]

    def for_task(self, task: str) -> list[tuple[AuditPin, str]]:
        """The pins of every job of ``task`` (job ids ``<task>@<run>``)."""
        return [(p, s) for p, s in self.found if p.job_id.startswith(f"{task}@")]


@dataclass(frozen=True)
class ArtifactSource:
    """The caller's reader of Prefect artifacts (the core imports no Prefect, issue 43 item 6; ``kc audit``'s is
    ``kuangchao/cli/prefect_artifacts.py`` ``PREFECT_ARTIFACTS``).

    - ``api()``: the configured API's URL, None when none is (an ephemeral server would know nothing);
    - ``artifacts(key, most)``: ``(artifact id, flow run id, data)`` of at most ``most`` artifacts with that key.
    """

    api: Callable[[], str | None]
    artifacts: Callable[[str, int], Iterable[tuple[Any, Any, Any]]]


def collect_external_pins(
    tracking_uri: str | None = None, *, prefect: ArtifactSource | None = None, pin_store: str | None = None
) -> ExternalPins:
    """Every pin in the append-only ``pin_store`` (default ``$KC_AUDIT_PIN_STORE``), the MLflow store at
    ``tracking_uri`` (see module docstring) and, given ``prefect`` (the caller's :class:`ArtifactSource`), in the
    configured Prefect API. Never raises: an unreachable source is a note."""
    found = ExternalPins()
    store = configured_store(pin_store)
    if store:
        try:
            _from_pin_store(found, store)
        except OSError as exc:
            found.notes.append(f"audit pin store {store} not read: {exc}")
    uri = tracking_uri or os.environ.get("KC_TRACKING_URI") or os.environ.get("MLFLOW_TRACKING_URI")
    uri = uri or DEFAULT_TRACKING_URI
    try:
        _from_mlflow(found, uri)
    except Exception as exc:  # an unreachable store only loses its pins; the verdict says pins are missing
        found.notes.append(f"MLflow store {uri} not read: {exc}")
    if prefect is not None:
        try:
            _from_prefect(found, prefect)
        except Exception as exc:
            found.notes.append(f"Prefect artifacts not read: {exc}")
    return found


def _from_pin_store(found: ExternalPins, directory: str) -> None:
    where = f"pin store {store_file(directory)}"
    found.sources.append(where + ("" if is_append_only(store_file(directory)) else " (not append-only)"))
    for number, record, why in read_store(directory):
        try:
            if record is None:
                raise ValueError(why)
            found.add(AuditPin.from_json(record), f"{where}:{number}")
        except ValueError as exc:  # one bad line voids only itself
            found.notes.append(f"{where}:{number}: unreadable ({exc})")


def _from_mlflow(found: ExternalPins, uri: str) -> None:
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).exists():
        found.notes.append(f"no MLflow store at {uri} (pass --tracking-uri or set KC_TRACKING_URI)")
        return
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found.sources.append(f"MLflow {uri}")
    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    token, seen = None, 0
    while experiments and seen < MAX_RUNS:
        page = client.search_runs(
            experiments,
            filter_string=f"tags.`{MLFLOW_PIN_TAG}` LIKE '%'",
            run_view_type=ViewType.ALL,
            max_results=500,
            page_token=token,
        )
        for run in page:
            seen += 1
            try:
                _run_pins(found, client, run)
            except Exception as exc:  # one hostile run loses only its own pins, never the store's
                found.notes.append(f"MLflow run {run.info.run_id}: pins unreadable ({type(exc).__name__}: {exc})")
        token = page.token
        if not token:
            break


def _run_pins(found: ExternalPins, client, run) -> None:
    where = f"MLflow run {run.info.run_id}"
    try:
        tag = loads_bounded(run.data.tags[MLFLOW_PIN_TAG], where=f"{where} tag {MLFLOW_PIN_TAG}")
        found.add(AuditPin.from_json(tag), f"{where} tag")
    except (ValueError, KeyError) as exc:
        found.notes.append(f"{where}: tag {MLFLOW_PIN_TAG} unreadable ({exc})")
    for pin in _artifact_pins(client, run.info.run_id, found):
        found.add(pin, f"{where} {MLFLOW_PINS_ARTIFACT}")


def _artifact_pins(client, run_id: str, found: ExternalPins) -> list[AuditPin]:
    with tempfile.TemporaryDirectory(prefix="kc-audit-pins-") as tmp:
        bar = os.environ.get(_NO_BAR)
        os.environ[_NO_BAR] = "false"  # no progress bar on the verdict's stdout
        try:
            path = client.download_artifacts(run_id, MLFLOW_PINS_ARTIFACT, tmp)
        except Exception:  # a run that has only the tag (its artifact upload failed)
            return []
        finally:
            if bar is None:
                os.environ.pop(_NO_BAR, None)
            else:
                os.environ[_NO_BAR] = bar
        try:
            return load_pins_file(path)
        except AuditPinError as exc:
            found.notes.append(f"MLflow run {run_id}: {exc}")
            return []


def _from_prefect(found: ExternalPins, source: ArtifactSource) -> None:
    api = source.api()
    if not api:
        found.notes.append("no Prefect API configured (PREFECT_API_URL): its kc-audit-pin artifacts not read")
        return
    found.sources.append(f"Prefect {api}")
    for art_id, flow_run_id, data in source.artifacts(PREFECT_PIN_KEY, MAX_ARTIFACTS):
        try:
            pin = pin_from_markdown(str(data or ""))
        except Exception as exc:  # one artifact lost, not the others
            found.notes.append(f"Prefect artifact {art_id}: unreadable ({exc})")
            continue
        if pin is not None:
            found.add(pin, f"Prefect artifact {art_id} (flow run {flow_run_id})")


def pin_from_markdown(text: str) -> AuditPin | None:
    """The pin in a ``kc-audit-pin`` artifact's markdown (its JSON block); None when there is none or it is bad."""
    start = text.find("```json\n")
    end = text.find("\n```", start + 8)
    if start < 0 or end < 0:
        return None
    try:
        return AuditPin.from_json(loads_bounded(text[start + 8 : end]))
    except ValueError:
        return None
