"""``kc config show|validate|set``: print a resolved job config, check one without starting anything, or change
a running job's global configuration (``set``, the operator command)."""

from __future__ import annotations

import typer

from kuangchao_core.config import JobConfig, load_config
from kuangchao_core.errors import ConfigError

config_app = typer.Typer(
    name="config",
    help="Inspect job configs (show, validate; nothing is started) or change a running job's settings (set).",
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
    """Print the resolved config (extends merged, overrides applied, defaults filled) as YAML; credentials inside
    URLs are shown as ``***``."""
    from kuangchao_core.config.secrets import redact_url

    cfg = _load_or_exit(file, set_)
    ckpt = cfg.checkpoint.model_copy(update={"endpoint_url": redact_url(cfg.checkpoint.endpoint_url)})
    typer.echo(cfg.model_copy(update={"checkpoint": ckpt}).to_yaml(), nl=False)


@config_app.command("validate")
def validate(
    file: str = typer.Argument(..., help="Job config YAML file."),
    set_: list[str] = typer.Option([], "--set", help=_SET_HELP),
) -> None:
    """Check a config; exit 0 when valid, 2 listing every error as `FILE: dotted.path: message` (a layout that
    needs a communication primitive outside permission.allowed_interfaces is an error).

    Settings the job would not use are listed as `FILE: warning: dotted.path: reason` (exit stays 0).
    """
    from kuangchao_core.config.unused import unused_settings
    from kuangchao_core.engine.plan import interface_problems

    cfg = _load_or_exit(file, set_)
    problems = interface_problems(cfg)
    for path, message in problems:
        typer.echo(f"{file}: {path}: {message}", err=True)
    if problems:
        raise typer.Exit(2)
    for path, why in unused_settings(cfg):
        typer.echo(f"{file}: warning: {path}: {why}", err=True)
    typer.echo(f"ok: {file} (world size {cfg.world_size})")


def _parse_pairs(pairs: list[str]) -> list[tuple[str, object]]:
    import yaml

    out = []
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            typer.echo(f"{pair!r}: expected KEY=VALUE, e.g. lr_scale=0.5", err=True)
            raise typer.Exit(2)
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        out.append((key.strip(), value))
    return out


@config_app.command("set")
def set_cmd(
    pairs: list[str] = typer.Argument(
        ..., metavar="KEY=VALUE...", help="KEY=VALUE settings, e.g. lr_scale=0.5 log_interval=10 (YAML values)."
    ),
    run: str = typer.Option(..., "--run", help="The job's run directory (holds config.yaml and global_config.json)."),
    key_file: str = typer.Option(
        None, "--operator-key", help="Your operator key (default $KC_OPERATOR_KEY or ~/.config/kuangchao/operator.key)."
    ),
) -> None:
    """Change settings of a running job (lr_scale, log_interval, checkpoint_interval, ...) as an operator.

    Signs the new version with your operator key, which the job must trust (it trusts the key of whoever started it
    and those in permission.operators), and records every change in the job's audit log with your key's id. Prints
    the new version; workers apply it at their next sync point. Exit 2 for a bad key or value, 1 when the change is
    refused (no operator key, a key the job does not trust, the job's authority missing).
    """
    from pathlib import Path

    from kuangchao_core.errors import KuangchaoError, PermissionDenied
    from kuangchao_core.perm.audit import AuditLog
    from kuangchao_core.perm.global_config import GlobalConfig, newest_recorded_version
    from kuangchao_core.perm.issuance import audit_log_path, job_id_for

    run_dir = Path(run)
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        typer.echo(f"{run}: no config.yaml; pass the run directory of a job started by `kc train`", err=True)
        raise typer.Exit(2)
    cfg = _load_or_exit(str(config_file), [])
    parsed = _parse_pairs(pairs)
    job_id = job_id_for(cfg, run_dir)
    audit = AuditLog(audit_log_path(cfg, job_id), job_id)
    try:
        gc = GlobalConfig(run_dir / "global_config.json", cfg.task.name, audit=audit)
        for key, value in parsed:  # every pair is checked before the first one is applied
            problem = None
            if key not in gc.keys:
                problem = f"not a changeable setting; allowed: {sorted(gc.keys)}"
            else:
                try:
                    gc.keys[key](value)
                except ValueError as exc:
                    problem = str(exc)
            if problem:
                typer.echo(f"{run}: global_config.{key}: {problem}", err=True)
                raise typer.Exit(2)
        try:
            operator, trust = operator_for_job(run_dir, job_id, key_file, audit, f"config:{cfg.task.name}")
        except PermissionDenied as exc:
            typer.echo(f"{run}: refused: {exc}", err=True)
            raise typer.Exit(1) from None
        gc = GlobalConfig(
            run_dir / "global_config.json",
            cfg.task.name,
            audit=audit,
            trust=trust,
            job_id=job_id,
            min_version=newest_recorded_version(audit.path, cfg.task.name),  # never on top of a rolled-back file
        )
        try:
            version = None
            for key, value in parsed:
                version = gc.set(key, value, signer=operator)
                typer.echo(f"{key} = {gc.keys[key](value)!r}")
            typer.echo(f"version {version} (signed by {operator.actor}, key {operator.kid})")
        except KuangchaoError as exc:
            typer.echo(f"{run}: {exc}", err=True)
            raise typer.Exit(1) from None
    finally:
        audit.close()


def operator_for_job(run_dir, job_id: str, key_file: str | None, audit, resource: str):
    """Your operator key and the job's trust store, or ``PermissionDenied`` (audited) when the job's authority is
    missing, you have no operator key, or the job does not trust it."""
    from kuangchao_core.errors import KuangchaoError, PermissionDenied
    from kuangchao_core.perm.operator import load_operator_key
    from kuangchao_core.perm.tokens import TrustStore

    def refuse(actor: str, why: str):
        audit.append("operator_verify", actor=actor, decision="deny", resource=resource, reason=why[:300])
        raise PermissionDenied("config_write", resource, why)

    trust_path = run_dir / "authority" / "trust_store.json"
    if not trust_path.is_file():
        refuse("unknown", f"the job's authority is missing ({trust_path}); nothing can be signed for it")
    try:
        operator = load_operator_key(key_file)
    except KuangchaoError as exc:
        refuse("unknown", str(exc))
    try:
        trust = TrustStore.load(trust_path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        refuse(operator.actor, f"the job's trust store {trust_path} is unreadable ({exc})")
    if trust.operator_public(operator.kid) != operator.public.public:
        refuse(
            operator.actor,
            f"job {job_id} does not trust operator key {operator.kid} ({operator.name}); add "
            f"`{operator.public.spec()}` to permission.operators and restart the job",
        )
    return operator, trust


def register(app: typer.Typer) -> None:
    """Add the ``config`` command group to the ``kc`` app."""
    app.add_typer(config_app, name="config")
