"""``kc recommend``: the best parallel layouts of a model on a cluster, and why the others were rejected (L3.7).

The model: a config's ``model`` section (``--config``), a preset or local Hugging Face directory (``--model``), or a
parameter count (``--params 8e9``). The cluster: ``--nodes`` × ``--gpus-per-node`` GPUs of ``--gpu-memory-gb``,
``--inter-gbps`` (gigabits per second per GPU) between nodes, or the config's ``cluster`` section for the counts.
Exit 0 with the ranking, 1 when no layout fits, 2 for bad input (the message names the option).
"""

from __future__ import annotations

import json

import typer

_SET_HELP = "Override one config setting, e.g. --set data.seq_len=2048 (repeatable; the value is read as YAML)."


def _fail(option: str, message: str) -> None:
    typer.echo(f"{option}: {message}", err=True)
    raise typer.Exit(2)


def _cluster_counts(cfg) -> tuple[int | None, int | None]:
    """(nodes, GPUs per node) that the config's cluster section states, None where it does not."""
    if cfg is None:
        return None, None
    cl = cfg.cluster
    if cl.mode == "local":
        return 1, cl.nproc_per_node
    if cl.mode == "static" and cl.worker_nodes:
        per_node = cl.nproc_per_node or min(n.gpus for n in cl.worker_nodes) or None
        return len(cl.worker_nodes), per_node
    return None, cl.nproc_per_node


def _model(cfg, model: str | None, params: float | None):
    from kuangchao_core.engine.model_shape import shape_for_name, shape_for_params, shape_for_section
    from kuangchao_core.errors import ConfigError

    if model is not None and params is not None:
        _fail("--model/--params", "give one of them, not both")
    try:
        if model is not None:
            return shape_for_name(model)
        if params is not None:
            return shape_for_params(params)
    except ConfigError as exc:
        _fail("--model" if model is not None else "--params", "; ".join(m for _, m in exc.errors))
    if cfg is None:
        _fail("--model/--params/--config", "name the model: a preset or HF directory, a parameter count, or a config")
    try:
        return shape_for_section(cfg.model)
    except ConfigError as exc:
        _fail("--config", "; ".join(f"{p}: {m}" for p, m in exc.errors))
    raise AssertionError("unreachable")


