"""``kc runs compare EXPERIMENT``: MLflow runs of an experiment side by side, and their loss curves as a PNG."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer


def collect_runs(experiment: str, tracking_uri: str, max_runs: int = 50) -> list[dict[str, Any]]:
    """One row per run of ``experiment`` (newest first): id, name, status, layout, steps, final loss, last eval loss,
    held-out exact match (``heldout_accuracy``, else the last ``eval_exact_match``), tokens/s, attempts, the registered model version (``tracking.register_model``) and the full per-step loss curve
    under ``loss_curve``."""
    from mlflow.tracking import MlflowClient

    from kuangchao_core.errors import KuangchaoError

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = ", ".join(e.name for e in client.search_experiments()) or "none"
        raise KuangchaoError(f"no MLflow experiment {experiment!r} in {tracking_uri}; experiments there: {names}")
    rows = []
    for run in client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=max_runs):
        curve = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
        tps = [m.value for m in client.get_metric_history(run.info.run_id, "tokens_per_s")]
        evals = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_loss"))
        matches = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_exact_match"))
        tags = run.data.tags
        registered = tags.get("kuangchao.registered_model")
        rows.append(
            {
                "run_id": run.info.run_id,
                "name": tags.get("mlflow.runName", run.info.run_id[:8]),
                "status": run.info.status,
                "layout": tags.get("kuangchao.layout"),
                "steps": curve[-1][0] if curve else 0,
                "final_loss": curve[-1][1] if curve else None,
                "eval_loss": evals[-1][1] if evals else None,
                # the final model's held-out exact match (the run summary's heldout_accuracy), else the last eval's
                "exact_match": run.data.metrics.get("heldout_accuracy", matches[-1][1] if matches else None),
                # the run summary's definition (tokens / step time over the run); runs logged before it: the median
                "tokens_per_s": run.data.metrics.get("tokens_per_s_mean", sorted(tps)[len(tps) // 2] if tps else None),
                "attempts": int(tags.get("kuangchao.attempts", tags.get("kuangchao.attempt", "0")) or 0) or None,
                "config_hash": tags.get("kuangchao.config_hash"),
                "flow_run_id": tags.get("prefect.flow_run_id"),
                "model_version": f"{registered} v{tags.get('kuangchao.model_version')}" if registered else None,
                "loss_curve": curve,
            }
        )
    return rows


def plot_loss(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Write a PNG of loss against step, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for row in rows:
        if row["loss_curve"]:
            steps, values = zip(*row["loss_curve"], strict=True)
            ax.plot(steps, values, label=f"{row['name']} ({row['layout']}, {row['status'].lower()})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    if rows:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def register(app: typer.Typer) -> None:
    """Add ``kc runs compare`` to the CLI."""
    runs_app = typer.Typer(help="Inspect and compare MLflow runs of training jobs.", no_args_is_help=True)
    app.add_typer(runs_app, name="runs")

    @runs_app.command("compare")
    def compare(
        experiment: str = typer.Argument(..., help="MLflow experiment (the task name unless tracking.experiment)."),
        tracking_uri: str = typer.Option("sqlite:///mlflow.db", "--tracking-uri", help="MLflow store."),
        as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON (with loss curves)."),
        plot: str = typer.Option(None, "--plot", help="Write a PNG of loss against step for every run."),
        max_runs: int = typer.Option(50, "--max-runs", help="At most this many runs, newest first."),
    ) -> None:
        """Show the runs of EXPERIMENT side by side: final loss, eval loss, held-out exact match, steps, tokens/s,
        layout, attempts, status and the registered model version."""
        from kuangchao_core.errors import KuangchaoError

        try:
            rows = collect_runs(experiment, tracking_uri, max_runs)
        except KuangchaoError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from None
        if plot:
            plot_loss(rows, plot, f"loss vs step: {experiment}")
        if as_json:
            typer.echo(json.dumps(rows, indent=2))
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"kc runs compare: {experiment}")
        cols = (
            "run",
            "status",
            "layout",
            "steps",
            "final loss",
            "eval loss",
            "exact match",
            "tokens/s",
            "attempts",
            "model",
            "config",
        )
        for col in cols:
            table.add_column(col)
        for r in rows:
            table.add_row(
                r["name"],
                r["status"],
                str(r["layout"]),
                str(r["steps"]),
                f"{r['final_loss']:.4f}" if r["final_loss"] is not None else "-",
                f"{r['eval_loss']:.4f}" if r["eval_loss"] is not None else "-",
                f"{100 * r['exact_match']:.1f} %" if r["exact_match"] is not None else "-",
                f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] is not None else "-",
                str(r["attempts"] or "-"),
                r["model_version"] or "-",
                (r["config_hash"] or "-")[:10],
            )
        # piped or captured output has no terminal width: let the rows stay whole rather than wrap at 80 columns
        Console(width=None if sys.stdout.isatty() else 200).print(table)
        from mlflow.tracking import MlflowClient

        from kuangchao_core.obs.tracking import experiment_ui_path

        exp = MlflowClient(tracking_uri=tracking_uri).get_experiment_by_name(experiment)
        typer.echo(
            f"in the MLflow UI (mlflow ui --backend-store-uri {tracking_uri}): "
            f"http://127.0.0.1:5000{experiment_ui_path(exp.experiment_id)}"
        )
        if plot:
            typer.echo(f"loss plot written to {plot}")
