"""``kc plan --config FILE``: explain a job's parallel layout before anything runs, or list why it cannot run.

Exit 0 with the plan (groups, stages, micro-batches, bubble, memory per rank); exit 2 listing every config or plan
problem as ``FILE: dotted.path: message``.
"""

from __future__ import annotations

import json

import typer

from kuangchao_core.config import load_config
from kuangchao_core.errors import ConfigError

_SET_HELP = "Override one setting, e.g. --set parallel.tensor_parallel_size=2 (repeatable; the value is read as YAML)."


def plan(
    config: str = typer.Option(..., "--config", "-c", help="Job config YAML file."),
    set_: list[str] = typer.Option([], "--set", help=_SET_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON object."),
) -> None:
    """Explain the layout: TP/PP/DP groups, layers per (virtual) stage, micro-batches, bubble, memory per rank."""
    from kuangchao_core.engine.plan import check_plan, explain_plan, format_plan

    try:
        cfg = load_config(config, set_)
        errors = check_plan(cfg)
    except ConfigError as exc:
        errors = exc.errors
    if errors:
        for path, message in errors:
            typer.echo(f"{config}: {path}: {message}", err=True)
        typer.echo(f"{config}: {len(errors)} plan problem(s); nothing was started", err=True)
        raise typer.Exit(2)
    result = explain_plan(cfg)
    typer.echo(json.dumps(result) if as_json else format_plan(result))


def register(app: typer.Typer) -> None:
    """Add ``kc plan`` to the CLI."""
    app.command("plan")(plan)
