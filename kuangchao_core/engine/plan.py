"""The parallel plan of a job, computed before anything runs: groups, stages, micro-batches, bubble, memory.

- :func:`check_plan` returns every reason the layout cannot run, as ``(dotted_path, message)`` pairs with the
  numbers (TP not dividing heads / kv heads / vocabulary / MLP width, layers not divisible by pp x v, micro-batch
  counts the schedule cannot run, world size not matching the cluster or the launched processes, an encoder TP
  size not dividing the heads or MLP width of a LLaVA ``model.checkpoint``'s tower, a largest rank past any
  machine's memory: ``engine.plan_bounds``). The engine runs
  it before launch (:func:`raise_for_plan`, which also refuses a layout whose largest rank's estimated memory
  exceeds what a rank of the devices may use: ``engine.plan_memory``).
- :func:`explain_plan` returns a JSON-able description: every TP/PP/DP group's ranks, which global layers each
  (virtual) stage holds, micro-batches per step, the expected bubble fraction, the estimated memory per rank and
  the communicators each rank creates with NCCL's estimated buffers (``engine.plan_comms``).

Memory per rank: :func:`rank_memory`, which is ``engine.memory_model.estimate_ranks`` (state bytes from the
engine's own model ``parallel.state_memory``, autocast's weight copies, activations; ``kc recommend`` uses it too).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kuangchao_core import axes as table
from kuangchao_core.axes import MeshAxes, validated
from kuangchao_core.engine.memory_model import activation_bytes_per_layer, estimate_ranks  # noqa: F401 - re-exported
from kuangchao_core.engine.plan_bounds import size_problems
from kuangchao_core.engine.plan_comms import communicators, format_communicators
from kuangchao_core.engine.plan_vision import format_vision, pretrained_tower_problems, vision_plan
from kuangchao_core.engine.traffic import group_traffic
from kuangchao_core.errors import ConfigError, PlanError

Errors = list[tuple[str, str]]


def _model_config(cfg: Any):
    from kuangchao_core.models.llama import config_from_model_section

    return config_from_model_section(cfg.model)


def check_plan(cfg: Any, world_size: int | None = None) -> Errors:
    """Every plan problem of job config ``cfg`` as ``(dotted_path, message)``; empty when the plan can run.

    ``world_size``: the number of processes actually launched, when known (else the cluster section's).
    """
    from kuangchao_core.models.tp_llama import validate_tp
    from kuangchao_core.parallel.pipeline import partition_layers
    from kuangchao_core.parallel.pp_schedules import validate_schedule

    par = cfg.parallel
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    v, m = par.virtual_pipeline_size, par.gradient_accumulation_steps
    errors: Errors = []

    def collect(fn, *args) -> None:
        try:
            fn(*args)
        except ConfigError as exc:  # PlanError included
            errors.extend(exc.errors)

    try:
        mcfg = _model_config(cfg)
    except ConfigError as exc:
        errors.extend(exc.errors)
        mcfg = None
    if mcfg is not None:
        collect(validate_tp, mcfg, tp)
        collect(partition_layers, mcfg.num_layers, pp, v)
        if pp > 1 and mcfg.tie_embeddings:
            errors.append(
                (
                    "model.tie_embeddings",
                    f"tied embeddings would put one weight on pipeline stage 0 and stage {pp * v - 1}; set "
                    "tie_embeddings false or pipeline_parallel_size 1",
                )
            )
        errors.extend(pretrained_tower_problems(cfg))  # a LLaVA directory's tower against the encoder's TP size
    if pp > 1:
        collect(validate_schedule, par.pipeline_schedule, pp, m, v)
    elif v > 1:
        errors.append(
            (
                "parallel.virtual_pipeline_size",
                f"virtual_pipeline_size {v} needs pipeline_parallel_size > 1, got {pp}",
            )
        )
    devices = getattr(getattr(cfg, "cluster", None), "devices", None)
    axes = MeshAxes.from_parallel(par)
    if world_size is None and devices is not None and devices != axes.world_size:
        shown = axes.shown()
        errors.append(
            (
                "parallel.data_parallel_size",
                f"{' x '.join(table.SIZE_KEYS[a] for a in shown)} = {'x'.join(str(axes.sizes[a]) for a in shown)} = "
                f"{axes.world_size} processes, but the cluster provides {devices}",
            )
        )
    collect(validated, axes.sizes, world_size)
    errors.extend(interface_problems(cfg))  # a primitive the job may not use would fail the run at its first call
    unique: Errors = []
    for e in errors:
        if e not in unique:
            unique.append(e)
    return unique or size_problems(cfg)  # a layout that runs, but past any machine's memory (engine.plan_bounds)


def required_primitives(cfg: Any) -> dict[str, str]:
    """The communication primitives the job's layout uses, each with what needs it (empty for one process)."""
    par = cfg.parallel
    if MeshAxes.from_parallel(par).world_size == 1:
        return {}
    need = {
        "broadcast": "every multi-process job (the checkpoint plan, replicas' first parameters)",
        "all_reduce": "every multi-process job (the loss, the gradient norm, DP gradients, TP partial sums)",
    }
    if par.pipeline_parallel_size > 1:
        need["send"] = need["recv"] = f"pipeline_parallel_size {par.pipeline_parallel_size} (stage boundaries)"
    if par.zero_stage:
        need["reduce_scatter"] = need["all_gather"] = f"zero_stage {par.zero_stage} (sharded gradients, parameters)"
    elif par.data_parallel_size > 1 and par.hierarchical_allreduce == "on":
        need["reduce_scatter"] = need["all_gather"] = "hierarchical_allreduce on"
    if par.data_parallel_size > 1 and par.grad_compression == "topk" and not par.zero_stage:
        need.setdefault("all_gather", "grad_compression topk (sparse exchange)")
    sizes = MeshAxes.from_parallel(par).sizes
    for a in (a for a in table.TABLE if sizes[a.name] > 1):
        need.update({op: f"{a.size_key} {sizes[a.name]}" for op in a.needs if op not in need})
    return need


def interface_problems(cfg: Any) -> Errors:
    """Primitives the layout needs that ``permission.allowed_interfaces`` leaves out (enforcing mode), named.

    Part of :func:`check_plan`, so ``kc plan``, ``kc config validate`` and the flow refuse such a job before anything
    starts (a worker denied a primitive would fail the run at its first call, and a denial is never retried)."""
    perm = getattr(cfg, "permission", None)
    allowed = getattr(perm, "allowed_interfaces", None)
    if allowed is None or getattr(perm, "mode", "enforcing") != "enforcing":
        return []
    missing: dict[str, list[str]] = {}
    for prim, why in required_primitives(cfg).items():
        if prim not in allowed:
            missing.setdefault(why, []).append(prim)
    return [
        (
            "permission.allowed_interfaces",
            f"{why} needs {', '.join(prims)}, which the list {sorted(allowed)} leaves out; add "
            f"{'them' if len(prims) > 1 else 'it'} or change the layout",
        )
        for why, prims in missing.items()
    ]


def raise_for_plan(cfg: Any, world_size: int | None = None, device_memory: Any = None) -> None:
    """Raise PlanError listing every problem :func:`check_plan` finds, or, for a layout that can run, why the
    largest rank's estimated memory does not fit in what a rank of this machine's devices may use
    (``engine.plan_memory``: the numbers, the device, what to change).

    ``device_memory``: bytes per rank (a number) or a ``plan_memory.DeviceMemory``, instead of measuring it here
    (None: measured; skipped where it cannot be known, e.g. a static cluster before launch)."""
    errors = check_plan(cfg, world_size) or unbuilt_problems(cfg) or memory_problems(cfg, world_size, device_memory)
    if errors:
        raise PlanError(errors)


def unbuilt_problems(cfg: Any) -> Errors:
    """What context parallelism (``parallel.context_parallel_size`` > 1; issue 30) cannot run with, each named by
    its field, so such a job is refused before launch rather than run as something else: a sequence length that
    does not split into ``2·cp`` equal chunks (the load-balanced layout) or, with sequence parallelism, whose
    ``s/cp`` positions per CP rank do not split over TP, and ``train.compile`` (the ring's point-to-point exchanges
    inside a compiled layer are not supported)."""
    cp = getattr(cfg.parallel, "context_parallel_size", 1)
    errors: Errors = _vision_unbuilt(cfg, cp)
    if cp == 1:
        return errors
    seq_len = int(cfg.data.seq_len)
    if seq_len % (2 * cp):
        errors.append(
            (
                "data.seq_len",
                f"seq_len {seq_len}: context_parallel_size {cp} splits each sequence into 2*{cp} = {2 * cp} equal "
                f"chunks; use a sequence length divisible by {2 * cp}",
            )
        )
    tp = int(cfg.parallel.tensor_parallel_size)
    if not errors and getattr(cfg.parallel, "sequence_parallel", False) and tp > 1 and (seq_len // cp) % tp:
        errors.append(
            (
                "data.seq_len",
                f"seq_len {seq_len}: each CP rank holds {seq_len // cp} positions, which sequence parallelism splits "
                f"over tensor_parallel_size {tp}; use a sequence length divisible by {cp * tp} and by {2 * cp}",
            )
        )
    if getattr(cfg.train, "compile", False):
        errors.append(
            (
                "train.compile",
                f"train.compile with context_parallel_size {cp}: the ring attention's exchanges are not compiled; "
                "set train.compile false or context_parallel_size 1",
            )
        )
    return errors


def _vision_unbuilt(cfg: Any, cp: int) -> Errors:
    """The layouts a vision tower (``model.vision``, issue 31) does not run with yet, refused before launch."""
    if getattr(cfg.model, "vision", None) is None:
        return []
    par, unbuilt = cfg.parallel, []
    if getattr(par, "sequence_parallel", False):
        unbuilt.append("parallel.sequence_parallel")
    if cp > 1:
        unbuilt.append(f"context_parallel_size {cp}")
    return [("model.vision", f"a vision tower with {u}: not built yet") for u in unbuilt]


def memory_problems(cfg: Any, world_size: int | None = None, memory: Any = None) -> Errors:
    """``[("parallel", message)]`` when the largest rank of ``cfg``'s layout (one that :func:`check_plan` accepts)
    needs more memory than a rank may use, with the numbers and what to change; else [].

    ``memory``: bytes per rank (a number) or a ``plan_memory.DeviceMemory``; None measures it where the check runs
    (``plan_memory.device_memory``) and skips the check where that cannot be known."""
    from kuangchao_core.engine.plan_memory import DeviceMemory, device_memory, fit_problems

    if memory is None:
        memory = device_memory(cfg, world_size)
        if memory is None:
            return []
    elif not isinstance(memory, DeviceMemory):
        memory = DeviceMemory(float(memory), "the device", "as given")
    par = cfg.parallel
    first_replica = range(MeshAxes.from_parallel(par).world_size // par.data_parallel_size)  # DP replicas hold the same
    return fit_problems(par, rank_memory(cfg, first_replica), memory)


def _raise_for_layout(cfg: Any) -> None:
    errors = check_plan(cfg)
    if errors:
        raise PlanError(errors)


def rank_memory(cfg: Any, ranks: Iterable[int] | None = None) -> list[dict[str, Any]]:
    """The estimated memory of each rank in ``ranks`` (default: all) of a layout :func:`check_plan` accepts:
    ``{"rank", "coords", "parameters", "memory_bytes": {params, grads, optimizer, autocast_casts,
    activations_estimate, [gathered_blocks,] total}}`` (``engine.memory_model``). Raises PlanError on a bad plan."""
    _raise_for_layout(cfg)
    return estimate_ranks(cfg, ranks)


def explain_plan(cfg: Any) -> dict[str, Any]:
    """JSON-able description of the layout (call :func:`check_plan` first; this raises PlanError on a bad plan).

    Memory is not checked against the devices here (``kc plan`` warns about it; :func:`raise_for_plan` refuses)."""
    from kuangchao_core.parallel.mesh import mesh_layout
    from kuangchao_core.parallel.pipeline import partition_layers
    from kuangchao_core.parallel.pp_schedules import bubble_fraction

    _raise_for_layout(cfg)
    mcfg = _model_config(cfg)
    par = cfg.parallel
    dp, pp = par.data_parallel_size, par.pipeline_parallel_size
    v, m, b = par.virtual_pipeline_size, par.gradient_accumulation_steps, par.micro_batch_size
    layout = mesh_layout(MeshAxes.from_parallel(par).sizes)
    chunks = partition_layers(mcfg.num_layers, pp, v)
    stages = [
        {
            "pp_rank": r,
            "chunks": [
                {
                    "chunk": c.chunk,
                    "virtual_stage": c.stage,
                    "layers": list(range(c.start, c.end)),
                    "embedding": c.has_embedding,
                    "head": c.has_head,
                }
                for c in chunks[r]
            ],
        }
        for r in range(pp)
    ]
    seq = getattr(getattr(cfg, "data", None), "seq_len", None) or mcfg.max_seq_len
    zero = par.zero_stage
    ranks = rank_memory(cfg)
    bubble = bubble_fraction(pp, m, v if par.pipeline_schedule == "interleaved_1f1b" else 1) if pp > 1 else 0.0
    return {
        "sizes": {**layout.describe()["sizes"], "virtual": v, "world_size": layout.world_size},
        "groups": {k: val for k, val in layout.describe().items() if k != "sizes"},
        "stages": stages,
        "batch": {
            "micro_batch_size": b,
            "micro_batches_per_step": m,
            "global_batch_size": b * m * dp,
            "seq_len": seq,
        },
        "schedule": par.pipeline_schedule if pp > 1 else None,
        "bubble_fraction": bubble,
        "bubble_formula": (
            None
            if pp == 1
            else f"(p-1)/(v*m+p-1) = ({pp}-1)/({v}*{m}+{pp}-1)"
            if par.pipeline_schedule == "interleaved_1f1b"
            else f"(p-1)/(m+p-1) = ({pp}-1)/({m}+{pp}-1)"
        ),
        "zero_stage": zero,
        "sequence_parallel": bool(getattr(par, "sequence_parallel", False)),
        "traffic_bytes_per_step": group_traffic(cfg),
        "model_parameters": mcfg.num_params(),
        "ranks": ranks,
        "vision": vision_plan(cfg),  # the encoder's own layout (issue 31)
        "communicators": communicators(cfg),  # per rank, with NCCL's reserved buffers (an estimate)
    }


_MEMORY_COLUMNS = ("params", "grads", "optimizer", "autocast_casts", "activations_estimate", "total")


def rank_memory_rows(ranks: list[dict[str, Any]]) -> list[str]:
    """One row per distinct memory figure: ranks with the same figures share a row that names them and the
    coordinates they have in common (16 ranks of a dp4 × tp2 × pp2 plan print as 2 rows, one per pipeline stage)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in ranks:
        figures = " / ".join(f"{r['memory_bytes'][k] / 2**20:.2f}" for k in _MEMORY_COLUMNS)
        groups.setdefault(figures, []).append(r)
    rows = []
    for figures, members in groups.items():
        coords = [m["coords"] for m in members]
        shared = [k for k in table.shown_order() if k in coords[0] and len({c[k] for c in coords}) == 1]
        where = ", ".join(f"{k} {coords[0][k]}" for k in shared) or "every coordinate"
        label = (
            f"rank {members[0]['rank']}" if len(members) == 1 else f"ranks {rank_ranges(m['rank'] for m in members)}"
        )
        rows.append(f"  {label} ({where}): {figures}")
    return rows


def rank_ranges(ranks: Iterable[int]) -> str:
    """``0-1, 4-5, 8`` for ranks 0, 1, 4, 5, 8."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def format_plan(plan: dict[str, Any]) -> str:
    """Human-readable text of :func:`explain_plan`'s result."""
    s = plan["sizes"]
    lines = [
        f"layout: {' x '.join(f'{a}={s[a]}' for a in table.shown_order() if a in s and a in table.GRID)} (virtual "
        f"{s['virtual']}{''.join(f'; {a.name}={s[a.name]} within {a.within}' for a in table.TABLE if a.name in s and a.within)})"
        f" = {s['world_size']} processes",
        f"model: {plan['model_parameters']:,} parameters; ZeRO stage {plan['zero_stage']}",
    ]
    for kind in table.BUILD_ORDER:
        groups = plan["groups"].get(f"{kind}_groups")
        if groups is None:
            continue
        lines.append(f"{kind.upper()} groups: " + "  ".join(f"{n}={r}" for n, r in groups.items()))
    for st in plan["stages"]:
        parts = []
        for c in st["chunks"]:
            extra = "+".join(x for x, f in (("embedding", c["embedding"]), ("norm+head", c["head"])) if f)
            layers = f"layers {c['layers'][0]}-{c['layers'][-1]}" if c["layers"] else "no layers"
            parts.append(
                f"chunk {c['chunk']} (virtual stage {c['virtual_stage']}): {layers}{' ' + extra if extra else ''}"
            )
        lines.append(f"pipeline rank {st['pp_rank']}: " + "; ".join(parts))
    bt = plan["batch"]
    lines.append(
        f"batch: {bt['micro_batches_per_step']} micro-batches of {bt['micro_batch_size']} x {bt['seq_len']} tokens "
        f"per step per DP rank; global batch {bt['global_batch_size']} sequences"
    )
    if plan["schedule"]:
        lines.append(
            f"schedule {plan['schedule']}: expected bubble {plan['bubble_fraction']:.3f} = {plan['bubble_formula']}"
        )
    else:
        lines.append("no pipeline: no bubble")
    split = [f"sequence parallel: norms and residuals at s/{s['tp']}"] if plan.get("sequence_parallel") else []
    split += [f"context parallel: s/{s['cp']} = {bt['seq_len'] // s['cp']} tokens per rank"] if "cp" in s else []
    lines.append(
        "memory per rank (MiB): params / grads / optimizer / autocast casts / activations (rough) / total"
        + (f" ({'; '.join(split)})" if split else "")
    )
    lines += rank_memory_rows(plan["ranks"])
    traffic = plan.get("traffic_bytes_per_step", {})
    notes = {"cp": " (ring attention K/V and dK/dV)", "ep": " (tokens' all-to-all)"}
    if plan.get("sequence_parallel"):
        notes["tp"] = " (all-gather + reduce-scatter, norm weights)"
    lines.append(
        "traffic per group member per step (MiB, estimate): "
        + ", ".join(f"{k} {traffic[k] / 2**20:.4g}{notes.get(k, '') if traffic[k] else ''}" for k in traffic)
    )
    return "\n".join(lines + format_vision(plan.get("vision")) + format_communicators(plan.get("communicators")))
