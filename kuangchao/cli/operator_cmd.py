"""``kc operator``: your operator key, with which you change running jobs (``kc config set``, ``kc token revoke``),
and the append-only audit pin store an operator creates for jobs (``kc operator pin-store``)."""

from __future__ import annotations

import typer

operator_app = typer.Typer(help="Your operator key: create it, show its public half for permission.operators.")


@operator_app.command("init")
def init_cmd(
    name: str = typer.Option(None, "--name", help="The name audit records give you (default $USER)."),
    key_file: str = typer.Option(None, "--key", help="Where to keep it (default $KC_OPERATOR_KEY or ~/.config/...)."),
) -> None:
    """Create your operator key (an Ed25519 key in a 0600 file outside every run directory). Exit 1 if one exists."""
    from kuangchao_core.errors import KuangchaoError
    from kuangchao_core.perm.operator import create_operator_key, operator_key_path

    path = key_file or str(operator_key_path())
    try:
        key = create_operator_key(path, name)
    except FileExistsError:
        typer.echo(f"{path}: an operator key exists already (`kc operator show` prints it)", err=True)
        raise typer.Exit(1) from None
    except KuangchaoError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    typer.echo(f"operator key {key.kid} ({key.name}) written to {path}")
    typer.echo(f"trust it in a job with  permission.operators: [{key.public.spec()}]")


@operator_app.command("show")
def show_cmd(
    key_file: str = typer.Option(None, "--key", help="The key file (default $KC_OPERATOR_KEY or ~/.config/...)."),
) -> None:
    """Print the public half of your operator key as `NAME:PUBLIC_KEY` (what permission.operators takes)."""
    from kuangchao_core.errors import KuangchaoError
    from kuangchao_core.perm.operator import load_operator_key

    try:
        key = load_operator_key(key_file)
    except KuangchaoError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    typer.echo(key.public.spec())


@operator_app.command("pin-store")
def pin_store_cmd(
    directory: str = typer.Argument(..., help="The store's directory (created, root-owned, mode 0755)."),
    owner: str = typer.Option(None, "--owner", help="The user jobs run as: owns pins.jsonl, may only append to it."),
) -> None:
    """Create an append-only audit pin store (run as root): jobs name it in permission.pin_store, `kc audit --verify`
    reads it with --pin-store. Exit 1 when the kernel refuses the append-only flag."""
    import pwd

    from kuangchao_core.perm.pin_store import PinStoreError, init_store

    try:
        uid = pwd.getpwnam(owner).pw_uid if owner else None
    except KeyError:
        typer.echo(f"--owner {owner!r}: no such user", err=True)
        raise typer.Exit(2) from None
    try:
        path = init_store(directory, uid)
    except PinStoreError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"append-only audit pin store {path} (owner {owner or 'unchanged'})")
    typer.echo(f"name it in a job with  permission.pin_store: {directory}  (or export KC_AUDIT_PIN_STORE={directory})")


def register(app: typer.Typer) -> None:
    """Add the ``operator`` command group to the ``kc`` app."""
    app.add_typer(operator_app, name="operator")
