"""A plan no machine can hold, refused wherever a plan is checked (``kc plan``, ``kc train``, the worker).

Each field of the model section has a cap of its own, but together the caps allow shapes whose ranks would need
exabytes (vocabulary 4 M × hidden 65 536 × 1000 layers: about 3.4e9 MiB per rank). :func:`size_problems`
estimates the largest rank (``engine.memory_model``, the estimate ``kc plan`` prints) and refuses a plan past
:data:`MAX_RANK_BYTES`, naming the fields that make it so; the memory of the devices themselves is checked
elsewhere (``engine.plan_memory``: only where they are known)."""

from __future__ import annotations

from typing import Any

#: more than any machine's memory per rank (1 PiB): a plan past it is refused before anything is measured
MAX_RANK_BYTES = float(2**50)
_STATE = ("params", "grads", "optimizer", "autocast_casts", "gathered_blocks")

Errors = list[tuple[str, str]]


def largest_rank(cfg: Any) -> dict[str, Any]:
    """The estimate (``engine.memory_model.estimate_ranks``) of the largest rank of ``cfg``'s first replica, one
    rank per pipeline stage (TP and CP ranks of a stage hold the same amounts; ``check_plan`` made TP divide)."""
    from kuangchao_core.axes import MeshAxes
    from kuangchao_core.engine.memory_model import estimate_ranks

    axes = MeshAxes.from_parallel(cfg.parallel)
    stages = [axes.rank_of(pp=r) for r in range(axes.sizes["pp"])]
    return max(estimate_ranks(cfg, stages), key=lambda r: r["memory_bytes"]["total"])


def size_problems(cfg: Any, limit: float = MAX_RANK_BYTES) -> Errors:
    """``[(path, message)]`` when the largest rank of ``cfg`` (a layout ``check_plan`` otherwise accepts) needs
    more than ``limit`` bytes: under ``model`` (or ``model.checkpoint``, whose ``config.json`` gives the shape)
    when the parameters and their state dominate, else under ``data.seq_len`` (the activations); [] otherwise."""
    from kuangchao_core.models.llama import config_from_model_section

    worst = largest_rank(cfg)
    mem = worst["memory_bytes"]
    if mem["total"] <= limit:
        return []
    m = config_from_model_section(cfg.model)
    shape = (
        f"hidden_size {m.hidden_size}, intermediate_size {m.intermediate_size}, num_layers {m.num_layers}, "
        f"vocab_size {m.vocab_size}"
    )
    par = cfg.parallel
    split = (
        f"parallel.tensor_parallel_size {par.tensor_parallel_size} and parallel.pipeline_parallel_size "
        f"{par.pipeline_parallel_size}"
    )
    need = f"rank {worst['rank']} needs an estimated {_pib(mem['total'])}, more than any machine (limit {_pib(limit)})"
    state = sum(mem.get(k, 0.0) for k in _STATE)
    if state >= mem["activations_estimate"]:
        if getattr(cfg.model, "checkpoint", None) and cfg.model.hidden_size is None:
            where, fields = "model.checkpoint", f"the shape its config.json gives ({shape})"
        else:
            where, fields = "model", "model." + shape.replace(", ", ", model.")
        why = f"{_pib(state)} of parameters, gradients and optimizer state from {fields}, split by {split}"
    else:
        where = "data.seq_len"
        seq = getattr(cfg.data, "seq_len", None) or m.max_seq_len
        why = (
            f"{_pib(mem['activations_estimate'])} of activations from data.seq_len {seq} x "
            f"parallel.micro_batch_size {par.micro_batch_size} x the model's {shape}"
        )
    return [(where, f"{need}: {why}; make the model smaller or split it over more ranks")]


def _pib(n: float) -> str:
    return f"{n / 2**50:.3g} PiB" if n >= 2**40 else f"{n / 2**30:.3g} GiB"
