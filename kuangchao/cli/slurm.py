"""``kc slurm script CONFIG``: an example batch script that runs ``kc train`` inside its own Slurm allocation.

Inside an allocation (``SLURM_JOB_ID`` set), ``kc train`` with ``cluster.mode: slurm`` runs its ``srun`` step on
the allocation's nodes instead of submitting a job of its own (issue 32 §2); this prints a script that does that,
with the ``#SBATCH`` lines from ``cluster.slurm``.
"""

from __future__ import annotations

import typer

slurm_app = typer.Typer(help="Run on Slurm (cluster.mode: slurm).", no_args_is_help=True)


@slurm_app.command("script")
def script(
    config: str = typer.Argument(..., help="The job's YAML config (cluster.mode: slurm)."),
    overrides: list[str] = typer.Option([], "--set", help="Override a config value (dotted.key=value)."),
) -> None:
    """Print a batch script that runs ``kc train --config CONFIG`` inside the allocation it asks for."""
    from kuangchao_core.config import load_config
    from kuangchao_core.errors import ConfigError
    from kuangchao_core.sched.slurm.script import example_script, secret_warnings

    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        typer.echo(f"kc slurm script: {exc}", err=True)
        raise typer.Exit(2) from None
    if cfg.cluster.mode != "slurm":
        typer.echo(f"kc slurm script: {config}: cluster.mode is {cfg.cluster.mode}, not slurm", err=True)
        raise typer.Exit(2)
    for warning in secret_warnings(cfg.cluster.slurm):
        typer.echo(f"kc slurm script: {config}: {warning}", err=True)
    typer.echo(example_script(cfg, config, overrides), nl=False)


def register(app: typer.Typer) -> None:
    """Attach ``kc slurm``."""
    app.add_typer(slurm_app, name="slurm")
