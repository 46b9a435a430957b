"""Weak scaling with the step-time model of :mod:`kuangchao_core.sched.perf_model`: one per-GPU layout grown to
more GPUs by data parallelism, its predicted efficiency per size and DP gradient method."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kuangchao_core.sched.perf_model import ClusterModel, Layout, predict_step

ClusterAt = Callable[[int], ClusterModel] | ClusterModel


def _cluster_for(cluster_at: ClusterAt, n_gpus: int) -> ClusterModel:
    return cluster_at.with_world_size(n_gpus) if isinstance(cluster_at, ClusterModel) else cluster_at(n_gpus)


def _scaled(layout_per_gpu: Layout, n_gpus: int) -> Layout:
    model_ranks = layout_per_gpu.tp * layout_per_gpu.pp * layout_per_gpu.cp
    if n_gpus % model_ranks:
        raise ValueError(f"{n_gpus} GPUs are not a multiple of tp x pp x cp = {model_ranks}")
    return layout_per_gpu.with_dp(n_gpus // model_ranks)


def scaling_point(
    model_cfg: Any, layout_per_gpu: Layout, cluster_at: ClusterAt, n_gpus: int, method: str = "hierarchical", **kw: Any
) -> dict[str, Any]:
    """One weak-scaling point: the layout with ``dp = n_gpus/(tp·pp·cp)`` (per-GPU batch fixed) on
    ``cluster_at(n_gpus)`` (or a ClusterModel grown to ``n_gpus``), with its prediction and efficiency.

    Efficiency = tokens/s at N ÷ (N × tokens/s of one GPU's compute-only step), one GPU's compute-only rate being
    ``flops_per_s / F_tok`` (no bubble, no communication).
    """
    layout = _scaled(layout_per_gpu, n_gpus)
    cluster = _cluster_for(cluster_at, n_gpus)
    pred = predict_step(model_cfg, layout, cluster, method=method, **kw)
    one_gpu = cluster.flops_per_s / pred.flops_per_token
    return {
        "n_gpus": n_gpus,
        "method": method,
        "cluster": cluster.name,
        "dp": layout.dp,
        "efficiency": pred.tokens_per_s / (n_gpus * one_gpu),
        "prediction": pred,
    }


def scaling_efficiency(
    model_cfg: Any, layout_per_gpu: Layout, cluster_at: ClusterAt, n_gpus: int, method: str = "hierarchical", **kw: Any
) -> float:
    """Weak-scaling efficiency at ``n_gpus`` (see :func:`scaling_point`)."""
    return scaling_point(model_cfg, layout_per_gpu, cluster_at, n_gpus, method, **kw)["efficiency"]


def scaling_table(
    model_cfg: Any,
    layout_per_gpu: Layout,
    cluster_at: ClusterAt,
    sizes: Iterable[int] = (64, 128, 512),
    methods: Iterable[str] = ("flat", "hierarchical", "fp16", "topk"),
    **kw: Any,
) -> list[dict[str, Any]]:
    """:func:`scaling_point` for every size × method, as JSON-ready rows (the prediction as a dict)."""
    rows = []
    for n in sizes:
        for method in methods:
            point = scaling_point(model_cfg, layout_per_gpu, cluster_at, n, method, **kw)
            pred = point.pop("prediction")
            point.update(
                step_s=pred.step_s,
                tokens_per_s=pred.tokens_per_s,
                dp_comm_s=pred.dp_comm_s,
                mfu=pred.mfu,
                breakdown=pred.breakdown,
            )
            rows.append(point)
    return rows
