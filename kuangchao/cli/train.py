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
        if_finished: str = typer.Option(
            "error",
            "--if-finished",
            help="When the resume checkpoint is already at train.steps: error (default), skip (train nothing) or "
            "restart (a new lineage from the start).",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the run summary as JSON."),
    ) -> None:
        """Train: doctor, topology probe, data validation, tokens, launch with recovery, checkpoint verification.

        Each run writes its checkpoints into its own lineage under <checkpoint.dir>/<task>/; --resume auto
        continues the newest lineage, --resume never starts a new one (the old ones stay as they are)."""
        from kuangchao_core.config import load_config
        from kuangchao_core.engine.plan import raise_for_plan
        from kuangchao_core.obs.model_registry import MODEL_URI_PREFIX

        try:
            cfg = load_config(config, set_)
            # a registered base (models:/NAME@ALIAS) has no local files yet: the flow resolves it, then checks the plan
            if not str(cfg.model.checkpoint or "").startswith(MODEL_URI_PREFIX):
                raise_for_plan(cfg)
        except ConfigError as exc:  # PlanError too: bad layouts are refused before anything starts
            for path, msg in exc.errors:
                typer.echo(f"{exc.source or config}: {path}: {msg}", err=True)
            raise typer.Exit(2) from None
        if if_finished not in ("error", "skip", "restart"):
            typer.echo(f"--if-finished must be error, skip or restart, got {if_finished!r}", err=True)
            raise typer.Exit(2)
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        unreachable = prefect_api_problem()
        if unreachable:
            typer.echo(f"kc train: {unreachable}", err=True)
            raise typer.Exit(1)
        from flows.train import train_flow
        from kuangchao.cli.failure_lines import failure_lines, quiet_expected_failures
        from kuangchao_core.obs.prefect_watch import exit_when_lost

        # a Prefect API lost during the run: one line and exit 1 once the flow has unwound (issue 26 §5);
        # one line per failure: Prefect's tracebacks of it stay in its API log
        try:
            with exit_when_lost(lambda line: typer.echo(line, err=True)), quiet_expected_failures():
                state = train_flow(
                    config_path=config, overrides=list(set_), resume=resume, if_finished=if_finished, return_state=True
                )
                summary = state.result()
        except KuangchaoError as exc:  # ConfigError, NothingToTrain, PlanError: exit 2; the others: exit 1
            lines, code = failure_lines(exc, config)
            for line in lines:
                typer.echo(line, err=True)
            raise typer.Exit(code) from None
        if state.name == "Skipped":
            typer.echo(f"kc train: {state.message}", err=True)
        if as_json:
            typer.echo(json.dumps(summary, indent=2))
        else:
            _print_summary(summary)


def prefect_api_problem(timeout_s: float = 3.0) -> str | None:
    """One line saying why the configured Prefect API cannot be used, or None (none configured, or it answers).

    Without ``PREFECT_API_URL`` the flow runs on Prefect's ephemeral local API, which needs no server."""
    import urllib.error
    import urllib.request

    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return None
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout_s):
            return None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return (
            f"the Prefect API at {url} does not answer ({reason}). Start that server (prefect server start), or run "
            "locally without one: prefect config unset PREFECT_API_URL (and unset the PREFECT_API_URL environment "
            "variable if it is set)"
        )


def _print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from kuangchao_core.obs.console import for_people

    table = Table(title="kc train: run summary", show_header=False)
    for key, value in summary.items():  # rounded for people; --json prints full precision
        table.add_row(key, for_people(value))
    Console(file=sys.stdout).print(table)
