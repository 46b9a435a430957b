"""``kc debug``: inspect communication-group dumps and memory allocation records written by workers."""

from __future__ import annotations

import json
from pathlib import Path

import typer

debug_app = typer.Typer(help="Inspect state dumps written by workers (communication groups, memory records).")


def _expand(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files.extend(sorted(p.glob("*.json")))
        else:
            files.append(p)
    return files


@debug_app.command("comm")
def comm(
    paths: list[Path] = typer.Argument(..., help="Dump files from comm.state.write_dump (one per rank), or a folder."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report."),
) -> None:
    """Check the group dumps of all ranks for inconsistent rank order, mixed backends and laggards."""
    from kuangchao_core.comm.state import check_consistency, load_dumps

    files = _expand(paths)
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        typer.echo(f"kc debug comm: no such dump file(s): {missing or [str(p) for p in paths]}", err=True)
        raise typer.Exit(2)
    try:
        dumps = load_dumps(files)
    except (ValueError, KeyError) as exc:
        typer.echo(f"kc debug comm: not a comm state dump ({exc}); write dumps with comm.state.write_dump", err=True)
        raise typer.Exit(2) from None
    problems = check_consistency(dumps)
    if as_json:
        typer.echo(json.dumps({"ranks": sorted(dumps), "groups": dumps, "problems": problems}, indent=1))
    else:
        for rank in sorted(dumps):
            for g in dumps[rank]:
                typer.echo(
                    f"rank {rank:>4}  {g['name']:<24} ranks={g['ranks']} backend={g['backend']} "
                    f"ops={g['ops_issued']} last_seq={g['last_seq']}"
                    + (f" BROKEN: {g['broken']}" if g.get("broken") else "")
                )
        typer.echo("consistent" if not problems else "problems:\n  " + "\n  ".join(problems))
    raise typer.Exit(1 if problems else 0)


@debug_app.command("memory")
def memory(
    path: Path = typer.Argument(..., help="A report from hal.write_memory_report."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Show which modules hold memory (allocation records per module and region)."""
    if not path.is_file():
        typer.echo(f"kc debug memory: no such report file: {path}", err=True)
        raise typer.Exit(2)
    rep = json.loads(path.read_text())
    if as_json:
        typer.echo(json.dumps(rep, indent=1))
        return
    mods = sorted(rep.get("modules", {}).items(), key=lambda kv: -kv[1]["live_bytes"])
    for name, st in mods:
        typer.echo(
            f"{name:<24} live={st['live_bytes']:>14,} B  peak={st['peak_bytes']:>14,} B  "
            f"allocs={st['allocs']} frees={st['frees']} reused={st['reused']}"
        )
    for region, nbytes in sorted(rep.get("regions", {}).items()):
        typer.echo(f"region {region:<17} live={nbytes:>14,} B")
    typer.echo(f"pool cached={rep.get('pool_cached_bytes', 0):,} B of {rep.get('pool_max_bytes', 0):,} B")


def register(app: typer.Typer) -> None:
    """Add the ``debug`` command group to the ``kc`` app."""
    app.add_typer(debug_app, name="debug")
