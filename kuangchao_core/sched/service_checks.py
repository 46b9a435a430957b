"""The doctor's probes of the services a job writes to: checkpoint storage (local or S3), MLflow, Prefect.

Each probe does the smallest real operation (write+fsync+delete of a probe file, S3 ``head_bucket`` and a
put/delete, HTTP ``/health``) and returns a :class:`~kuangchao_core.sched.doctor_report.Check` with a fix when it
fails; none raises.
"""

from __future__ import annotations

import os
import tempfile
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from kuangchao_core.config.access import setting
from kuangchao_core.obs.run_hooks import NO_HOOKS, RunHooks
from kuangchao_core.obs.tracking_store import LOCKED, probe_sqlite, store_error
from kuangchao_core.sched.doctor_report import Check
from kuangchao_core.sched.transient import TRANSIENT_HTTP_STATUS, classify_failure
from kuangchao_core.sched.version_agent import CONNECT_TIMEOUT_S


def _probe_local_dir(path: Path) -> Check:
    created: list[Path] = []
    try:
        missing = path
        while not missing.exists() and missing.parent != missing:
            created.append(missing)
            missing = missing.parent
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".kc-doctor-{uuid.uuid4().hex}"
        with open(probe, "wb") as f:
            f.write(b"kc doctor probe\n")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
        for d in created:  # leave the tree as it was; the job creates its directories itself
            d.rmdir()
        return Check("checkpoint_storage", True, f"{path} writable (write+fsync+delete)")
    except OSError as exc:
        return Check(
            "checkpoint_storage",
            False,
            f"cannot write to checkpoint dir {path}: {type(exc).__name__}: {exc}",
            "set checkpoint.dir to a writable directory (shared by all nodes for multi-node jobs), "
            "or fix its permissions / free space",
        )


def _probe_s3(uri: str, endpoint: str | None) -> Check:
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    rest = uri[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    where = f"{uri}" + (f" at {endpoint}" if endpoint else "")
    try:
        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            config=Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=10, retries={"max_attempts": 1}),
        )
        s3.head_bucket(Bucket=bucket)
        key = f"{prefix.rstrip('/') + '/' if prefix else ''}.kc-doctor-{uuid.uuid4().hex}"
        s3.put_object(Bucket=bucket, Key=key, Body=b"kc doctor probe\n")
        s3.delete_object(Bucket=bucket, Key=key)
        return Check("checkpoint_storage", True, f"{where} writable (head_bucket + put/delete)")
    except (BotoCoreError, ClientError) as exc:
        return Check(
            "checkpoint_storage",
            False,
            f"S3 checkpoint storage {where} not usable: {type(exc).__name__}: {exc}",
            "check that the bucket exists, the endpoint (checkpoint.endpoint_url / AWS_ENDPOINT_URL) is right, and "
            "the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the storage block) allow put and delete",
            transient=classify_failure(exc)[0],  # an endpoint that did not answer, S3 asking to slow down
        )


def check_checkpoint_storage(cfg: Any) -> Check:
    """The configured checkpoint storage (local directory or S3) accepts writes."""
    uri = setting(cfg, "checkpoint.uri")
    if uri and str(uri).startswith("s3://"):
        endpoint = setting(cfg, "checkpoint.endpoint_url") or os.environ.get("AWS_ENDPOINT_URL")
        return _probe_s3(str(uri), endpoint)
    return _probe_local_dir(Path(str(setting(cfg, "checkpoint.dir", "checkpoints"))).expanduser())


