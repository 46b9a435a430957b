"""``kc config show|validate``: print a resolved job config, or check one without starting anything."""

from __future__ import annotations

import typer

from kuangchao_core.config import JobConfig, load_config
from kuangchao_core.errors import ConfigError

config_app = typer.Typer(
    name="config",
    help="Inspect job configs: print the resolved YAML or validate it. Nothing is started.",
    no_args_is_help=True,
    add_completion=False,
)

_SET_HELP = "Override one setting, e.g. --set optimizer.lr=1e-4 (repeatable; the value is read as YAML)."


def _load_or_exit(file: str, overrides: list[str]) -> JobConfig:
    try:
        return load_config(file, overrides)
    except ConfigError as exc:
        for path, message in exc.errors:
            typer.echo(f"{file}: {path}: {message}", err=True)
        typer.echo(f"{file}: {len(exc.errors)} error(s); fix them and run `kc config validate {file}` again", err=True)
        raise typer.Exit(2) from None


@config_app.command("show")
def show(
    file: str = typer.Argument(..., help="Job config YAML file."),
    set_: list[str] = typer.Option([], "--set", help=_SET_HELP),
) -> None:
    """Print the resolved config (extends merged, overrides applied, defaults filled) as YAML."""
    cfg = _load_or_exit(file, set_)
    typer.echo(cfg.to_yaml(), nl=False)


@config_app.command("validate")
def validate(
    file: str = typer.Argument(..., help="Job config YAML file."),
    set_: list[str] = typer.Option([], "--set", help=_SET_HELP),
) -> None:
    """Check a config; exit 0 when valid, 2 listing every error as `FILE: dotted.path: message`."""
    cfg = _load_or_exit(file, set_)
    typer.echo(f"ok: {file} (world size {cfg.world_size})")


def register(app: typer.Typer) -> None:
    """Add the ``config`` command group to the ``kc`` app."""
    app.add_typer(config_app, name="config")
