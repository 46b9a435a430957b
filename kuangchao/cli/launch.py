"""``kc launch``: run your own script under Kuangchao — one capability token per rank, the renewal endpoint and the
audit log as ``kc train`` has them, and torchrun to start the ranks.

An enforcing launch opens an MLflow run of its own in the config's ``tracking.uri`` (default ``sqlite:///mlflow.db``
in the working directory; tags ``kuangchao.job_id``, ``kuangchao.launch``) and records the job's audit pins there as
well as in the run directory, and seals the log as its last act (:mod:`kuangchao_core.perm.audit_seal`), so
``kc audit --verify --run RUN_DIR`` (with ``--tracking-uri`` for another store) finds the pins outside the run
without ``--pins``. Without a reachable store it says so: the pins are then only in the run directory, which vouches
for nothing, and verification fails ``no_pins``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Add ``kc launch`` to the CLI."""

    @app.command(
        "launch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, no_args_is_help=True
    )
    def launch(
        ctx: typer.Context,
        script: str = typer.Argument(..., help="The Python script to run on every rank (its arguments follow it)."),
        nproc_per_node: int = typer.Option(1, "--nproc-per-node", "--nproc_per_node", min=1, help="Ranks here."),
        nnodes: int = typer.Option(1, "--nnodes", min=1, help="Machines in the job (run kc launch on each)."),
        node_rank: int = typer.Option(0, "--node-rank", "--node_rank", min=0, help="This machine's rank."),
        master_addr: str = typer.Option("127.0.0.1", "--master-addr", "--master_addr", help="Node 0's address."),
        master_port: int = typer.Option(29500, "--master-port", "--master_port", help="Node 0's rendezvous port."),
        config: str = typer.Option(None, "--config", "-c", help="A job config (task name, permission section)."),
        role: str = typer.Option("trainer", "--role", help="The role every rank's token carries."),
        run_dir: str = typer.Option(None, "--run-dir", help="Where the job's public state goes (default runs/…)."),
        job_id: str = typer.Option(None, "--job-id", help="The job id (the same on every node; needed with --nnodes)."),
        store_key_file: str = typer.Option(
            None, "--store-key-file", help="With --nnodes: a secret file, the same on every node, that gates the store."
        ),
    ) -> None:
        """Run SCRIPT on --nproc-per-node ranks (torchrun flags), each with its own capability token.

        The script's `import kuangchao.distributed as kc` / `kc.init()` installs the rank's token from the
        environment; every communication, device and memory call then passes its guard and lands in the job's
        audit log. Tokens are renewed through an endpoint of this process, which alone holds the signing key.
        Exit code: the script's (torchrun's); 2 for a bad argument or config."""
        from kuangchao_core.config import config_from_dict, load_config
        from kuangchao_core.errors import ConfigError, KuangchaoError

        if not Path(script).is_file():
            typer.echo(f"kc launch: {script}: no such script", err=True)
            raise typer.Exit(2)
        if nnodes > 1 and not job_id:
            typer.echo("kc launch: --nnodes > 1 needs --job-id, the same on every node", err=True)
            raise typer.Exit(2)
        if node_rank >= nnodes:
            typer.echo(f"kc launch: --node-rank {node_rank} must be below --nnodes {nnodes}", err=True)
            raise typer.Exit(2)
        name = Path(script).stem
        try:
            cfg = load_config(config) if config else config_from_dict({"task": {"name": name}})
        except ConfigError as exc:
            for path, msg in exc.errors:
                typer.echo(f"{exc.source or config}: {path}: {msg}", err=True)
            raise typer.Exit(2) from None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        base = Path(os.environ.get("KC_RUNS_DIR", "runs"))
        run = Path(run_dir) if run_dir else base / "launch" / cfg.task.name / f"{stamp}-node{node_rank}"
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
        if job_id:
            (run / "job_id").write_text(job_id + "\n")
        if store_key_file:
            os.environ["KC_STORE_KEY_FILE"] = str(Path(store_key_file).resolve())
        try:
            code = _run(
                cfg, run, script, list(ctx.args), nproc_per_node, nnodes, node_rank, master_addr, master_port, role
            )
        except (ConfigError, KuangchaoError) as exc:
            typer.echo(f"kc launch: {exc}", err=True)
            raise typer.Exit(2) from None
        raise typer.Exit(code)


