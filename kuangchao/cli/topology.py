"""``kc topology show``: the measured latency and bandwidth matrices, as the last probes left them.

Every probe (the single-machine one and the node probe of a multi-node job) keeps its report under its cluster
fingerprint in ``$KC_CACHE_DIR/topology`` (default ``~/.cache/kuangchao/topology``); runs also carry it as a
Prefect artifact (``kc-topology``) and an MLflow artifact (``topology/topology.json``).
"""

from __future__ import annotations

import json

import typer

topology_app = typer.Typer(help="Measured links between ranks and nodes (the topology probe).", no_args_is_help=True)


@topology_app.command("show")
def show(
    fingerprint: str = typer.Option(None, "--fingerprint", help="A cluster fingerprint (prefix); default: newest."),
    as_json: bool = typer.Option(False, "--json", help="The full report as JSON."),
    all_reports: bool = typer.Option(False, "--all", help="List every kept report instead."),
) -> None:
    """Show the newest measured topology (or the one with ``--fingerprint``) as tables or JSON."""
    from kuangchao_core.sched.topology import cache_dir, remembered_reports

    reports = remembered_reports()
    if fingerprint:
        reports = [r for r in reports if r.fingerprint.startswith(fingerprint)]
    if not reports:
        where = f" with fingerprint {fingerprint}" if fingerprint else ""
        typer.echo(f"kc topology show: no measured topology{where} in {cache_dir()}; `kc train` probes it", err=True)
        raise typer.Exit(1)
    if all_reports:
        rows = [
            {"fingerprint": r.fingerprint, "measured_at": r.measured_at, "nodes": r.nodes, "ranks": r.world_size}
            for r in reports
        ]
        typer.echo(
            json.dumps(rows, indent=2)
            if as_json
            else "\n".join(
                f"{r['fingerprint'][:12]}  {r['measured_at']}  {r['ranks']} ranks on {', '.join(r['nodes'])}"
                for r in rows
            )
        )
        return
    report = reports[0]
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    typer.echo(report.to_markdown())
    typer.echo(f"measured {report.measured_at}; cluster fingerprint {report.fingerprint}")


def register(app: typer.Typer) -> None:
    """Attach ``kc topology``."""
    app.add_typer(topology_app, name="topology")
