"""``kc launch``: run your own script under Kuangchao — one capability token per rank, the renewal endpoint and the
audit log as ``kc train`` has them, and torchrun to start the ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
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
        try:
            code = _run(
                cfg, run, script, list(ctx.args), nproc_per_node, nnodes, node_rank, master_addr, master_port, role
            )
        except (ConfigError, KuangchaoError) as exc:
            typer.echo(f"kc launch: {exc}", err=True)
            raise typer.Exit(2) from None
        raise typer.Exit(code)


def _run(cfg, run: Path, script: str, args: list[str], nproc: int, nnodes: int, node_rank: int, addr, port, role):
    from kuangchao_core.perm.audit_pins import record_audit_pin_or_log
    from kuangchao_core.perm.issuance import close_authority, issue_script_tokens
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
        pin = (run, env["KC_AUDIT_LOG"], env["KC_JOB_ID"], kid, public_raw(key))
        record_audit_pin_or_log(*pin, mode="enforcing")
        typer.echo(
            f"kc launch: job {env['KC_JOB_ID']}, {len(ranks)} rank(s) here, run dir {run}, audit log {env['KC_AUDIT_LOG']}"
        )
    else:
        typer.echo("kc launch: permission.mode is TRUSTED: no tokens, no checks", err=True)
    rdzv = (
        ["--standalone"]
        if nnodes == 1
        else ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", addr, "--master-port", str(port)]
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, "--nproc-per-node", str(nproc), script, *args]
    try:
        return subprocess.run(cmd, env=env).returncode
    finally:
        if server is not None:
            server.stop()
            record_audit_pin_or_log(*pin, mode="enforcing")
        close_authority(run)
