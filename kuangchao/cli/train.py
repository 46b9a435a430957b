"""``kc train``: run a training job end to end (the Prefect flow ``kuangchao-train``)."""

from __future__ import annotations

import json
import os
import sys

import typer

from kuangchao_core.errors import ConfigError, KuangchaoError


def register(app: typer.Typer) -> None:
    """Add ``kc train`` to the CLI."""

    @app.command("train")
    def train(
        config: str = typer.Option(..., "--config", "-c", help="Job YAML file."),
        set_: list[str] = typer.Option([], "--set", help="Override a field: --set parallel.data_parallel_size=2"),
        resume: str = typer.Option(
            None, "--resume", help="auto (newest intact checkpoint), never, or a step directory."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the run summary as JSON."),
    ) -> None:
        """Train: doctor, topology probe, data validation, tokens, launch with recovery, checkpoint verification."""
        from kuangchao_core.config import load_config
        from kuangchao_core.parallel.plan import raise_for_plan

        try:
            raise_for_plan(load_config(config, set_))
        except ConfigError as exc:  # PlanError too: bad layouts are refused before anything starts
            for path, msg in exc.errors:
                typer.echo(f"{exc.source or config}: {path}: {msg}", err=True)
            raise typer.Exit(2) from None
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        from flows.train import train_flow

        try:
            summary = train_flow(config_path=config, overrides=list(set_), resume=resume)
        except ConfigError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from None
        except KuangchaoError as exc:
            typer.echo(f"kc train failed: {exc}", err=True)
            raise typer.Exit(1) from None
        if as_json:
            typer.echo(json.dumps(summary, indent=2))
        else:
            _print_summary(summary)


def _print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kc train: run summary", show_header=False)
    for key, value in summary.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console(file=sys.stdout).print(table)
