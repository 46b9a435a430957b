"""``kc audit``: query and verify a task's permission audit logs (SPEC L5.6).

    kc audit --task NAME [--since DATE] [--action deny|allow|all] [--module M] [--json] [--verify] [--log PATH]
    kc audit --verify --run RUN_DIR [--job-id ID] [--mode enforcing|trusted] [--pins FILE] [--log PATH]
             [--tracking-uri URI] [--pin-store DIR] [--allow-unsealed]

Lines look like ``2024-01-15 10:23:45 | worker-3 | memory_alloc | DENIED | token expired (memory:params)``
(UTC). Logs are found under ``--log`` (a file, or a directory holding ``<task>/*.jsonl``), else the ones the run's
pins name (``--run``), else under the ``permission.audit_log`` of ``--config``, else ``audit/<task>/``. ``--verify``
checks the hash chain and the signed checkpoints and names the first bad record. Every verifying form reads the
audit pins kept outside the run directory (:mod:`kuangchao_core.perm.audit_external`: the append-only pin store of
``--pin-store`` / ``$KC_AUDIT_PIN_STORE``, the MLflow store of
``--tracking-uri`` / ``$KC_TRACKING_URI`` / ``$MLFLOW_TRACKING_URI``, the configured Prefect API, and ``--pins``);
pins are found by the job id the log names, never by its path alone; the job, mode and audit key come from them (:mod:`kuangchao_core.perm.audit_trust`), the run's own files are only
compared with them. An enforcing job fails without them, and fails unless its log ends at the pin the job sealed it
with (``--allow-unsealed`` for a job still running). Pins or anchors whose log is gone fail too. Exit code 1 if any
log fails, 2 for bad arguments.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import typer

from kuangchao_core.perm.audit_trust import (
    MODES,
    AuditTrust,
    ExternalPins,
    missing_log_report,
    orphaned_logs,
    run_log_paths,
    trust_for_log,
    trust_for_run,
    verify_with_trust,
    with_log_job_pins,
)
from kuangchao_core.perm.audit_verify import VerifyReport, read_records
from kuangchao_core.perm.reasons import phrase

_DECISION_WORD = {"deny": "DENIED", "allow": "ALLOWED", "info": "INFO"}
_RELATIVE = re.compile(r"(\d+)([smhd])\Z")


def parse_since(text: str | None) -> datetime | None:
    """``2024-01-15``, ``2024-01-15T10:00:00[Z]`` or a relative age (``30m``, ``2h``, ``7d``) -> aware UTC datetime."""
    if not text:
        return None
    m = _RELATIVE.match(text.strip())
    if m:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m.group(2)]
        return datetime.now(timezone.utc) - timedelta(**{unit: int(m.group(1))})
    dt = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def _record_time(rec: dict) -> datetime | None:
    try:
        return datetime.fromisoformat(str(rec.get("ts", "")).replace("Z", "+00:00"))
    except ValueError:
        return None


def format_line(rec: dict) -> str:
    """One record in the original's format: ``time | module | operation | RESULT | reason``."""
    t = _record_time(rec)
    when = t.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if t else "?"
    decision = _DECISION_WORD.get(rec.get("decision"), str(rec.get("decision", "?")).upper())
    reason = rec.get("reason") or ""
    if rec.get("decision") == "allow":
        reason = f"{rec.get('count')} uses" if reason == "count" else reason.replace("_", " ")
    else:
        reason = phrase(reason) if reason else ""
    if rec.get("resource"):
        reason = f"{reason} ({rec['resource']})" if reason else rec["resource"]
    return f"{when} | {rec.get('actor', '?')} | {rec.get('action', '?')} | {decision} | {reason}"


def find_logs(task: str | None, log: Path | None, config: Path | None, suffix: str = "") -> list[Path]:
    """The audit log files of ``task`` (see module docstring for the search order); with ``suffix`` the files
    named like a log plus ``suffix`` (``.anchors``: the signed checkpoints)."""
    if log is not None and log.is_file() and not suffix:
        return [log]
    base = log
    if base is None and config is not None:
        from kuangchao_core.config import load_config

        cfg = load_config(str(config))
        setting = cfg.permission.audit_log
        task = task or cfg.task.name
        if setting and "{" in setting:
            pattern = setting.format(task=task, job_id="*") + suffix
            return (
                sorted(Path().glob(pattern))
                if not Path(pattern).is_absolute()
                else sorted(Path("/").glob(pattern.lstrip("/")))
            )
        base = Path(setting) if setting else None
    base = base or Path("audit")
    if task is None:
        return sorted(base.glob(f"*/*.jsonl{suffix}"))
    return sorted((base / task).glob(f"*.jsonl{suffix}"))


