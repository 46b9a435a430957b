"""``kc plan --config FILE``: explain a job's parallel layout before anything runs, or list why it cannot run.

Exit 0 with the plan (groups, stages, micro-batches, bubble, memory per rank); exit 2 listing every config or plan
problem as ``FILE: dotted.path: message``. A plan whose largest rank would not fit in this machine's memory (the
check ``kc train`` refuses it with, ``engine.plan_memory``) is still explained, after a warning with the numbers.

``--scale N`` (repeatable) adds the predicted step time of the layout and its weak-scaling efficiency at N GPUs
(8 per node, NVLink inside, 200 and 400 Gb/s between) for flat, hierarchical and compressed DP all-reduce
(``engine.perf_report``). ``--nodes N --gpus-per-node G`` describes a static cluster and prints which ranks and
groups each node gets (``engine.traffic``). With ``--scale`` or ``--nodes``, a ``model.checkpoint`` that cannot
be read here is replaced by the shape for ``model.params`` (the output says so).
"""

from __future__ import annotations

import json

import typer

from kuangchao_core.config import load_config
from kuangchao_core.errors import ConfigError

_SET_HELP = "Override one setting, e.g. --set parallel.tensor_parallel_size=2 (repeatable; the value is read as YAML)."
_SCALE_HELP = (
    "Also predict the step time and the weak-scaling efficiency at this many GPUs (repeatable, e.g. --scale 64 "
    "--scale 512): 8 GPUs per node, NVLink inside, 200 and 400 Gb/s between nodes."
)


def _substitute_shape(cfg, errors):
    """Replace an unreadable checkpoint by the shape for model.params; (cfg, errors, note)."""
    from kuangchao_core.engine.model_shape import shape_for_section, with_model_shape
    from kuangchao_core.engine.plan import check_plan

    if not errors or any(path != "model.checkpoint" for path, _ in errors) or cfg.model.params is None:
        return cfg, errors, None
    model_cfg, note = shape_for_section(cfg.model)
    cfg = with_model_shape(cfg, model_cfg)
    return cfg, check_plan(cfg), f"model shape: {note}"


def _scale(cfg, sizes: list[int], topk_ratio: float, overlap_dp: bool, config: str) -> dict:
    from kuangchao_core.engine.perf_report import scale_report
    from kuangchao_core.models.llama import config_from_model_section
    from kuangchao_core.sched.perf_model import Layout

    bad = [n for n in sizes if n < 1]
    if bad:
        typer.echo(f"{config}: --scale: must be >= 1, got {bad[0]}", err=True)
        raise typer.Exit(2)
    try:
        return scale_report(
            config_from_model_section(cfg.model),
            Layout.from_config(cfg),
            sizes,
            topk_ratio=topk_ratio,
            overlap_dp=overlap_dp,
        )
    except ValueError as exc:
        typer.echo(f"{config}: --scale: {exc}", err=True)
        raise typer.Exit(2) from None


