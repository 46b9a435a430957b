"""``kc audit``: query and verify a task's permission audit logs (SPEC L5.6).

    kc audit --task NAME [--since DATE] [--action deny|allow|all] [--module M] [--json] [--verify] [--log PATH]

Lines look like ``2024-01-15 10:23:45 | worker-3 | memory_alloc | DENIED | token expired (memory:params)``
(UTC). Logs are found under ``--log`` (a file, or a directory holding ``<task>/*.jsonl``), else under the
``permission.audit_log`` of ``--config``, else ``audit/<task>/``. ``--verify`` checks the hash chain and the signed
checkpoints (with ``<log>.trust.json`` or ``--trust-store``) and names the first bad record; exit code 1 if any log
fails, 2 for bad arguments.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import typer

from kuangchao_core.perm.audit_verify import read_records, verify_log
from kuangchao_core.perm.reasons import phrase
from kuangchao_core.perm.tokens import TrustStore

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


def find_logs(task: str | None, log: Path | None, config: Path | None) -> list[Path]:
    """The audit log files of ``task`` (see module docstring for the search order)."""
    if log is not None and log.is_file():
        return [log]
    base = log
    if base is None and config is not None:
        from kuangchao_core.config import load_config

        cfg = load_config(str(config))
        setting = cfg.permission.audit_log
        task = task or cfg.task.name
        if setting and "{" in setting:
            pattern = setting.format(task=task, job_id="*")
            return (
                sorted(Path().glob(pattern))
                if not Path(pattern).is_absolute()
                else sorted(Path("/").glob(pattern.lstrip("/")))
            )
        base = Path(setting) if setting else None
    base = base or Path("audit")
    if task is None:
        return sorted(base.glob("*/*.jsonl"))
    return sorted((base / task).glob("*.jsonl"))


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
) -> None:
    """Print or verify a task's permission decisions."""
    if action not in ("deny", "allow", "all"):
        typer.echo(f"error: --action must be deny, allow or all, not {action!r}", err=True)
        raise typer.Exit(2)
    if task is None and log is None and config is None:
        typer.echo("error: give --task NAME (or --log PATH / --config FILE)", err=True)
        raise typer.Exit(2)
    try:
        cutoff = parse_since(since)
    except ValueError:
        typer.echo(f"error: --since {since!r} is not a date (2024-01-15, 2024-01-15T10:00:00Z) or age (2h)", err=True)
        raise typer.Exit(2) from None
    logs = find_logs(task, log, config)
    if not logs:
        where = log or "audit/"
        typer.echo(f"error: no audit log for task {task!r} under {where}; pass --log PATH or --config FILE", err=True)
        raise typer.Exit(2)
    if verify:
        raise typer.Exit(_verify(logs, trust_store, as_json))
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


def _verify(logs: list[Path], trust_store: Path | None, as_json: bool) -> int:
    failed = 0
    for path in logs:
        ts_path = trust_store or Path(f"{path}.trust.json")
        ts = TrustStore.load(ts_path) if ts_path.exists() else None
        report = verify_log(path, trust_store=ts)
        failed += not report.ok
        if as_json:
            typer.echo(json.dumps({"log": str(path), **report.to_json()}, sort_keys=True))
            continue
        if report.ok:
            typer.echo(f"OK {path}: {report.records} records, {report.checkpoints} signed checkpoints")
        else:
            line = f" (line {report.first_bad_line})" if report.first_bad_line else ""
            typer.echo(f"TAMPERED {path}: first bad record seq {report.first_bad_seq}{line}: {report.problem}")
            typer.echo(f"  {report.detail}")
        for w in report.warnings:
            typer.echo(f"  warning: {w}")
    return 1 if failed else 0


def register(app: typer.Typer) -> None:
    """Add ``kc audit`` to the CLI."""
    app.command("audit")(audit)