def _anchored_logs(task: str | None, log: Path | None, config: Path | None) -> list[Path]:
    """Every log path that has signed checkpoints (existing or not), for finding anchors without a log."""
    if log is not None and not log.is_dir():
        return [log]
    return [Path(str(p)[: -len(".anchors")]) for p in find_logs(task, log, config, suffix=".anchors")]


def audit(
    task: str = typer.Option(None, "--task", help="Task name (task.name of the job config)."),
    since: str = typer.Option(None, "--since", help="Only records at or after DATE (ISO date/time, or 30m, 2h, 7d)."),
    action: str = typer.Option("all", "--action", help="deny | allow | all"),
    module: str = typer.Option(None, "--module", help="Only this module id (worker-3, data_loader-0, monitor)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON lines (the records) instead of text."),
    verify: bool = typer.Option(False, "--verify", help="Verify hash chains and signed checkpoints."),
    log: Path = typer.Option(None, "--log", help="An audit log file, or the directory holding <task>/*.jsonl."),
    config: Path = typer.Option(None, "--config", help="Job config whose permission.audit_log says where logs are."),
    trust_store: Path = typer.Option(None, "--trust-store", help="Public keys for checkpoint signatures."),
    run: Path = typer.Option(
        None, "--run", help="The job's run directory: its job_id and the authority's trust store and audit pins."
    ),
    job_id: str = typer.Option(None, "--job-id", help="The job the log must belong to (default: <run>/job_id)."),
    mode: str = typer.Option(
        None, "--mode", help="enforcing | trusted; enforcing fails without trust store, checkpoints and pins."
    ),
    pins: Path = typer.Option(None, "--pins", help="Audit pins to check too (e.g. MLflow's audit/pins.json)."),
    tracking_uri: str = typer.Option(
        None, "--tracking-uri", help="The MLflow store holding the job's pins (default $KC_TRACKING_URI)."
    ),
    pin_store: str = typer.Option(
        None, "--pin-store", help="An append-only audit pin store directory (default $KC_AUDIT_PIN_STORE)."
    ),
    allow_unsealed: bool = typer.Option(
        False, "--allow-unsealed", help="Accept a log its job has not sealed yet (a job still running)."
    ),
) -> None:
    """Print or verify a task's permission decisions."""
    if action not in ("deny", "allow", "all"):
        typer.echo(f"error: --action must be deny, allow or all, not {action!r}", err=True)
        raise typer.Exit(2)
    if mode is not None and mode not in MODES:
        typer.echo(f"error: --mode must be enforcing or trusted, not {mode!r}", err=True)
        raise typer.Exit(2)
    if task is None and log is None and config is None and run is None:
        typer.echo("error: give --task NAME (or --log PATH / --config FILE / --run RUN_DIR)", err=True)
        raise typer.Exit(2)
    try:
        cutoff = parse_since(since)
    except ValueError:
        typer.echo(f"error: --since {since!r} is not a date (2024-01-15, 2024-01-15T10:00:00Z) or age (2h)", err=True)
        raise typer.Exit(2) from None
    external = None
    if verify:
        from kuangchao.cli.prefect_artifacts import PREFECT_ARTIFACTS
        from kuangchao_core.perm.audit_external import collect_external_pins

        external = collect_external_pins(tracking_uri, prefect=PREFECT_ARTIFACTS, pin_store=pin_store)
    run_trust = None
    if run is not None:
        if not run.is_dir():
            typer.echo(
                f"error: --run {run}: not a directory; pass the run directory of a job (runs/<task>/<run>)", err=True
            )
            raise typer.Exit(2)
        try:
            run_trust = trust_for_run(
                run,
                job_id=job_id,
                mode=mode,
                trust_store=trust_store,
                pins_file=pins,
                external=external,
                allow_unsealed=allow_unsealed,
            )
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
    if run_trust is not None and log is None:
        candidates = run_log_paths(run, run_trust)
        logs = [p for p in candidates if p.is_file()]
    else:
        logs = find_logs(task, log, config)
        candidates = _anchored_logs(task, log, config) if verify else []
    missing = _missing_logs(candidates, run_trust) if verify else []
    if verify and run_trust is None:  # logs of the task that pins outside the run name, deleted since
        missing += [p for p in _pinned_logs(external, task, logs) if all(p != m.resolve() for m in missing)]
    if not logs and not missing:
        if run_trust is not None and log is None:
            typer.echo(
                f"error: {run}: no audit pins or config.yaml name the job's audit log; pass --log PATH", err=True
            )
        else:
            where = log or "audit/"
            typer.echo(
                f"error: no audit log for task {task!r} under {where}; pass --log PATH or --config FILE", err=True
            )
        raise typer.Exit(2)
    if verify:

        def trust_of(path: Path) -> AuditTrust:
            if run_trust is not None:
                return with_log_job_pins(run_trust, path, external) if log is not None else run_trust
            return trust_for_log(
                path,
                job_id=job_id,
                mode=mode,
                trust_store=trust_store,
                pins_file=pins,
                external=external,
                allow_unsealed=allow_unsealed,
            )

        raise typer.Exit(_verify(logs, missing, trust_of, as_json))
    shown = 0
    for path in logs:
        for rec in read_records(path):
            if action != "all" and rec.get("decision") != action:
                continue
            if module and rec.get("actor") != module:
                continue
            if cutoff is not None:
                t = _record_time(rec)
                if t is None or t < cutoff:
                    continue
            typer.echo(json.dumps(rec, sort_keys=True) if as_json else format_line(rec))
            shown += 1
    if not as_json:  # JSON lines stay pure records; people get the count, "0 denials" included
        what = {"deny": "denials", "allow": "allowed decisions", "all": "records"}[action]
        typer.echo(f"{shown} {what} in {len(logs)} audit log{'s' if len(logs) != 1 else ''}")


