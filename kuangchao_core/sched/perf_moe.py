"""The step-time model's mixture-of-experts terms (issue 40 item 5), for :func:`~kuangchao_core.sched.perf_model
.predict_step`.

A MoE layer (``model.moe``: E routed experts of width W, top-k, S shared experts) replaces the dense MLP's
``3·h·I`` weights by a router ``h·E`` and ``3·h·W`` per expert:

- **FLOPs** count the *active* weights: a token passes through the router, its k routed experts and the S shared
  ones, ``h·E + 3·h·W·(k + S)`` per MoE layer (:func:`moe_matmul_delta` is the difference to the dense layer);
- **parameters** (what the gradient synchronisation carries, what a stage holds) count every expert,
  ``h·E + 3·h·W·(E + S)`` (:func:`moe_param_delta`); the routed experts' ``3·h·W·E`` (:func:`expert_params`) are
  split over ``ep`` ranks and summed over their d/ep replicas instead of the whole dp group;
- **all-to-all** (:func:`ep_comm_s`): per MoE layer and micro-batch two exchanges forward (the tokens' rows to the
  ranks holding their experts, the outputs back) and two backward, each of the rank's ``b·T·k·h·e`` bytes of
  which (ep−1)/ep leave it under balanced routing, plus the counts' exchange (E 8-byte integers); an exchange
  among n ranks is n−1 pairwise steps of S/n bytes, ``(n−1)·(α + S/n·β)``, on the link of the ep group's span
  (its ranks are consecutive data-parallel indices: placed as a data-parallel group of ep ranks).
"""

from __future__ import annotations

from typing import Any

from kuangchao_core.sched.perf_cluster import ClusterModel, LinkModel
from kuangchao_core.sched.perf_groups import group_span


def _moe(model_cfg: Any) -> tuple[Any, int, int]:
    """``(moe config or None, MoE layers, expert width)``."""
    moe = getattr(model_cfg, "moe", None)
    if moe is None:
        return None, 0, 0
    width = int(getattr(moe, "expert_intermediate_size", None) or model_cfg.intermediate_size)
    return moe, len(moe.moe_layers(model_cfg.num_layers)), width


def moe_matmul_delta(model_cfg: Any) -> int:
    """Active matmul weights the MoE layers add to the dense model's N (module docstring; 0 without MoE)."""
    moe, layers, w = _moe(model_cfg)
    if moe is None:
        return 0
    h = model_cfg.hidden_size
    return layers * (
        h * moe.num_experts + 3 * h * w * (moe.top_k + moe.num_shared_experts) - 3 * h * model_cfg.intermediate_size
    )


def moe_param_delta(model_cfg: Any, pp: int) -> int:
    """Parameters the MoE layers of the busiest stage (⌈L_moe/p⌉ of them) add to its dense count."""
    moe, layers, w = _moe(model_cfg)
    if moe is None:
        return 0
    h, per_stage = model_cfg.hidden_size, -(-layers // pp)
    return per_stage * (
        h * moe.num_experts
        + 3 * h * w * (moe.num_experts + moe.num_shared_experts)
        - 3 * h * model_cfg.intermediate_size
    )


def expert_params(model_cfg: Any, pp: int) -> int:
    """The routed experts' parameters on the busiest stage, all E of them (what ep splits)."""
    moe, layers, w = _moe(model_cfg)
    return 0 if moe is None else -(-layers // pp) * 3 * model_cfg.hidden_size * w * moe.num_experts


def all_to_all_s(size_bytes: float, n: int, link: LinkModel) -> float:
    """One all-to-all in which each of ``n`` ranks holds ``size_bytes`` spread evenly over the ``n`` ranks."""
    return (n - 1) * (link.alpha_s + size_bytes / n * link.beta_s_per_byte) if n > 1 else 0.0


def ep_comm_s(model_cfg: Any, layout: Any, cluster: ClusterModel, placement: str) -> float:
    """Seconds of one step's all-to-alls on the busiest rank (module docstring); 0 at ep 1 or without MoE."""
    moe, layers, _ = _moe(model_cfg)
    ep = getattr(layout, "ep", 1)
    if moe is None or ep <= 1:
        return 0.0
    span = group_span("dp", ep, layout.tp, layout.pp, cluster.ranks_per_node, placement)
    link = cluster.ring_link(span.spans_nodes, span.ring_flows_per_node)
    rows = layout.micro_batch_size * layout.seq_len / layout.cp * moe.top_k * model_cfg.hidden_size
    per_layer = 4 * all_to_all_s(rows * layout.bytes_per_element, ep, link) + all_to_all_s(
        8 * moe.num_experts, ep, link
    )
    return layout.gradient_accumulation_steps * -(-layers // layout.pp) * per_layer
