"""``kc train``: run a training job end to end (the Prefect flow ``kuangchao-train``)."""

from __future__ import annotations

import json
import logging
import sys
import time

import typer

from kuangchao_core.errors import ConfigError, KuangchaoError, NothingToTrain


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
        quiet: bool = typer.Option(False, "--quiet", "-q", help="Only warnings, errors and the final line."),
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug lines too (Prefect's, MLflow's)."),
    ) -> None:
        """Train: doctor, topology probe, data validation, tokens, launch with recovery, checkpoint verification.

        Each run writes its checkpoints into its own lineage under <checkpoint.dir>/<task>/; --resume auto
        continues the newest lineage, --resume never starts a new one (the old ones stay as they are)."""
        from kuangchao.cli.interrupted import one_line_on_interrupt
        from kuangchao.cli.kept_server import use_kept_server
        from kuangchao_core.obs import voice

        if quiet and verbose:
            voice.result("kc train: --quiet and --verbose exclude each other", "ERROR")
            raise typer.Exit(2)
        if quiet or verbose:  # before Prefect is imported: its logging config reads the levels once
            voice.set_threshold("WARNING" if quiet else "DEBUG")
        logging.captureWarnings(True)  # Python's warnings as console lines too (source python)
        kept, stale = use_kept_server()  # `kc server start`'s server, before Prefect reads its settings
        note = (stale, "WARNING") if stale else (f"on the kept Prefect server {kept} (kc server start)", "INFO")
        with one_line_on_interrupt(config, list(set_)):  # Ctrl-C, SIGTERM: the ranks stopped, one line (issue 45)
            _train(config, set_, resume, if_finished, as_json, note if kept or stale else None)


def _train(
    config: str, set_: list[str], resume: str | None, if_finished: str, as_json: bool, server_note: tuple | None
) -> None:
    from kuangchao.cli.failure_lines import failure_lines
    from kuangchao_core.obs import phases
    from kuangchao_core.obs.voice import result, say

    clock = phases.begin(phases.process_start_time())  # the run summary's start-up phases (issue 27 §2)
    clock.since("imports", clock.origin)  # the interpreter and the CLI's modules
    if if_finished not in ("error", "skip", "restart"):
        result(f"kc train: --if-finished must be error, skip or restart, got {if_finished!r}", "ERROR")
        raise typer.Exit(2)
    try:
        with clock.phase("config"):
            cfg = refuse_early(config, set_, resume, if_finished)
    except ConfigError as exc:  # PlanError too: bad layouts are refused before anything starts
        if isinstance(exc, NothingToTrain):  # the same line as when the flow refuses it
            for line in failure_lines(exc, config)[0]:
                result(line, "ERROR")
            raise typer.Exit(2) from None
        for path, msg in exc.errors:
            result(f"{exc.source or config}: {path}: {msg}", "ERROR")
        raise typer.Exit(2) from None
    except KuangchaoError as exc:  # an unreadable --resume directory, a corrupt tracking store: exit 1
        lines, code = failure_lines(exc, config)
        for line in lines:
            result(line, "ERROR")
        raise typer.Exit(code) from None
    del cfg  # the flow loads the config again, with its Prefect block references resolved
    with clock.phase("prefect"):
        if server_note:  # after the config's checks: a refusal stays one line
            say(f"kc train: {server_note[0]}", server_note[1])
        unreachable = prefect_api_problem()
        if unreachable:
            result(f"kc train: {unreachable}", "ERROR")
            raise typer.Exit(1)
        server = start_temporary_server()  # its start overlaps the flow's imports; it dies with this process
    from kuangchao_core.sched.doctor import start_gloo_check

    start_gloo_check()  # the doctor's Gloo processes start now too (the flow's doctor takes their result)
    with clock.phase("imports"):
        from flows.train import train_flow
        from kuangchao.cli.failure_lines import quiet_expected_failures
        from kuangchao.cli.interrupted import say_interrupted
        from kuangchao_core.obs.prefect_watch import exit_when_lost, write_summary
        from kuangchao_core.sched import interrupt
    if server is not None:
        with clock.phase("prefect"):
            server.join()  # before the flow's client looks for the server

    # a Prefect API lost during the run: one line and exit 1 once the flow has unwound (issue 26 §5);
    # one line per failure: Prefect's tracebacks of it stay in its API log
    try:
        with exit_when_lost(lambda line: result(line, "ERROR")), quiet_expected_failures():
            clock.mark(phases.FLOW_CALLED)
            state = train_flow(
                config_path=config, overrides=list(set_), resume=resume, if_finished=if_finished, return_state=True
            )
            if interrupt.requested() is not None:  # Ctrl-C or SIGTERM: the flow ended its run Cancelled, one line
                say_interrupted(config, list(set_), state.message if state.is_cancelled() else None)
            if state.is_cancelled():  # issue 32 §3: cancelled in the Prefect UI or API; the ranks are stopped
                result(f"kc train: {state.message or 'the run was cancelled in Prefect'}", "WARNING")
                raise typer.Exit(1)
            summary = state.result()
    except KuangchaoError as exc:  # ConfigError, NothingToTrain, PlanError: exit 2; the others: exit 1
        lines, code = failure_lines(exc, config)
        for line in lines:
            result(line, "ERROR")
        raise typer.Exit(code) from None
    if state.name == "Skipped":
        result(f"kc train: {state.message}")
    after = summary.get("after_last_step_s") if isinstance(summary, dict) else None
    if after and clock.last_step is not None:  # the flow's own end (its state, the artifact) after the summary
        clock.add("flow_end", time.time() - clock.last_step[1] - after["total"])
        summary["after_last_step_s"] = clock.after_last_step()
        if summary.get("run_dir"):
            write_summary(summary["run_dir"], summary)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
    else:
        _print_summary({k: v for k, v in summary.items() if k not in ("startup_s", "after_last_step_s")})
        line = phases.compact(summary.get("startup_s"), summary.get("after_last_step_s"))
        if line:
            say(line, stream=sys.stdout)
        if isinstance(summary, dict) and state.name != "Skipped":
            result(result_line(summary), stream=sys.stdout)


