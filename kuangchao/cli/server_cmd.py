"""``kc server start|status|stop``: a local Prefect server kept alive between runs, which ``kc train`` uses instead of
starting a temporary one each time (:mod:`kuangchao.cli.kept_server`, issue 45 item 2)."""

from __future__ import annotations

import typer

server_app = typer.Typer(help="A local Prefect server kept alive between kc train runs.", no_args_is_help=True)


@server_app.command("start")
def start(
    port: int = typer.Option(4200, "--port", help="The port of its API and UI on 127.0.0.1."),
) -> None:
    """Start the kept server (once); every kc train in this PREFECT_HOME then runs its flow on it."""
    from kuangchao.cli import kept_server
    from kuangchao_core.obs.voice import result

    record = kept_server.read_record()
    if record is not None and kept_server.answers(record.api_url):
        result(f"kc server: already running at {record.api_url} (pid {record.pid})")
        return
    configured = kept_server.configured_api_url()
    if configured:
        result(
            f"kc server: PREFECT_API_URL is set ({configured}): kc train uses that server, not a kept one", "WARNING"
        )
    try:
        record = kept_server.start(port)
    except RuntimeError as exc:
        result(f"kc server: {exc}", "ERROR")
        raise typer.Exit(1) from None
    result(
        f"kc server: Prefect server at {record.api_url} (UI {record.api_url.removesuffix('/api')}, pid {record.pid}, "
        f"log {record.log}); kc train uses it until `kc server stop`"
    )


@server_app.command("status")
def status() -> None:
    """Say whether the kept server runs (exit 0) or not (exit 1); a stale record is removed."""
    from kuangchao.cli import kept_server
    from kuangchao_core.obs.voice import result

    record = kept_server.read_record()
    if record is None:
        result("kc server: not running")
        raise typer.Exit(1)
    if not kept_server.answers(record.api_url):
        kept_server.stop(record)
        result(f"kc server: not running (the record of {record.api_url} was stale and is removed)")
        raise typer.Exit(1)
    result(f"kc server: running at {record.api_url} (pid {record.pid})")


@server_app.command("stop")
def stop() -> None:
    """Stop the kept server and remove its record."""
    from kuangchao.cli import kept_server
    from kuangchao_core.obs.voice import result

    record = kept_server.read_record()
    if record is None:
        result("kc server: not running")
        return
    kept_server.stop(record)
    result(f"kc server: stopped (pid {record.pid})")


def register(app: typer.Typer) -> None:
    """Attach ``kc server``."""
    app.add_typer(server_app, name="server")
