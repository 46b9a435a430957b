"""``kc checkpoint``: verify a checkpoint and list a task's checkpoints.

- ``kc checkpoint verify STEP_DIR`` — exit 0 when intact, 1 when corrupt (each problem printed), 2 when the
  path is not a step directory.
- ``kc checkpoint list DIR`` — every step directory of a task directory (or of each task below a checkpoint
  root) with its status: intact, corrupt (with reasons), incomplete (``.tmp-*``) or replaced.
- ``kc checkpoint convert SRC DST --parallel tp=1,pp=1[,dp=N,v=V]`` — re-lay SRC (a step directory) out for
  another layout as ``DST/step_<N>`` (DST is a task directory); ``--format hf`` writes ``DST/model.safetensors``
  and ``DST/config.json`` in Hugging Face Llama naming instead (a LoRA checkpoint merged into its base);
  ``--format peft`` writes a LoRA checkpoint's ``adapter_model.safetensors`` + ``adapter_config.json``. Exit 0 done, 1 unreadable/corrupt source,
  2 bad arguments.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kuangchao_core.ckpt.integrity import verify_checkpoint
from kuangchao_core.ckpt.layout import MANIFEST, is_lineage_name, parse_step_dir, parse_tmp_dir
from kuangchao_core.ckpt.lineage import Lineage, list_lineages
from kuangchao_core.config.bounded_json import MANIFEST_MAX_BYTES, read_json_object

checkpoint_app = typer.Typer(
    help="Verify, list and convert checkpoints (other parallel layouts, Hugging Face format).", no_args_is_help=True
)


def _dir_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _manifest_field(step_dir: Path, key: str):
    try:
        return read_json_object(step_dir / MANIFEST, max_bytes=MANIFEST_MAX_BYTES).get(key)
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
        return any(
            parse_step_dir(c.name) is not None or parse_tmp_dir(c.name) is not None or is_lineage_name(c.name)
            for c in p.iterdir()
        )

    if is_task(root):
        return [root]
    return [c for c in sorted(root.iterdir()) if c.is_dir() and is_task(c)]


def _lineages(directory: Path) -> list[tuple[str, Lineage]]:
    """(task, lineage) pairs under ``directory``: a lineage directory, a task directory or a checkpoint root."""
    if is_lineage_name(directory.name):
        return [(directory.parent.name, Lineage(directory.name, directory))]
    return [(task.name, lin) for task in _task_dirs(directory) for lin in list_lineages(task)]


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
    directory: Path = typer.Argument(
        ..., help="A lineage directory, a task directory (<checkpoint.dir>/<task>) or a checkpoint root."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON lines instead of a table."),
) -> None:
    """List step directories by run lineage, oldest lineage first, with their status (hashes every file: intact,
    corrupt, incomplete, replaced). ``resume: auto`` continues the newest lineage that has an intact step."""
    if not directory.is_dir():
        typer.echo(f"error: {directory} is not a directory", err=True)
        raise typer.Exit(2)
    rows = []
    for task, lineage in _lineages(directory):
        for entry in sorted(lineage.path.iterdir()):
            if not entry.is_dir() or not entry.name.startswith("step_"):
                continue
            step, status, problems = _status(entry)
            rows.append(
                {
                    "task": task,
                    "lineage": lineage.name,
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
    for line in list_lines(rows):
        typer.echo(line)


def list_lines(rows: list[dict], width: int = 80) -> list[str]:
    """``kc checkpoint list`` for people, within ``width`` columns: one header line per lineage (``task/lineage``,
    in full; on two lines when longer than ``width``) then one line per step directory (step, status, MiB,
    created), a directory that is not a finished step by its name, and each problem on its own wrapped line."""
    import textwrap

    lines: list[str] = []
    current = None
    for r in rows:
        if (r["task"], r["lineage"]) != current:
            current = (r["task"], r["lineage"])
            header = f"{r['task']}/{r['lineage']}"
            lines += [header] if len(header) <= width else [f"{r['task']}/", f"  {r['lineage']}"]
            lines.append(f"  {'step':>10}  {'status':<10}  {'MiB':>9}  created")
        created = (r.get("created_at") or "").replace("+00:00", "Z")
        step = "" if r["step"] is None else str(r["step"])
        row = f"  {step:>10}  {r['status']:<10}  {r['bytes'] / 2**20:>9.2f}  {created}".rstrip()
        lines.append(row)
        if parse_step_dir(r["name"]) is None:  # an incomplete or replaced directory: its own name
            lines += textwrap.wrap(r["name"], width, initial_indent="    directory ", subsequent_indent="      ")
        for problem in r["problems"]:
            lines += textwrap.wrap(problem, width, initial_indent="    - ", subsequent_indent="      ")
    return lines


_PARALLEL_KEYS = {"tp": "tp", "pp": "pp", "dp": "dp", "v": "virtual", "virtual": "virtual"}


def parse_parallel(text: str) -> dict[str, int]:
    """``"tp=1,pp=2,dp=1"`` -> ``{"tp": 1, "pp": 2, "dp": 1, "virtual": 1}`` (unset sizes are 1); ValueError if bad."""
    out = {"tp": 1, "pp": 1, "dp": 1, "virtual": 1}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in _PARALLEL_KEYS:
            raise ValueError(f"{part!r}: expected KEY=N with KEY one of tp, pp, dp, v")
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"{part!r}: {value!r} is not an integer") from None
        if n < 1:
            raise ValueError(f"{part!r}: sizes must be >= 1")
        out[_PARALLEL_KEYS[key.strip()]] = n
    return out


@checkpoint_app.command("convert")
def convert(
    src: Path = typer.Argument(..., help="Source step directory: <checkpoint.dir>/<task>/step_<N>"),
    dst: Path = typer.Argument(
        ..., help="Destination: a task directory (layout), or an output directory (--format hf)"
    ),
    parallel: str = typer.Option("tp=1,pp=1", "--parallel", help="Target layout, e.g. tp=1,pp=1 or tp=2,pp=2,dp=1,v=1"),
    fmt: str = typer.Option(
        "kuangchao",
        "--format",
        help="kuangchao (re-laid-out checkpoint), hf (Hugging Face; a LoRA checkpoint merged into its base) or "
        "peft (a LoRA checkpoint's adapters)",
    ),
    dtype: str = typer.Option("fp32", "--dtype", help="--format hf: the weights' dtype, fp32, bf16 or fp16"),
) -> None:
    """Write SRC in another parallel layout, as a Hugging Face Llama directory (--format hf), or a LoRA
    checkpoint's adapters in PEFT's format (--format peft)."""
    from kuangchao_core.ckpt.convert import export_hf, relayout_checkpoint
    from kuangchao_core.ckpt.lora_export import ADAPTER_CONFIG, ADAPTER_FILE, export_merged, export_peft, lora_meta
    from kuangchao_core.errors import CheckpointError, ConfigError
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    if dtype not in ("fp32", "bf16", "fp16"):
        typer.echo(f"error: --dtype {dtype!r}: use fp32, bf16 or fp16", err=True)
        raise typer.Exit(2)
    if fmt not in ("kuangchao", "hf", "peft"):
        typer.echo(f"error: --format {fmt!r}: use 'kuangchao', 'hf' or 'peft'", err=True)
        raise typer.Exit(2)
    try:
        sizes = parse_parallel(parallel)
    except ValueError as exc:
        typer.echo(f"error: --parallel {parallel!r}: {exc}", err=True)
        raise typer.Exit(2) from None
    if not (src / MANIFEST).is_file():
        typer.echo(
            f"error: {src} is not a step directory (no {MANIFEST}); pass <checkpoint.dir>/<task>/run-<time>-<id>/"
            "step_<N> (kc checkpoint list <checkpoint.dir>/<task> shows them)",
            err=True,
        )
        raise typer.Exit(2)
    problems = verify_checkpoint(src)
    if problems:
        typer.echo(f"CORRUPT {src}: " + "; ".join(problems), err=True)
        raise typer.Exit(1)
    # an operator's offline tool on local files: the filesystem's permissions apply, not a job's capability token
    previous = install_guard(AllowAll())
    try:
        if fmt == "hf":
            out = (export_merged if lora_meta(src) is not None else export_hf)(src, dst, dtype)
            typer.echo(f"OK wrote {out / 'model.safetensors'} and {out / 'config.json'}")
        elif fmt == "peft":
            out = export_peft(src, dst)
            typer.echo(f"OK wrote {out / ADAPTER_FILE} and {out / ADAPTER_CONFIG}")
        else:
            out = relayout_checkpoint(src, dst, **sizes)
            typer.echo(
                f"OK wrote {out} (dp={sizes['dp']} tp={sizes['tp']} pp={sizes['pp']} v={sizes['virtual']}, "
                f"{sizes['dp'] * sizes['tp'] * sizes['pp']} shards)"
            )
    except ConfigError as exc:
        for path, message in exc.errors:
            typer.echo(f"error: {path}: {message}", err=True)
        raise typer.Exit(2) from None
    except CheckpointError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        install_guard(previous)


def register(app: typer.Typer) -> None:
    """Add ``kc checkpoint`` to the CLI."""
    app.add_typer(checkpoint_app, name="checkpoint")
