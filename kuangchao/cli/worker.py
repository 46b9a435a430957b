"""``kc worker start``: Prefect's process worker for kc's deployments, stopped by SIGTERM (issue 45 item 4).

``prefect worker start … &``, as the README's server section ran it, ignored ``kill %1``: Prefect's command turns its
first SIGTERM into a SIGINT to itself, and a command started in the background of a non-interactive shell inherits
SIGINT ignored, so the SIGINT never arrived (a second SIGTERM killed it outright). This command runs the same
worker (:class:`prefect.workers.process.ProcessWorker`) and takes SIGTERM and SIGINT itself, whatever it inherited:
the first stops polling, lets the worker's own teardown run (it deregisters nothing the API needs; flow runs it
started go on in their own processes) and exits ``128 + N``.
"""

from __future__ import annotations

import asyncio
import signal

import typer

worker_app = typer.Typer(help="Prefect's process worker for kc's deployments.", no_args_is_help=True)


@worker_app.command("start")
def start(
    pool: str = typer.Option(..., "--pool", help="The process work pool to poll (created if missing)."),
    name: str = typer.Option(None, "--name", help="The worker's name (default: Prefect's)."),
) -> None:
    """Run a Prefect process worker of POOL until SIGTERM or Ctrl-C."""
    from kuangchao_core.obs import voice

    stopped: list[int] = []
    try:
        asyncio.run(_serve(pool, name, stopped))
    except KeyboardInterrupt:  # a SIGINT before the loop took the signals
        stopped.append(signal.SIGINT)
    if stopped:
        _drain(timeout_s=3.0)  # its last events and logs sent now, not reported as still pending at exit
        voice.result(f"kc worker: stopped by {signal.Signals(stopped[0]).name}")
        raise typer.Exit(128 + stopped[0])


async def _serve(pool: str, name: str | None, stopped: list[int]) -> None:
    """The worker until a signal: each of SIGTERM and SIGINT cancels it (noted in ``stopped``)."""
    from prefect.workers.process import ProcessWorker

    from kuangchao_core.obs import voice

    loop = asyncio.get_running_loop()
    main = asyncio.current_task()

    def stop(signum: int) -> None:
        if not stopped:
            stopped.append(signum)
            main.cancel()

    for signum in (signal.SIGTERM, signal.SIGINT):  # replaces an inherited "ignore" too
        loop.add_signal_handler(signum, stop, signum)
    try:
        worker = ProcessWorker(work_pool_name=pool, name=name, create_pool_if_not_found=True)
        await worker.start(printer=lambda line: voice.say(line, source="prefect"))
    except asyncio.CancelledError:
        if not stopped:
            raise


def _drain(timeout_s: float) -> None:
    """Prefect's event and log workers: what they hold sent to the API within ``timeout_s`` each."""
    import contextlib

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (EventsWorker, APILogWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=timeout_s)


def register(app: typer.Typer) -> None:
    """Attach ``kc worker``."""
    app.add_typer(worker_app, name="worker")