def _pinned_logs(external: ExternalPins | None, task: str | None, logs: list[Path]) -> list[Path]:
    """The logs of ``task`` that pins outside the run name but that are not among ``logs`` (deleted ones)."""
    if external is None or not task:
        return []
    have = {p.resolve() for p in logs}
    out: list[Path] = []
    for pin, _ in external.for_task(task):
        path = Path(pin.log_path)
        if not path.exists() and path.resolve() not in have and path not in out:
            out.append(path)
    return out


def _missing_logs(candidates: list[Path], trust: AuditTrust | None) -> list[Path]:
    """Logs that are gone while their anchors (or, with a run, their pins) remain."""
    missing = orphaned_logs(candidates)
    for pin in trust.pins if trust else []:
        path = Path(pin.log_path)
        if not path.exists() and all(path.resolve() != m.resolve() for m in missing):
            missing.append(path)
    return missing


def _verify(logs: list[Path], missing: list[Path], trust_of, as_json: bool) -> int:
    failed = 0
    for path in logs:
        trust = trust_of(path)
        report = verify_with_trust(path, trust)
        failed += not report.ok
        _show(path, report, trust, as_json)
    for path in missing:
        trust = trust_of(path)
        failed += 1
        _show(path, missing_log_report(path, trust), trust, as_json)
    return 1 if failed else 0


def _show(path: Path, report: VerifyReport, trust: AuditTrust, as_json: bool) -> None:
    if as_json:
        extra = {"log": str(path), "mode": trust.mode, "pinned": trust.pinned}
        typer.echo(json.dumps({**extra, **report.to_json()}, sort_keys=True))
        return
    if report.ok:
        pinned = f"; pinned head seq {max(p.seq for p in trust.pins)}" if trust.pinned else ""
        typer.echo(f"OK {path}: {report.records} records, {report.checkpoints} signed checkpoints{pinned}")
    elif report.first_bad_seq is not None:
        line = f" (line {report.first_bad_line})" if report.first_bad_line else ""
        typer.echo(f"TAMPERED {path}: first bad record seq {report.first_bad_seq}{line}: {report.problem}")
        typer.echo(f"  {report.detail}")
    else:
        typer.echo(f"FAILED {path}: {report.problem}")
    for problem in report.trust_problems:
        typer.echo(f"  {problem['problem']}: {problem['detail']}")
    for w in report.warnings:
        typer.echo(f"  warning: {w}")


def register(app: typer.Typer) -> None:
    """Add ``kc audit`` to the CLI."""
    app.command("audit")(audit)