def recommend(
    config: str | None = typer.Option(None, "--config", "-c", help="Job config YAML (model, batch, cluster)."),
    set_: list[str] = typer.Option([], "--set", help=_SET_HELP),
    model: str | None = typer.Option(None, "--model", help="A preset name or a local Hugging Face model directory."),
    params: float | None = typer.Option(None, "--params", help="A parameter count, e.g. 8e9."),
    nodes: int | None = typer.Option(None, "--nodes", min=1, help="Nodes of the cluster."),
    gpus_per_node: int | None = typer.Option(None, "--gpus-per-node", min=1, help="GPUs per node."),
    gpu_memory_gb: float = typer.Option(80.0, "--gpu-memory-gb", help="Memory of one GPU, GB (10^9 bytes)."),
    inter_gbps: float = typer.Option(400.0, "--inter-gbps", help="Gigabits per second per GPU between nodes."),
    intra_gbyte_s: float = typer.Option(450.0, "--intra-gbyte-s", help="NVLink GB/s per GPU and direction."),
    peak_tflops: float = typer.Option(989.5, "--peak-tflops", help="Peak bf16 TFLOP/s of one GPU."),
    mfu: float = typer.Option(0.40, "--mfu", help="Assumed model-FLOPs utilisation of the matmuls (0-1]."),
    seq_len: int | None = typer.Option(
        None, "--seq-len", min=2, help="Tokens per sequence (default: config's, else 2048)."
    ),
    global_batch: int | None = typer.Option(
        None, "--global-batch", min=1, help="Sequences per step (default: the config's, else 256)."
    ),
    dtype: str | None = typer.Option(None, "--dtype", help="fp32 or bf16 (default: config's train.dtype, else bf16)."),
    method: str = typer.Option("hierarchical", "--method", help="DP all-reduce: flat, hierarchical, fp16, bf16, topk."),
    top: int = typer.Option(5, "--top", min=1, help="How many layouts to print."),
    usable: float = typer.Option(0.9, "--usable-fraction", help="Share of GPU memory a rank may plan for (0-1]."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object."),
    pool_name: str | None = typer.Option(
        None, "--pool", help="Take nodes, GPUs per node and the measured link between nodes from this live pool."
    ),
) -> None:
    """Enumerate dp x tp x pp x ZeRO x micro-batch layouts; print the fastest that fit and why the others do not."""
    from kuangchao_core.config import load_config
    from kuangchao_core.engine.recommend import GpuPool, carried_settings, format_recommendation
    from kuangchao_core.engine.recommend import recommend as run
    from kuangchao_core.errors import ConfigError
    from kuangchao_core.sched.perf_model import METHODS, ClusterModel, Layout

    cfg = None
    if config is not None:
        try:
            cfg = load_config(config, set_)
        except ConfigError as exc:
            _fail("--config", "; ".join(f"{p}: {m}" for p, m in exc.errors))
    elif set_:
        _fail("--set", "needs --config")
    for option, value, low in (
        ("--gpu-memory-gb", gpu_memory_gb, 0),
        ("--inter-gbps", inter_gbps, 0),
        ("--intra-gbyte-s", intra_gbyte_s, 0),
        ("--peak-tflops", peak_tflops, 0),
    ):
        if not value > low:
            _fail(option, f"must be > 0, got {value}")
    if not 0 < mfu <= 1:
        _fail("--mfu", f"must be in (0, 1], got {mfu}")
    if not 0 < usable <= 1:
        _fail("--usable-fraction", f"must be in (0, 1], got {usable}")
    if method not in METHODS:
        _fail("--method", f"must be one of {', '.join(METHODS)}, got {method!r}")
    precision = dtype or (cfg.train.dtype if cfg is not None else "bf16")
    precision = {"fp16": "bf16"}.get(precision, precision)
    if precision not in ("fp32", "bf16"):
        _fail("--dtype" if dtype else "--config", f"precision must be fp32 or bf16, got {precision!r}")
    model_cfg, note = _model(cfg, model, params)
    if pool_name is not None:
        live_nodes, live_gpus, measured_gbps = _live_pool(pool_name)
        nodes, gpus_per_node = nodes or live_nodes, gpus_per_node or live_gpus
        if measured_gbps is not None:
            inter_gbps = measured_gbps
            note = "; ".join(
                x for x in (note, f"between nodes: {measured_gbps:.3g} Gb/s measured by the node probe") if x
            )
    cfg_nodes, cfg_gpus = _cluster_counts(cfg)
    nodes, gpus_per_node = nodes or cfg_nodes, gpus_per_node or cfg_gpus
    if nodes is None or gpus_per_node is None:
        _fail("--nodes/--gpus-per-node", "give both (the config's cluster section does not say how many GPUs)")
    seq = seq_len or (cfg.data.seq_len if cfg is not None else 2048)
    batch = global_batch or (cfg.parallel.global_batch_size if cfg is not None else 256)
    cluster = ClusterModel.described(
        nodes,
        gpus_per_node,
        intra_gbyte_per_s=intra_gbyte_s,
        inter_gbit_per_s=inter_gbps,
        peak_flops_per_s=peak_tflops * 1e12,
        mfu=mfu,
    )
    current = Layout.from_config(cfg) if cfg is not None else None
    pool = GpuPool(cluster, gpu_memory_gb * 1e9, usable)
    carried = carried_settings(cfg) if cfg is not None else None
    result = run(model_cfg, pool, batch, seq, precision, method, top, current=current, carried=carried)
    if as_json:
        typer.echo(json.dumps({**result, "model_note": note}))
    else:
        typer.echo(format_recommendation(result, note))
    if not result["top"]:
        raise typer.Exit(1)


def _live_pool(pool: str) -> tuple[int, int, float | None]:
    """(live nodes, ranks per node, measured bandwidth between nodes in Gb/s or None) of a node-agent pool."""
    import os

    from kuangchao_core.sched.node_registry import list_nodes
    from kuangchao_core.sched.topology import remembered_reports

    if not os.environ.get("PREFECT_API_URL"):
        _fail("--pool", "PREFECT_API_URL is not set: the pool's node agents are registered on a Prefect server")
    try:
        live = [n for n in list_nodes(pool) if n.live]
    except Exception as exc:  # noqa: BLE001 - the server's own error, said plainly
        _fail("--pool", f"cannot read the pool from the Prefect API: {exc}")
    if not live:
        _fail("--pool", f"no live node agents in pool {pool!r} (start them with `kc node start --pool {pool}`)")
    names = {n.name for n in live}
    report = next((r for r in remembered_reports() if names <= set(r.nodes) and len(r.nodes) > 1), None)
    gbps = None
    if report is not None:
        idx = [report.nodes.index(n) for n in sorted(names)]
        between = [report.node_bandwidth_gbps[i][j] for i in idx for j in idx if i != j]
        between = [b for b in between if b]
        gbps = min(between) * 8 if between else None
    return len(live), min(n.facts.slots for n in live), gbps


def register(app: typer.Typer) -> None:
    """Add ``kc recommend`` to the CLI."""
    app.command("recommend")(recommend)