def refuse_early(config: str, overrides: list[str], resume: str | None, if_finished: str):
    """The checks of ``kc train`` that need no Prefect run, before one starts: the config, the data's paths and first
    records (:func:`~kuangchao_core.data.early_check.check_data_early`), the layout and, when the local checkpoints
    decide it, a lineage already at ``train.steps`` (:class:`NothingToTrain`, the flow's own
    :func:`~kuangchao_core.ckpt.lineage.plan_training`). Returns the config."""
    from kuangchao_core.config import load_config
    from kuangchao_core.data.early_check import check_data_early
    from kuangchao_core.engine.plan import raise_for_plan
    from kuangchao_core.obs.model_registry import MODEL_URI_PREFIX

    cfg = load_config(config, overrides)
    check_data_early(cfg.data)  # a wrong data.path in a second, before any server (issue 45 §2)
    registered_base = str(cfg.model.checkpoint or "").startswith(MODEL_URI_PREFIX)
    # with checkpoint.uri the flow first restores from S3, and a registered base changes the lineage's fingerprint:
    # then the flow decides. Before the layout's check, which imports torch: a refusal takes no second
    if if_finished == "error" and not cfg.checkpoint.uri and not registered_base:
        from kuangchao_core.ckpt.lineage import plan_training
        from kuangchao_core.config.settings import lineage_key

        plan_training(lineage_key(cfg), resume or cfg.checkpoint.resume, if_finished)
    # a registered base (models:/NAME@ALIAS) has no local files yet: the flow resolves it, then checks the plan
    if not registered_base:
        raise_for_plan(cfg)
    refuse_broken_store(cfg)
    return cfg


def refuse_broken_store(cfg) -> None:
    """A SQLite tracking store that is not a database MLflow can read (garbage, malformed, another program's):
    :class:`~kuangchao_core.errors.TrackingStoreError` in a second, before Prefect starts (issue 38 item 8). A store
    locked now is left to the job, which waits for it; the flow's pre-flight says the rest."""
    from kuangchao_core.obs.tracking import tracking_uri
    from kuangchao_core.obs.tracking_store import LOCKED, probe_sqlite, sqlite_path, store_error

    uri = tracking_uri(cfg)
    path = sqlite_path(uri)
    problem = probe_sqlite(path) if path else None
    if problem is not None and problem.kind != LOCKED:
        raise store_error(uri, problem)


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


def start_temporary_server():
    """Without ``PREFECT_API_URL``, Prefect's temporary server started now, guarded so that it dies with this
    process (:func:`kuangchao.cli.prefect_server.start_temporary_server`: a thread to join before the flow starts);
    None when an API is configured (the server's modules are then not imported at all)."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return None
    from kuangchao.cli import prefect_server  # imported here, in this thread, not in the thread that starts it

    return prefect_server.start_temporary_server()


def _print_summary(summary: dict) -> None:
    """The run summary, one console line per field (``-q`` leaves it out: the result line says the gist)."""
    from kuangchao_core.obs.console import for_people
    from kuangchao_core.obs.voice import say

    say("run summary:", stream=sys.stdout)
    width = max((len(key) for key in summary), default=0)
    for key, value in summary.items():  # rounded for people; --json prints full precision
        lines = for_people(value).splitlines() or [""]
        say(
            "\n".join([f"  {key:<{width}}  {lines[0]}", *(f"  {'':<{width}}  {ln}" for ln in lines[1:])]),
            stream=sys.stdout,
        )


def result_line(summary: dict) -> str:
    """The run's one-line result: ``done: task T, S steps trained, final loss L, checkpoint step C at DIR, …``."""
    from kuangchao_core.obs.console import for_people

    parts = [f"task {summary.get('task')}", f"{summary.get('trained_steps', summary.get('steps'))} steps trained"]
    if summary.get("final_loss") is not None:
        parts.append(f"final loss {for_people(summary['final_loss'])}")
    if summary.get("checkpoint_step") is not None:
        parts.append(f"checkpoint step {summary['checkpoint_step']} at {summary.get('checkpoint_path')}")
    if summary.get("run_dir"):
        parts.append(f"summary in {summary['run_dir']}")
    return "done: " + ", ".join(parts)
