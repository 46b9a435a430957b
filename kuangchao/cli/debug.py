"""``kc debug``: inspect communication-group dumps and memory allocation records written by workers."""

from __future__ import annotations

import json
from pathlib import Path

import typer

debug_app = typer.Typer(help="Inspect state dumps written by workers (communication groups, memory records).")


def _expand(paths: list[Path], kind: str = "comm") -> list[Path]:
    """Dump files: files as given, a folder's ``*.json``, or a run directory's ``debug/<kind>/`` dumps."""
    files: list[Path] = []
    for p in paths:
        if (p / "debug" / kind).is_dir():
            p = p / "debug" / kind
        if p.is_dir():
            files.extend(sorted(p.glob("*.json")))
        else:
            files.append(p)
    return files


@debug_app.command("comm")
def comm(
    paths: list[Path] = typer.Argument(
        ..., help="A run directory (its debug/comm dumps: SIGUSR1 or a timeout wrote them), a folder or dump files."
    ),
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
    path: Path = typer.Argument(..., help="A run directory (its debug/memory dumps) or a memory report file."),
    as_json: bool = typer.Option(False, "--json", help="Print the report(s) as JSON."),
) -> None:
    """Show which modules hold memory (allocation records per module and region), per rank for a run."""
    files = _expand([path], "memory")
    if not files or not all(f.is_file() for f in files):
        typer.echo(f"kc debug memory: no memory report at {path} (SIGUSR1 the workers to write them)", err=True)
        raise typer.Exit(2)
    reports = {f.stem: json.loads(f.read_text()) for f in files}
    if as_json:
        typer.echo(json.dumps(reports if len(reports) > 1 else next(iter(reports.values())), indent=1))
        return
    for name, rep in reports.items():
        if len(reports) > 1:
            typer.echo(f"== {name}")
        _print_memory(rep)


def _print_memory(rep: dict) -> None:
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
