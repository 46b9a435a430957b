"""``kc debug``: inspect communication-group dumps, memory allocation records and MoE routing written by workers."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kuangchao_core.config.bounded_json import read_json_file, read_json_object

debug_app = typer.Typer(
    help="Inspect state dumps written by workers (communication groups, memory records, MoE routing)."
)


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
        for f in files:  # comm may import only errors: the bounded reader refuses a hostile dump first
            read_json_file(f)
        dumps = load_dumps(files)
    except (OSError, ValueError, KeyError) as exc:
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
    """Show which modules hold memory, per rank for a run: the per-module records (parameters, gradients, optimizer
    state, activations per block, the engine's buffers) and the HAL pool's allocations per module and region."""
    files = _expand([path], "memory")
    if not files or not all(f.is_file() for f in files):
        typer.echo(
            f"kc debug memory: no memory report at {path} (SIGUSR1 the workers to write them; an out-of-memory "
            "writes them itself)",
            err=True,
        )
        raise typer.Exit(2)
    try:
        reports = {f.stem: read_json_object(f) for f in files}
    except (OSError, ValueError) as exc:
        typer.echo(f"kc debug memory: not a memory report ({exc})", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(reports if len(reports) > 1 else next(iter(reports.values())), indent=1))
        return
    for name, rep in reports.items():
        if len(reports) > 1:
            typer.echo(f"== {name}")
        _print_memory(rep)


@debug_app.command("routing")
def routing(
    path: Path = typer.Argument(..., help="A run directory (its debug/routing/routing.json) or that file."),
    as_json: bool = typer.Option(False, "--json", help="Print the routing record as JSON."),
) -> None:
    """Show a MoE model's routing at the run's last logged step: per MoE layer the tokens routed to each expert
    (the global batch, before capacity), each expert's share and the layer's load imbalance (max / mean)."""
    from kuangchao_core.engine.routing_report import routing_path

    file = routing_path(path) if path.is_dir() else path
    try:
        record = read_json_object(file)
        layers = {int(k): v for k, v in record["layers"].items()}
        step = int(record["step"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        typer.echo(
            f"kc debug routing: no MoE routing record at {file} ({exc}); rank 0 of a MoE job writes it at "
            "each log line",
            err=True,
        )
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(record, indent=1))
        return
    typer.echo(f"MoE routing at step {step}: tokens per expert (global batch, before capacity)")
    for layer in sorted(layers):
        tokens = [int(t) for t in layers[layer]["tokens"]]
        total, ratio = sum(tokens), layers[layer].get("imbalance")
        typer.echo(
            f"layer {layer}: {total:,} assignments, imbalance {ratio:.3f} (max / mean)"
            if ratio
            else f"layer {layer}: nothing routed"
        )
        for i, n in enumerate(tokens):
            share = n / total if total else 0.0
            typer.echo(f"  expert {i:>4} {n:>12,} {share:>7.1%} {'#' * round(40 * share)}")


def _print_memory(rep: dict) -> None:
    records = sorted(rep.get("records", []), key=lambda r: -r["bytes"])
    for r in records:  # the rank's per-module records (issue 44): what holds its bytes, largest first
        typer.echo(f"{r['module']:<32} {r['kind']:<16} {r['bytes']:>14,} B")
    held = [r for r in records if r["kind"] != "activations_peak"]  # a peak of the last tracked step: not held now
    if records:
        typer.echo(f"{'records total (held now)':<49} {sum(r['bytes'] for r in held):>14,} B")
    allocated = (rep.get("device") or {}).get("allocated_bytes") or 0
    if allocated:  # CUDA: the caching allocator's count, which the records come from
        share = sum(r["bytes"] for r in held) / allocated
        typer.echo(f"device {rep['device'].get('name')}: allocated={allocated:,} B (records {share:.1%} of it)")
    mods = sorted(rep.get("modules", {}).items(), key=lambda kv: -kv[1]["live_bytes"])
    for name, st in mods:
        typer.echo(
            f"{name:<24} live={st['live_bytes']:>14,} B  peak={st['peak_bytes']:>14,} B  "
            f"allocs={st['allocs']} frees={st['frees']} reused={st['reused']}"
        )
    for region, nbytes in sorted(rep.get("regions", {}).items()):
        typer.echo(f"region {region:<17} live={nbytes:>14,} B")
    limit = rep.get("pool_limit_bytes")
    typer.echo(
        f"pool live={rep.get('pool_live_bytes', 0):,} B cached={rep.get('pool_cached_bytes', 0):,} B of "
        f"{rep.get('pool_max_bytes', 0):,} B, cap {f'{limit:,} B' if limit else 'none'} (hal.memory_pool_size)"
    )


@debug_app.command("gradient")
def gradient(
    run_dir: Path = typer.Argument(None, help="A run directory whose ranks wrote gradient snapshots."),
    config: str = typer.Option(None, "--config", "-c", help="Run this job to --step and snapshot it instead."),
    step: int = typer.Option(1, "--step", min=1, help="With --config: the optimizer step to snapshot."),
    set_: list[str] = typer.Option([], "--set", help="With --config: overrides, as for kc train."),
    top: int = typer.Option(10, "--top", min=1, help="How many differing tensors to list."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Compare parameters and reduced gradients across data-parallel replicas at one step and name the tensors
    that differ most (replicas must agree exactly). Either read RUN_DIR's snapshots (a job run with
    KC_GRAD_SNAPSHOT_STEP=N), or run --config for --step steps in a scratch run directory and snapshot it.
    Exit 0 when the replicas agree, 1 naming what differs, 2 for bad arguments."""
    from kuangchao_core.engine.grad_snapshot import load_snapshots, replica_differences, snapshot_path

    if (run_dir is None) == (config is None):
        typer.echo("kc debug gradient: give a RUN_DIR or --config (one of them)", err=True)
        raise typer.Exit(2)
    if config:
        run_dir = _run_for_snapshot(config, set_, step)
    folder = snapshot_path(run_dir, 0).parent
    snaps = load_snapshots(folder) if folder.is_dir() else {}
    if not snaps:
        typer.echo(f"kc debug gradient: no gradient snapshots in {folder}", err=True)
        raise typer.Exit(2)
    diffs = replica_differences(snaps)
    steps = sorted({s["step"] for s in snaps.values()})
    if as_json:
        typer.echo(json.dumps({"run_dir": str(run_dir), "steps": steps, "differences": diffs[:top]}, indent=1))
    else:
        typer.echo(f"{len(snaps)} ranks at step {steps}; replicas compared by (tp, pp) coordinates")
        for d in diffs[:top]:
            typer.echo(f"{d['tensor']:<48} ranks {d['ranks']}  max |diff| {d['max_abs']:.3e}  relative {d['rel']:.3e}")
        typer.echo("replicas agree" if not diffs else f"{len(diffs)} tensor(s) differ between replicas")
    raise typer.Exit(1 if diffs else 0)


def _run_for_snapshot(config: str, set_: list[str], step: int) -> Path:
    """Run the job to ``step`` in a scratch run directory (tokens issued as ``kc train`` does) with snapshots on."""
    import os
    import time as _time

    from kuangchao_core.config import load_config
    from kuangchao_core.engine.grad_snapshot import ENV_STEP
    from kuangchao_core.errors import ConfigError, KuangchaoError

    stamp = _time.strftime("%Y%m%dT%H%M%SZ", _time.gmtime())
    try:
        base = load_config(config, set_)
        run = Path(os.environ.get("KC_RUNS_DIR", "runs")) / "debug" / base.task.name / stamp
        cfg = load_config(
            config,
            [
                *set_,
                f"train.steps={step}",
                f"checkpoint.dir={run / 'ckpt'}",  # the job's own checkpoints are neither read nor written
                "checkpoint.resume=never",
                f"checkpoint.interval={10**9}",
                "tracking.prometheus_port=null",
            ],
        )
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    from kuangchao_core.job.launch_attempt import launch_workers
    from kuangchao_core.perm.issuance import close_authority, issue_tokens_for_run

    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(cfg.to_yaml(), encoding="utf-8")
    env = {ENV_STEP: str(step)}
    try:
        if cfg.permission.mode == "enforcing":
            env.update(issue_tokens_for_run(cfg, run, 0))
        launch_workers(cfg, run / "config.yaml", run, 0, "never", None, env)
    except KuangchaoError as exc:
        typer.echo(f"kc debug gradient: the job failed: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        close_authority(run)
    return run


@debug_app.command("checkpoint")
def checkpoint(
    step_dir: Path = typer.Argument(..., help="A checkpoint step directory (…/step_<N>)."),
    config: str = typer.Option(None, "--config", "-c", help="A job config to check the checkpoint against."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Check a checkpoint's integrity (hashes, safetensors headers against the manifest, layout) and its metadata:
    step, format, Kuangchao and torch versions, layout, and — with --config — whether the job's model fits it and
    in which layout it will be read. Exit 0 usable, 1 with the problems listed, 2 when it is not a checkpoint."""
    from kuangchao_core.ckpt.integrity import read_manifest, verify_checkpoint

    if not (step_dir / "manifest.json").is_file():
        typer.echo(f"kc debug checkpoint: {step_dir}: no manifest.json (not a committed step directory)", err=True)
        raise typer.Exit(2)
    problems = list(verify_checkpoint(step_dir))
    try:
        manifest = read_manifest(step_dir)
    except Exception as exc:  # a manifest that verify already flagged
        manifest = {}
        problems.append(f"manifest unreadable: {exc}")
    bad = step_dir / "BAD.json"
    if bad.exists():
        with open(bad, "rb") as f:  # its first bytes only: the file may be anything
            head = f.read(300).decode("utf-8", "replace")
        problems.append(f"marked bad by a job that could not load it: {head}")
    report = {
        "step": manifest.get("step"),
        "format_version": manifest.get("format_version"),
        "kuangchao_version": manifest.get("kuangchao_version"),
        "torch_version": manifest.get("torch_version"),
        "created_at": manifest.get("created_at"),
        "world_size": manifest.get("world_size"),
        "parallel": manifest.get("parallel"),
        "model_shape": manifest.get("model_shape"),
    }
    if config:
        from kuangchao_core.config import load_config
        from kuangchao_core.engine.checkpointing import model_mismatch
        from kuangchao_core.errors import ConfigError
        from kuangchao_core.models.llama import config_from_model_section

        try:
            cfg = load_config(config)
        except ConfigError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from None
        mismatch = model_mismatch(manifest, config_from_model_section(cfg.model))
        if mismatch:
            problems.append(mismatch)
        par = cfg.parallel
        report["job_layout"] = f"dp{par.data_parallel_size}-tp{par.tensor_parallel_size}-pp{par.pipeline_parallel_size}"
    report["problems"] = problems
    if as_json:
        typer.echo(json.dumps(report, indent=1, default=str))
    else:
        for key, value in report.items():
            if key != "problems" and value is not None:
                typer.echo(f"{key:<18} {value}")
        typer.echo("usable" if not problems else "problems:\n  " + "\n  ".join(problems))
    raise typer.Exit(1 if problems else 0)


def register(app: typer.Typer) -> None:
    """Add the ``debug`` command group to the ``kc`` app."""
    app.add_typer(debug_app, name="debug")
