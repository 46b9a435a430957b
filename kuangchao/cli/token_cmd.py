"""``kc token revoke``: stop a token (or every token of a module) of a running job within one renewal period."""

from __future__ import annotations

import typer

token_app = typer.Typer(help="Capability tokens of a running job.")


@token_app.command("revoke")
def revoke_cmd(
    target: str = typer.Argument(..., help="A token id (24 hex digits, as audit records show it) or a module name."),
    run: str = typer.Option(..., "--run", help="The job's run directory."),
    reason: str = typer.Option("", "--reason", help="Why (kept in the revocation and the audit log)."),
    key_file: str = typer.Option(None, "--operator-key", help="Your operator key (default as `kc operator show`)."),
) -> None:
    """Revoke TARGET in the job: the authority refuses its next renewal and the holder's guard then denies
    everything — within one renewal period (half a token's lifetime). Needs an operator key the job trusts; the
    revocation is signed with it and audited. Exit 1 when refused, 2 for a bad argument."""
    from pathlib import Path

    from kuangchao.cli.config_cmd import _load_or_exit, operator_for_job
    from kuangchao_core.errors import PermissionDenied
    from kuangchao_core.perm.audit import AuditLog
    from kuangchao_core.perm.issuance import audit_log_path, job_id_for
    from kuangchao_core.perm.revocation import append_revocation, revocation_target, sign_revocation

    run_dir = Path(run)
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        typer.echo(f"{run}: no config.yaml; pass the run directory of a job started by `kc train`", err=True)
        raise typer.Exit(2)
    if not target or len(target) > 128 or not target.replace("-", "").replace("_", "").isalnum():
        typer.echo(f"{target!r}: not a token id or module name", err=True)
        raise typer.Exit(2)
    cfg = _load_or_exit(str(config_file), [])
    job_id = job_id_for(cfg, run_dir)
    audit = AuditLog(audit_log_path(cfg, job_id), job_id)
    try:
        try:
            operator, _ = operator_for_job(run_dir, job_id, key_file, audit, f"job:{job_id}")
        except PermissionDenied as exc:
            typer.echo(f"{run}: refused: {exc}", err=True)
            raise typer.Exit(1) from None
        doc = sign_revocation(operator, job_id, target, reason)
        n = append_revocation(run_dir / "authority" / "revocations.json", doc)
        kind, value = revocation_target(target)
        audit.append(
            "token_revoke",
            actor=operator.actor,
            decision="allow",
            resource=f"job:{job_id}",
            reason=reason[:200] or "revoked by operator",
            target=value,
            kind=kind,
            signer=operator.kid,
        )
        typer.echo(f"revoked {'token' if kind == 'jti' else 'module'} {value} in job {job_id} ({n} revocation(s))")
    finally:
        audit.close()


def register(app: typer.Typer) -> None:
    """Add the ``token`` command group to the ``kc`` app."""
    app.add_typer(token_app, name="token")
