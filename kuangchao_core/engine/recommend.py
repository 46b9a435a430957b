"""``kc recommend`` (SPEC L3.7): the best dp×cp×tp×pp×ZeRO×micro-batch layouts of a model on a cluster.

Every layout that uses all the cluster's GPUs is tried: cp over the divisors of the GPU count that split the
sequence into 2·cp equal chunks (context parallelism's load-balanced causal layout), tp and pp over the divisors
of what is left, sequence parallelism off and on when tp > 1 (and tp divides the s/cp tokens of a rank), ZeRO
stage 0/1/2 (0 only without data parallelism, where ZeRO has nothing to shard), micro-batch 1, 2, 4, … up to 32,
and the accumulation that keeps the global batch (sequences per step) fixed; for a MoE model (``model.moe``,
issue 40) also expert parallelism, ep over the divisors of dp that divide the experts, at ZeRO 0 (what the
engine runs ep with for now), each ep layout with its experts' memory split over ep, its all-to-all time and its
experts' gradient sum over dp/ep (``engine.plan_experts``, ``sched.perf_moe``). A layout is rejected when

- the global batch is not a multiple of dp × micro-batch;
- the config schema or :func:`~kuangchao_core.engine.plan.check_plan` refuses it (TP must divide heads, key/value
  heads, vocabulary and MLP width; layers must divide into pp stages; 1F1B needs enough micro-batches; …);
- its estimated memory on the fullest rank exceeds the usable GPU memory (``usable_fraction`` of it, for the
  CUDA context and allocator slack): the estimate ``kc plan`` prints for that rank
  (:func:`~kuangchao_core.engine.memory_model.estimate_ranks`: parameters, gradients and optimizer state as the
  engine allocates them in fp32 or bf16 autocast — ``parallel.state_memory`` — autocast's weight copies,
  activations), with the job's LoRA and activation checkpointing when a config is given.

The others are ranked by the step time :func:`~kuangchao_core.sched.perf_model.predict_step` predicts (the
global batch is the same for all, so this is also tokens/s). Only the 1F1B schedule is considered. The model
assumes the same FLOP rate for every micro-batch size; a GPU runs very small micro-batches below it.

Context parallelism is for sequences that do not fit: when some layout without it fits, every fitting layout is
ranked; when none does, only the layouts with the smallest cp that has any fitting layout are recommended, and
``context_parallel`` says why (the least memory a layout without CP needs against the usable memory, and how cp
splits each sequence).
"""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kuangchao_core.config import config_from_dict
from kuangchao_core.engine.memory_model import estimate_ranks
from kuangchao_core.engine.model_shape import model_section_of
from kuangchao_core.engine.plan import check_plan
from kuangchao_core.errors import ConfigError
from kuangchao_core.sched.perf_model import ClusterModel, Layout, predict_step

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
GIB = 2**30


@dataclass(frozen=True)
class GpuPool:
    """The cluster to plan for: the step-time model plus the memory of one GPU (bytes)."""

    cluster: ClusterModel
    gpu_memory_bytes: float
    usable_fraction: float = 0.9

    @property
    def usable_bytes(self) -> float:
        """Memory a rank may plan to use: ``gpu_memory_bytes × usable_fraction``."""
        return self.gpu_memory_bytes * self.usable_fraction


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layout_data(model_cfg: Any, layout: Layout, precision: str, carried: dict[str, Any] | None) -> dict[str, Any]:
    """The job config (as a dict) of ``layout``: the model, the batch, ``precision`` and what ``carried`` keeps
    of the user's job (``model.lora``, ``train.activation_checkpointing``: :func:`carried_settings`)."""
    carried = carried or {}
    return {
        "task": {"name": "kc-recommend"},
        "model": {**model_section_of(model_cfg), "lora": carried.get("lora")},
        "data": {"seq_len": layout.seq_len},
        "train": {
            "dtype": precision,
            # bf16 parameters (fp32 master weights) only go with bf16 compute
            "param_dtype": carried.get("param_dtype", "fp32") if precision == "bf16" else "fp32",
            "activation_checkpointing": carried.get("activation_checkpointing", "none"),
        },
        "parallel": {
            "data_parallel_size": layout.dp,
            "tensor_parallel_size": layout.tp,
            "pipeline_parallel_size": layout.pp,
            "context_parallel_size": layout.cp,
            "expert_parallel_size": layout.ep,
            "sequence_parallel": layout.sequence_parallel,
            "zero_stage": layout.zero_stage,
            "micro_batch_size": layout.micro_batch_size,
            "gradient_accumulation_steps": layout.gradient_accumulation_steps,
        },
    }


