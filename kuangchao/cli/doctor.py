"""``kc doctor``: check versions, Gloo, nodes, checkpoint storage, endpoints and the Slurm path; print a fix for each
failure."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def _load(config: Path | None, overrides: list[str]):
    if config is None:
        return None
    from kuangchao_core.config import load_config

    return load_config(str(config), list(overrides or []))


def doctor(
    config: Path | None = typer.Option(None, "--config", "-c", help="Job config YAML whose cluster/storage to check."),
    overrides: list[str] = typer.Option([], "--set", help="Config override a.b=c (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    serve: bool = typer.Option(False, "--serve", help="Run the version agent on this node for other nodes' doctor."),
    port: int | None = typer.Option(None, "--port", help="Agent port for --serve (default KC_DOCTOR_PORT or 29411)."),
    slurm: bool | None = typer.Option(
        None, "--slurm/--no-slurm", help="Check the Slurm path (default: when the config says cluster.mode: slurm)."
    ),
) -> None:
    """Check this machine and the configured cluster; exit 0 when every check passes, 1 otherwise."""
    from kuangchao_core.errors import ConfigError
    from kuangchao_core.sched import doctor as doc

    if serve:
        agent_port = port or doc.DEFAULT_AGENT_PORT
        typer.echo(f"kc doctor agent listening on 0.0.0.0:{agent_port}")
        doc.serve_versions("0.0.0.0", agent_port)
        return
    try:
        cfg = _load(config, overrides)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    report = doc.run_doctor(cfg, slurm=slurm)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="kc doctor")
        table.add_column("check")
        table.add_column("result")
        table.add_column("detail", overflow="fold")
        for c in report.checks:
            result = "[bold red]FAIL[/]" if not c.ok else "[yellow]warn[/]" if c.warn else "[green]ok[/]"
            table.add_row(c.name, result, c.detail)
        console = Console()
        console.print(table)
        for c in report.failed:
            console.print(f"[bold red]{c.name}[/]: fix: {c.fix}")
        for c in report.warnings:
            console.print(f"[yellow]{c.name}[/] (warning): fix: {c.fix}")
        console.print(
            "[green]all checks passed[/]" if report.ok else f"[bold red]{len(report.failed)} check(s) failed[/]"
        )
    raise typer.Exit(0 if report.ok else 1)


def register(app: typer.Typer) -> None:
    """Add the ``doctor`` command to the ``kc`` app."""
    app.command("doctor")(doctor)
