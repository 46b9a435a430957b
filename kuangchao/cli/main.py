"""Entry point of the ``kc`` command: assembles the sub-command modules.

Each sub-command lives in its own module in this package and exposes ``register(app)``.
Exit codes: 0 success, 1 failure, 2 user error (bad config, bad arguments).
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

from kuangchao_core import __version__
from kuangchao_core.obs import voice

voice.environment()  # one voice on the console, no telemetry (issue 45 §3): before Prefect or MLflow is imported
# Prefect's temporary server (no PREFECT_API_URL) gets 20 s to start by default: a busy laptop or a 2-core CI
# machine can need more, and a job that never started is worse than a slow start
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

app = typer.Typer(
    name="kc",
    help="Kuangchao (狂潮) distributed training: train, inspect configs, plan layouts, audit, debug.",
    no_args_is_help=True,
    add_completion=False,
)

# sub-command modules, in help order; each defines register(app)
_COMMAND_MODULES = [
    "train",
    "launch",
    "config_cmd",
    "plan",
    "recommend",
    "data_cmd",
    "doctor",
    "checkpoint_cmd",
    "audit",
    "debug",
    "runs",
    "node",
    "worker",
    "server_cmd",
    "slurm",
    "topology",
    "operator_cmd",
    "token_cmd",
]


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"kc (kuangchao-distributed) {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version."
    ),
) -> None:
    """Kuangchao (狂潮) distributed training."""


def _modules_for(argv: list[str]) -> list[str]:
    """The command modules to load: run as ``kc <command> …`` (the ``kc`` script or ``python -m``), only that
    command's (each module registers the command named after it, less ``_cmd``): ``kc train`` does not import the
    other sixteen commands' dependencies, and its refusal stays within 3 s (issue 27 §2). Else, and for
    ``--help`` or a name no module has, every module, in help order."""
    if __name__ == "__main__" or os.path.basename(argv[0] if argv else "") == "kc":
        wanted = argv[1] if len(argv) > 1 else ""
        named = [m for m in _COMMAND_MODULES if m.removesuffix("_cmd") == wanted]
        if named:
            return named
    return _COMMAND_MODULES


for _name in _modules_for(sys.argv):
    try:
        _mod = importlib.import_module(f"kuangchao.cli.{_name}")
    except ModuleNotFoundError as exc:  # a command module not written yet
        if exc.name != f"kuangchao.cli.{_name}":
            raise
        continue
    _mod.register(app)


def main() -> None:
    """Run the ``kc`` CLI."""
    app()


if __name__ == "__main__":
    main()