def plan(
    config: str = typer.Option(..., "--config", "-c", help="Job config YAML file."),
    set_: list[str] = typer.Option([], "--set", help=_SET_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON object."),
    scale: list[int] = typer.Option([], "--scale", help=_SCALE_HELP),
    topk_ratio: float = typer.Option(0.01, "--topk-ratio", help="With --scale: the top-k compression ratio."),
    overlap_dp: bool = typer.Option(
        False, "--overlap-dp", help="With --scale: hide DP communication behind the backward pass where it fits."
    ),
    nodes: int = typer.Option(None, "--nodes", help="Describe a static cluster of this many nodes (node0, node1…)."),
    gpus_per_node: int = typer.Option(None, "--gpus-per-node", help="With --nodes: ranks (GPUs) per node."),
) -> None:
    """Explain the layout: TP/PP/DP groups, layers per (virtual) stage, micro-batches, bubble, memory per rank,
    and for a static cluster (the config's, or ``--nodes``) which ranks and groups each node gets."""
    from kuangchao_core.engine.plan import check_plan, explain_plan, format_plan

    note = None
    if nodes is not None:
        if nodes < 1 or not gpus_per_node or gpus_per_node < 1:
            typer.echo(f"{config}: --nodes needs a count >= 1 and --gpus-per-node >= 1", err=True)
            raise typer.Exit(2)
        described = json.dumps([{"host": f"node{i}", "gpus": gpus_per_node, "role": "worker"} for i in range(nodes)])
        set_ = [*set_, "cluster.mode=static", f"cluster.nodes={described}", f"cluster.nproc_per_node={gpus_per_node}"]
    try:
        cfg = load_config(config, set_)
        errors = check_plan(cfg)
        # a plan is an estimate: a checkpoint that is not on this machine (yet) is sized by model.params
        cfg, errors, note = _substitute_shape(cfg, errors)
        if note and not scale and nodes is None:
            typer.echo(f"{config}: warning: model.checkpoint is not readable here; kc train would refuse it", err=True)
    except ConfigError as exc:
        errors = exc.errors
    if errors:
        for path, message in errors:
            typer.echo(f"{config}: {path}: {message}", err=True)
        typer.echo(f"{config}: {len(errors)} plan problem(s); nothing was started", err=True)
        raise typer.Exit(2)
    if not 0.0 < topk_ratio <= 1.0:
        typer.echo(f"{config}: --topk-ratio: must be in (0, 1], got {topk_ratio}", err=True)
        raise typer.Exit(2)
    if not scale and nodes is None:  # a layout for this machine: would its ranks fit in its memory?
        from kuangchao_core.engine.plan import memory_problems

        for path, message in memory_problems(cfg):
            _warn(config, path, f"{message}; kc train would refuse this plan here")
    from kuangchao_core.engine.plan import unbuilt_problems

    for path, message in unbuilt_problems(cfg):  # described here, refused by kc train (context parallelism)
        _warn(config, path, f"{message}; kc train would refuse this plan")
    result = explain_plan(cfg)
    report = _scale(cfg, scale, topk_ratio, overlap_dp, config) if scale else None
    placement = _placement(cfg)
    if as_json:
        if report is not None:
            result = {**result, "scale": {**report, "model_note": note}}
        if placement is not None:
            result = {**result, "placement": placement}
        if note and report is None:
            result = {**result, "model_note": note}
        typer.echo(json.dumps(result))
        return
    from kuangchao_core.engine.perf_report import format_scale_report
    from kuangchao_core.engine.traffic import format_placement

    text = format_plan(result)
    if placement is not None:
        text += "\n" + format_placement(placement)
    scaled = format_scale_report(report) if report is not None else None
    typer.echo("\n".join(x for x in (note, text, scaled) if x))


def _warn(config: str, path: str, message: str) -> None:
    """A warning as its finding on one line and each of its remedies (the message's ``; ``-separated clauses) on its
    own indented line below, instead of one line of several hundred characters."""
    finding, *remedies = message.split("; ")
    finding = finding.replace(" but ", "\n  but ", 1)
    typer.echo("\n".join([f"{config}: warning: {path}: {finding}", *(f"  - {r}" for r in remedies)]), err=True)


def _placement(cfg):
    """The static cluster's placement, from a kept probe of its nodes when there is one (``kc topology show``)."""
    from kuangchao_core.engine.traffic import described_placement
    from kuangchao_core.sched.topology import remembered_reports

    hosts = {n.host for n in cfg.cluster.worker_nodes} if cfg.cluster.mode == "static" else set()
    report = next((r for r in remembered_reports() if hosts and hosts <= set(r.nodes)), None)
    return described_placement(cfg, report)


def register(app: typer.Typer) -> None:
    """Add ``kc plan`` to the CLI."""
    app.command("plan")(plan)