def _http_health(url: str, timeout: float) -> tuple[str, bool] | None:
    """None when ``url`` answers 2xx, else (what went wrong, whether a later try may pass)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            if 200 <= resp.status < 300:
                return None
            return f"HTTP {resp.status}", resp.status in TRANSIENT_HTTP_STATUS
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}", exc.code in TRANSIENT_HTTP_STATUS
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}", classify_failure(exc)[0]


def check_mlflow(cfg: Any, timeout: float = CONNECT_TIMEOUT_S) -> Check:
    """The MLflow tracking store is reachable (sqlite/file: directory writable, and an existing SQLite file a
    database with MLflow's tables; http: ``/health``). A SQLite store locked by another process passes with a note:
    the job waits for it (``tracking.store_wait_s``)."""
    uri = str(setting(cfg, "tracking.uri", None) or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db")
    fix_dir = "set tracking.uri to a location you can write, e.g. sqlite:///mlflow.db in the working directory"
    if uri.startswith("sqlite:"):
        path = uri.split("sqlite:///", 1)[1] if "sqlite:///" in uri else ""
        if path in ("", ":memory:"):
            return Check("mlflow", True, f"{uri}: in-memory store")
        directory = Path(path).expanduser().resolve().parent
    elif uri.startswith(("http://", "https://")):
        err = _http_health(uri.rstrip("/") + "/health", timeout)
        if err is None:
            return Check("mlflow", True, f"{uri} healthy")
        return Check(
            "mlflow",
            False,
            f"MLflow server {uri} not reachable: {err[0]}",
            "start it (`mlflow server --host 0.0.0.0 --port 5000`) or fix tracking.uri / MLFLOW_TRACKING_URI",
            transient=err[1],
        )
    elif uri.startswith("file:") or "://" not in uri:
        directory = Path(uri.split("file://", 1)[-1]).expanduser().resolve()
    else:
        return Check("mlflow", True, f"{uri}: scheme not probed by the doctor")
    if not directory.exists():
        return Check("mlflow", False, f"directory {directory} of {uri} does not exist", fix_dir)
    if not os.access(directory, os.W_OK):
        return Check("mlflow", False, f"directory {directory} of {uri} is not writable", fix_dir)
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".kc-doctor-"):
            pass
    except OSError as exc:
        return Check("mlflow", False, f"cannot create files in {directory}: {exc}", fix_dir)
    if uri.startswith("sqlite:"):
        problem = probe_sqlite(str(Path(path).expanduser()))
        if problem is not None and problem.kind == LOCKED:
            wait = setting(cfg, "tracking.store_wait_s", None)
            waits = f"up to {float(wait):.0f} s" if wait is not None else "up to tracking.store_wait_s"
            return Check("mlflow", True, f"{uri}: locked by another process now (a job waits {waits} for it)")
        if problem is not None:
            err = store_error(uri, problem)
            return Check("mlflow", False, f"{err.field}: the MLflow store {uri} {err.problem}", err.fix)
    return Check("mlflow", True, f"{uri}: {directory} writable")


def profile_api_url() -> str | None:
    """``PREFECT_API_URL`` of the active Prefect profile (``$PREFECT_PROFILE``, else the ``active`` one of
    ``$PREFECT_HOME/profiles.toml``, default ``~/.prefect``), read without importing Prefect; None when unset."""
    import tomllib

    home = Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()
    try:
        data = tomllib.loads((home / "profiles.toml").read_text(encoding="utf-8")[: 1 << 20])
    except (OSError, ValueError):
        return None
    name = os.environ.get("PREFECT_PROFILE") or data.get("active")
    profile = data.get("profiles", {}).get(name) if isinstance(data.get("profiles"), dict) else None
    url = profile.get("PREFECT_API_URL") if isinstance(profile, dict) else None
    return url if isinstance(url, str) and url else None


def check_prefect(timeout: float = CONNECT_TIMEOUT_S, hooks: RunHooks = NO_HOOKS) -> Check:
    """The Prefect API named by ``PREFECT_API_URL`` answers ``/health``; without it the ephemeral API is used.
    ``hooks``: the orchestrator's, whose in-process settings (an active test harness's) may name the API."""
    api = os.environ.get("PREFECT_API_URL") or profile_api_url()
    if not api:
        try:
            api = hooks.api_url()
        except Exception:
            api = None
    if not api:
        return Check("prefect", True, "PREFECT_API_URL not set: flows use Prefect's ephemeral local API")
    err = _http_health(api.rstrip("/") + "/health", timeout)
    if err is None:
        return Check("prefect", True, f"{api} healthy")
    return Check(
        "prefect",
        False,
        f"Prefect API {api} not reachable: {err[0]}",
        "start the server (`prefect server start`) or unset PREFECT_API_URL (the environment's or the active Prefect "
        "profile's) to use the ephemeral API",
        transient=err[1],
    )