def carried_settings(cfg: Any) -> dict[str, Any]:
    """What a job config's memory depends on besides the layout and the dtype: ``model.lora``,
    ``train.activation_checkpointing`` and ``train.param_dtype`` (every layout :func:`recommend` tries keeps them)."""
    lora = cfg.model.lora
    return {
        "lora": None if lora is None else cfg.to_dict()["model"]["lora"],
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "param_dtype": cfg.train.param_dtype,
    }


def _fullest(cfg: Any) -> dict[str, float]:
    """The largest rank of one replica by ``engine.memory_model.estimate_ranks`` (what ``kc plan`` prints); TP
    rank 0 of each stage stands for its stage (``check_plan`` made TP split every tensor evenly), CP rank 0 for
    its CP group (every CP rank holds as many tokens)."""
    tp, pp = cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size
    worst = max(estimate_ranks(cfg, [s * tp for s in range(pp)]), key=lambda r: r["memory_bytes"]["total"])
    return {**worst["memory_bytes"], "parameters": float(worst["parameters"])}


def memory_per_rank(
    model_cfg: Any, layout: Layout, precision: str = "fp32", carried: dict[str, Any] | None = None
) -> dict[str, float]:
    """Estimated bytes on the fullest rank of ``layout`` (the 1F1B schedule): the memory ``kc plan`` gives that
    rank (``engine.memory_model``), with its ``parameters``."""
    return _fullest(config_from_dict(_layout_data(model_cfg, layout, precision, carried)))


def _check_layout(
    model_cfg: Any, layout: Layout, precision: str, carried: dict[str, Any] | None
) -> tuple[Any, list[tuple[str, str]]]:
    try:
        cfg = config_from_dict(_layout_data(model_cfg, layout, precision, carried))
    except ConfigError as exc:
        return None, list(exc.errors)
    return cfg, check_plan(cfg, world_size=layout.world_size)


def _layout_dict(layout: Layout) -> dict[str, int]:
    return layout.layout_dict()