def _run(cfg, run: Path, script: str, args: list[str], nproc: int, nnodes: int, node_rank: int, addr, port, role):
    from kuangchao_core.obs.tracking import tracking_uri
    from kuangchao_core.perm.audit_pins import record_audit_pin_or_log
    from kuangchao_core.perm.audit_seal import register_seal
    from kuangchao_core.perm.issuance import close_authority, issue_script_tokens
    from kuangchao_core.perm.pin_store import checked_pin_store
    from kuangchao_core.perm.runtime import RenewalServer
    from kuangchao_core.perm.tokens import public_raw

    trusted = cfg.permission.mode == "trusted"
    env = {**os.environ, "KC_RUN_DIR": str(run.resolve())}
    server = None
    if not trusted:
        ranks = [node_rank * nproc + i for i in range(nproc)]
        env.update(issue_script_tokens(cfg, run, ranks, role=role, nproc_per_node=nproc))
        from kuangchao_core.perm.issuance import authority_for

        authority = authority_for(cfg, run)
        server = RenewalServer(
            authority, env["KC_JOB_ID"], 0, audit_log=env["KC_AUDIT_LOG"], ttl_s=float(cfg.permission.token_ttl_seconds)
        )
        env["KC_AUTHORITY_ADDR"] = server.start()
        kid, key = authority.audit_signing_key()
        pin_run = _pin_run(cfg, env["KC_JOB_ID"], node_rank)  # the pins' place outside the run directory
        pin = partial(
            record_audit_pin_or_log,
            run,
            env["KC_AUDIT_LOG"],
            env["KC_JOB_ID"],
            kid,
            public_raw(key),
            mlflow_run_id=pin_run,
            tracking_uri=tracking_uri(cfg),
            mode="enforcing",
            pin_store=checked_pin_store(cfg.permission.pin_store),
        )
        pin()
        register_seal(run, pin)  # close_authority (below) seals the log with it: the job's last act
        if pin_run:
            uri = tracking_uri(cfg)
            store = "" if uri == "sqlite:///mlflow.db" else f" --tracking-uri {uri}"
            typer.echo(
                f"kc launch: audit pins in MLflow run {pin_run}; check with kc audit --verify --run {run}{store}"
            )
        typer.echo(
            f"kc launch: job {env['KC_JOB_ID']}, {len(ranks)} rank(s) here, run dir {run}, audit log {env['KC_AUDIT_LOG']}"
        )
    else:
        typer.echo("kc launch: permission.mode is TRUSTED: no tokens, no checks", err=True)
    from kuangchao_core.sched.bind_address import TORCHRUN
    from kuangchao_core.sched.ports import free_port
    from kuangchao_core.sched.script_rdzv import script_rendezvous
    from kuangchao_core.sched.store_key import ENV_KEY_FILE

    if nnodes > 1 and not env.get(ENV_KEY_FILE):
        typer.echo(
            f"kc launch: no store key: node 0's store on {addr}:{port} takes any client that reaches it; "
            "pass --store-key-file FILE (the same secret file on every node)",
            err=True,
        )
    rdzv_id = (run / "job_id").read_text().strip() if (run / "job_id").is_file() else run.name  # every node's
    rdzv, key_fd = script_rendezvous(nnodes, node_rank, addr, port if nnodes > 1 else free_port(), rdzv_id, env)
    torchrun = TORCHRUN
    cmd = [sys.executable, "-m", torchrun, *rdzv, "--nproc-per-node", str(nproc), script, *args]
    code = None
    from kuangchao_core.sched.lifeline import Lifeline

    # each rank gets its own tokens over the lifeline, never in its environment; the ranks end with this process
    lifeline = Lifeline(json.loads(env.pop("KC_TOKENS", "") or "{}"))
    env.update(lifeline.env())
    try:
        proc = subprocess.Popen(cmd, env=env, pass_fds=(key_fd,) if key_fd is not None else ())
        if key_fd is not None:
            os.close(key_fd)  # torchrun holds it now
        lifeline.watch(proc.pid)
        code = proc.wait()
        return code
    finally:
        lifeline.close()
        if server is not None:
            server.stop()
            pin()
        close_authority(run)
        if server is not None and pin_run:
            _close_pin_run(cfg, pin_run, code)


def _pin_run(cfg, job_id: str, node_rank: int) -> str | None:
    """The MLflow run this launch records its audit pins in (created in the config's ``tracking.uri``, where
    ``kc audit --verify`` looks by default); None, said on stderr, when the store cannot be reached."""
    from kuangchao_core.obs.tracking import open_run, tracking_uri

    tags = {"kuangchao.job_id": job_id, "kuangchao.launch": "kc launch", "mlflow.runName": f"{job_id}-node{node_rank}"}
    try:
        return open_run(cfg, extra_tags=tags)
    except Exception as exc:  # no store: the job still runs, but nothing outside its run directory vouches for its log
        typer.echo(
            f"kc launch: no MLflow run in {tracking_uri(cfg)} ({exc}); the audit pins stay in the run directory "
            "only, which vouches for nothing: `kc audit --verify` will fail no_pins",
            err=True,
        )
        return None


def _close_pin_run(cfg, run_id: str, code: int | None) -> None:
    """Mark the pins' MLflow run FINISHED (the script exited 0) or FAILED; a store gone by now costs a warning."""
    from kuangchao_core.obs.tracking import close_run

    try:
        close_run(cfg, run_id, "FINISHED" if code == 0 else "FAILED")
    except Exception as exc:
        typer.echo(f"kc launch: MLflow run {run_id} not closed: {exc}", err=True)
