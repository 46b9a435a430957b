"""``kc checkpoint``: verify a checkpoint and list a task's checkpoints.

- ``kc checkpoint verify STEP_DIR`` — exit 0 when intact, 1 when corrupt (each problem printed), 2 when the
  path is not a step directory.
- ``kc checkpoint list DIR`` — every step directory of a task directory (or of each task below a checkpoint
  root) with its status: intact, corrupt (with reasons), incomplete (``.tmp-*``) or replaced.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kuangchao_core.ckpt.integrity import verify_checkpoint
from kuangchao_core.ckpt.layout import MANIFEST, parse_step_dir, parse_tmp_dir

checkpoint_app = typer.Typer(help="Verify and list checkpoints.", no_args_is_help=True)


def _dir_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _manifest_field(step_dir: Path, key: str):
    try:
        return json.loads((step_dir / MANIFEST).read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


@checkpoint_app.command("verify")
def verify(
    path: Path = typer.Argument(..., help="A step directory: <checkpoint.dir>/<task>/step_<N>"),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON object instead of text."),
) -> None:
    """Check a checkpoint's manifest and the sha256 and size of every file it lists."""
    if not path.is_dir():
        typer.echo(
            f"error: {path} is not a directory; pass a step directory such as checkpoints/TASK/step_00000010", err=True
        )
        raise typer.Exit(2)
    if not (path / MANIFEST).exists() and any(parse_step_dir(c.name) is not None for c in path.iterdir()):
        typer.echo(
            f"error: {path} is a task directory; pass one of its step_* directories or use `kc checkpoint list`",
            err=True,
        )
        raise typer.Exit(2)
    problems = verify_checkpoint(path)
    if as_json:
        typer.echo(json.dumps({"path": str(path), "intact": not problems, "problems": problems}))
    elif problems:
        typer.echo(f"CORRUPT {path}")
        for p in problems:
            typer.echo(f"  - {p}")
    else:
        typer.echo(
            f"OK {path} (step {_manifest_field(path, 'step')}, {len(_manifest_field(path, 'files') or {})} files)"
        )
    raise typer.Exit(1 if problems else 0)


def _task_dirs(root: Path) -> list[Path]:
    def is_task(p: Path) -> bool:
        return any(parse_step_dir(c.name) is not None or parse_tmp_dir(c.name) is not None for c in p.iterdir())

    if is_task(root):
        return [root]
    return [c for c in sorted(root.iterdir()) if c.is_dir() and is_task(c)]


def _status(entry: Path) -> tuple[int | None, str, list[str]]:
    name = entry.name
    step = parse_step_dir(name)
    if step is not None:
        problems = verify_checkpoint(entry)
        return step, ("corrupt" if problems else "intact"), problems
    step = parse_tmp_dir(name)
    if step is not None:
        return step, "incomplete", []
    if name.startswith("step_") and ".replaced-" in name:
        return None, "replaced", []
    return None, "other", []


@checkpoint_app.command("list")
def list_(
    directory: Path = typer.Argument(..., help="A task directory (<checkpoint.dir>/<task>) or a checkpoint root."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON lines instead of a table."),
) -> None:
    """List step directories with their status (hashes every file: intact, corrupt, incomplete, replaced)."""
    if not directory.is_dir():
        typer.echo(f"error: {directory} is not a directory", err=True)
        raise typer.Exit(2)
    rows = []
    for task in _task_dirs(directory):
        for entry in sorted(task.iterdir()):
            if not entry.is_dir() or not entry.name.startswith("step_"):
                continue
            step, status, problems = _status(entry)
            rows.append(
                {
                    "task": task.name,
                    "name": entry.name,
                    "step": step,
                    "status": status,
                    "bytes": _dir_size(entry),
                    "created_at": _manifest_field(entry, "created_at") if status == "intact" else None,
                    "problems": problems,
                }
            )
    if as_json:
        for r in rows:
            typer.echo(json.dumps(r))
        return
    if not rows:
        typer.echo(f"no checkpoints under {directory}")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("task", "directory", "step", "status", "MiB", "created", "problems")
    for r in rows:
        colour = {"intact": "green", "corrupt": "red", "incomplete": "yellow"}.get(r["status"], "white")
        table.add_row(
            r["task"],
            r["name"],
            "" if r["step"] is None else str(r["step"]),
            f"[{colour}]{r['status']}[/{colour}]",
            f"{r['bytes'] / 2**20:.2f}",
            r["created_at"] or "",
            "; ".join(r["problems"]),
        )
    Console().print(table)


def register(app: typer.Typer) -> None:
    """Add ``kc checkpoint`` to the CLI."""
    app.add_typer(checkpoint_app, name="checkpoint")