def _base_layouts(world: int, seq_len: int, eb: int) -> list[Layout]:
    """Every dp×cp×tp×pp split of ``world`` ranks (module docstring): cp splitting the sequence into 2·cp equal
    chunks, sequence parallelism off and on where tp > 1 divides a rank's s/cp tokens."""
    out = []
    for cp in (c for c in _divisors(world) if seq_len % (2 * c) == 0 or c == 1):
        for tp in _divisors(world // cp):
            for pp in _divisors(world // (cp * tp)):
                for sp in (False, True) if tp > 1 and (seq_len // cp) % tp == 0 else (False,):
                    out.append(Layout(world // (cp * tp * pp), tp, pp, 0, 1, 1, seq_len, eb, 1, cp, sp))
    return out


def _expert_sizes(model_cfg: Any, dp: int, zero: int) -> list[int]:
    """The ep sizes to try: 1, and for a MoE model at ZeRO 0 every divisor of ``dp`` that divides its experts."""
    moe = getattr(model_cfg, "moe", None)
    if moe is None or zero != 0:
        return [1]
    return [e for e in _divisors(dp) if moe.num_experts % e == 0]


def _needed_gib(message: str) -> float:
    """The GiB per rank an out-of-memory message of :func:`evaluate_layout` says the layout needs."""
    return float(re.search(r"needs ([\d.]+) GiB", message).group(1))


def _context_parallel_choice(valid: list[dict[str, Any]], least: str | None, seq_len: int) -> dict[str, Any] | None:
    """When no layout without CP is among the fitting ``valid`` rows but one with CP is: the smallest such cp and
    why (``least``: the out-of-memory message of the layout without CP that needs the least); else None."""
    cps = {r["layout"].get("cp", 1) for r in valid}
    if not cps or 1 in cps:
        return None
    cp = min(cps)
    return {
        "cp": cp,
        "why": f"no layout without context parallelism fits {seq_len}-token sequences (the one "
        f"that needs least: {least}); context_parallel_size {cp} splits each sequence into {2 * cp} chunks, {seq_len // cp} tokens "
        "per rank, and is the smallest that fits",
    }


def _reason_key(path: str, message: str) -> str:
    return f"{path}: " + re.sub(r"(?<![\w'.])\d+(\.\d+)?(?![\w'])", "N", message)


def evaluate_layout(
    model_cfg: Any,
    layout: Layout,
    pool: GpuPool,
    precision: str = "bf16",
    method: str = "hierarchical",
    carried: dict[str, Any] | None = None,
) -> tuple[dict[str, Any] | None, list[tuple[str, str]]]:
    """One layout: ``(row, [])`` with its memory per rank and predicted step when it fits, else ``(None, reasons)``
    as ``(reason key, message)`` pairs (module docstring); ``carried``: :func:`carried_settings` of the job."""
    cfg, errors = _check_layout(model_cfg, layout, precision, carried)
    if errors:
        return None, [(_reason_key(path, message), f"{path}: {message}") for path, message in errors]
    mem = _fullest(cfg)
    if mem["total"] > pool.usable_bytes:
        return None, [
            (
                "out of memory: estimated memory per rank exceeds the usable GPU memory",
                f"out of memory: needs {mem['total'] / GIB:.1f} GiB per rank (states "
                f"{(mem['params'] + mem['grads'] + mem['optimizer']) / GIB:.1f}, autocast casts "
                f"{mem['autocast_casts'] / GIB:.1f}, activations {mem['activations_estimate'] / GIB:.1f}) > "
                f"{pool.usable_bytes / GIB:.1f} GiB usable",
            )
        ]
    pred = predict_step(model_cfg, layout, pool.cluster, method=method)
    row = {
        "layout": _layout_dict(layout),
        "memory_per_rank_bytes": mem,
        "step_s": pred.step_s,
        "tokens_per_s": pred.tokens_per_s,
        "mfu": pred.mfu,
        "breakdown": pred.breakdown,
    }
    return row, []


def recommend(
    model_cfg: Any,
    pool: GpuPool,
    global_batch_size: int,
    seq_len: int,
    precision: str = "bf16",
    method: str = "hierarchical",
    top_k: int = 5,
    current: Layout | None = None,
    carried: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Enumerate, check, estimate and rank the layouts (module docstring); a JSON-ready result.

    ``top``: the best ``top_k`` layouts with memory per rank, step time, tokens/s and MFU; ``rejections``: one
    entry per reason (numbers replaced by N) with its count and one example; a layout may fail several checks.
    ``current`` (e.g. the config's layout): reported as ``current`` with its place in the ranking or its reasons.
    ``carried``: :func:`carried_settings` of the user's job (LoRA, activation checkpointing), kept by every layout.
    """
    if precision not in ("fp32", "bf16"):
        raise ConfigError([("precision", f"must be fp32 or bf16, got {precision!r}")])
    world = pool.cluster.world_size
    eb = 4 if precision == "fp32" else 2
    rejections: OrderedDict[str, dict[str, Any]] = OrderedDict()
    valid: list[dict[str, Any]] = []
    considered = 0
    least: str | None = None  # the out-of-memory message of the layout without CP that needs the least

    def reject(key: str, layout: Layout, message: str) -> None:
        entry = rejections.setdefault(key, {"reason": key, "count": 0, "example": None})
        entry["count"] += 1
        if entry["example"] is None:
            entry["example"] = {"layout": _layout_dict(layout), "message": message}

    for base in _base_layouts(world, seq_len, eb):
        dp = base.dp
        zeros = ((0, 1, 2, 3) if base.pp == 1 else (0, 1, 2)) if dp > 1 else (0,)
        for zero, ep in ((z, e) for z in zeros for e in _expert_sizes(model_cfg, dp, z)):
            for b in MICRO_BATCHES:
                considered += 1
                m, rest = divmod(global_batch_size, dp * b)
                layout = dataclasses.replace(
                    base, zero_stage=zero, micro_batch_size=b, gradient_accumulation_steps=max(m, 1), ep=ep
                )
                if rest or m < 1:
                    reject(
                        "global batch: the global batch is not a multiple of dp x micro_batch_size",
                        layout,
                        f"global batch {global_batch_size} sequences is not a multiple of dp {dp} x "
                        f"micro_batch_size {b} = {dp * b}",
                    )
                    continue
                row, reasons = evaluate_layout(model_cfg, layout, pool, precision, method, carried)
                for key, message in reasons:
                    reject(key, layout, message)
                    if key.startswith("out of memory") and layout.cp == 1:
                        least = min(least or message, message, key=_needed_gib)
                if row is not None:
                    valid.append(row)
    valid.sort(key=lambda r: (r["step_s"], r["layout"]["zero_stage"], r["memory_per_rank_bytes"]["total"]))
    fitting = len(valid)
    context = _context_parallel_choice(valid, least, seq_len)
    if context is not None:
        valid = [r for r in valid if r["layout"].get("cp", 1) == context["cp"]]
    result: dict[str, Any] = {
        "cluster": pool.cluster.name,
        "world_size": world,
        "gpu_memory_bytes": pool.gpu_memory_bytes,
        "usable_memory_bytes": pool.usable_bytes,
        "flops_per_s_per_gpu": pool.cluster.flops_per_s,
        "global_batch_size": global_batch_size,
        "seq_len": seq_len,
        "precision": precision,
        "param_dtype": (carried or {}).get("param_dtype", "fp32") if precision == "bf16" else "fp32",
        "method": method,
        "considered": considered,
        "valid": fitting,
        "top": valid[:top_k],
        "rejected": considered - fitting,
        "rejections": sorted(rejections.values(), key=lambda e: -e["count"]),
        "context_parallel": context,
        "current": None,
    }
    if current is not None:
        current = dataclasses.replace(current, seq_len=seq_len, bytes_per_element=eb, virtual_pipeline_size=1)
        key = _layout_dict(current)
        place = next((i for i, r in enumerate(valid, 1) if r["layout"] == key), None)
        if current.world_size != world:
            row, reasons = None, [("world size", f"needs {current.world_size} GPUs, the cluster has {world}")]
        else:
            row, reasons = evaluate_layout(model_cfg, current, pool, precision, method, carried)
        result["current"] = {"layout": key, "rank": place, "row": row, "reasons": [m for _, m in reasons]}
    return result


def _precision_text(result: dict[str, Any]) -> str:
    if result.get("param_dtype") == "bf16":
        return f"{result['precision']} (bf16 parameters, fp32 master weights)"
    return str(result["precision"])


def _cp_sp(lay: dict[str, Any]) -> str:
    return (
        (f" cp {lay['cp']}" if "cp" in lay else "")
        + (" sp" if lay.get("sequence_parallel") else "")
        + (f" ep {lay['ep']}" if "ep" in lay else "")
    )


def format_recommendation(result: dict[str, Any], model_note: str = "") -> str:
    """Human-readable text of :func:`recommend`'s result."""
    lines = []
    if model_note:
        lines.append(f"model: {model_note}")
    lines += [
        f"cluster: {result['cluster']}; {result['gpu_memory_bytes'] / 1e9:g} GB per GPU "
        f"({result['usable_memory_bytes'] / GIB:.1f} GiB usable); {result['flops_per_s_per_gpu'] / 1e12:.1f} TFLOP/s "
        "per GPU sustained",
        f"batch: {result['global_batch_size']} sequences x {result['seq_len']} tokens per step; {_precision_text(result)}; "
        f"DP gradients: {result['method']} all-reduce",
        f"{result['valid']} of {result['considered']} layouts fit; the best {len(result['top'])}:",
    ]
    if result["top"]:
        lines.append("   #   dp  cp  tp  sp  pp  ep  zero  micro  accum   mem/rank GiB   step s   tokens/s   MFU")
        for i, r in enumerate(result["top"], 1):
            lay = r["layout"]
            mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
            sp = "on" if lay.get("sequence_parallel") else "-"
            lines.append(
                f"  {i:>2}  {lay['dp']:>3} {lay.get('cp', 1):>3} {lay['tp']:>3} {sp:>3} {lay['pp']:>3} {lay.get('ep', 1):>3}  "
                f"{lay['zero_stage']:>4}  "
                f"{lay['micro_batch_size']:>5}  {lay['gradient_accumulation_steps']:>5}   "
                f"{r['memory_per_rank_bytes']['total'] / GIB:>12.1f}   {r['step_s']:>6.3f}   "
                f"{r['tokens_per_s']:>8,.0f}   {mfu:>5}"
            )
    else:
        lines.append("  no layout fits")
    if result.get("context_parallel"):
        lines.append(f"context parallelism: {result['context_parallel']['why']}")
    cur = result.get("current")
    if cur is not None:
        lay = cur["layout"]
        name = (
            f"dp {lay['dp']}{_cp_sp(lay)} tp {lay['tp']} pp {lay['pp']} zero {lay['zero_stage']} micro "
            f"{lay['micro_batch_size']} accum {lay['gradient_accumulation_steps']}"
        )
        if cur["row"] is not None:
            lines.append(
                f"the config's layout ({name}): #{cur['rank']} of {result['valid']}, "
                f"{cur['row']['memory_per_rank_bytes']['total'] / GIB:.1f} GiB per rank, step {cur['row']['step_s']:.3f} s, "
                f"{cur['row']['tokens_per_s']:,.0f} tokens/s"
            )
        else:
            lines.append(f"the config's layout ({name}) does not fit: " + "; ".join(cur["reasons"]))
    lines.append(
        "(the model assumes the same FLOP rate at every micro-batch size; a GPU runs very small ones below it)"
    )
    lines.append(f"rejected {result['rejected']} layout(s), by reason (a layout may fail several checks):")
    for e in result["rejections"]:
        ex = e["example"]
        lay = ex["layout"]
        lines.append(  # the example's own numbers: the grouping key's N placeholders are not for reading
            f"  {e['count']:>4} x like dp {lay['dp']}{_cp_sp(lay)} tp {lay['tp']} pp {lay['pp']} "
            f"zero {lay['zero_stage']} micro {lay['micro_batch_size']}: {ex['message']}"
        )
    return "\n".join(lines)
