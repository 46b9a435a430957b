"""A latency–bandwidth plus FLOP model of one training step (issue 11 item 5), pure Python.

:func:`predict_step` adds up, for the busiest rank of a dp×tp×pp layout on a :class:`ClusterModel`:

- **compute**: model FLOPs per token ``F_tok = 6·N + 12·L·h·T`` (PaLM App. B, nanoGPT ``estimate_mfu``,
  torchtitan; ``/work/shared/reference/performance.md`` §2.1; N = matmul parameters: every layer's projections
  and the LM head, not the input embedding nor the norms), times the tokens a DP rank takes per step
  (``b·m·T``), divided by ``tp·pp`` and by the rank's ``flops_per_s``;
- **TP**: Megatron tensor parallel does 2 all-reduces forward and 2 backward per layer and micro-batch, each of
  ``b·T·h`` elements (Megatron §3.2, performance.md §2.4), over the TP group's ring;
  With sequence parallelism the all-reduces become an all-gather and a reduce-scatter (the same ring time) and
  the backward all-gathers the two saved norm outputs again (2 more all-gathers per layer), plus the 2L/p + 1
  norm weights' all-reduces of ``h`` elements;
- **PP**: per micro-batch each stage sends its activations forward and its input gradient back, ``b·T·h``
  elements each (performance.md §2.4; ``b·T·h/t`` under sequence parallelism), ×v with an interleaved schedule;
- **CP** (c ranks per sequence, ``T/c`` tokens each): compute and the TP/PP tensors are those of ``T/c`` tokens;
  per layer and micro-batch the ring attention sends ``6c − 4`` K/V-sized blocks (``b·T/c·kv·e``: K and V on c−1
  times forward and backward, dK/dV c times) to the next CP rank, counted in full (the engine posts each exchange
  before the block it overlaps; not counting the overlap makes this an upper bound); the gradient synchronisation
  runs over the ``d·c`` ranks that hold the same parameters;
- **EP** (a MoE model, issue 40): FLOPs count the active experts, parameters every expert, the routed ones
  E/ep per rank summed over their d/ep replicas, and the tokens' all-to-alls (:mod:`~kuangchao_core.sched.perf_moe`)
  join the pipeline's work;
- **bubble**: the pipeline runs ``v·m + p − 1`` slots for ``v·m`` slots of work, so the work per rank
  (compute + TP + PP) stretches by ``1/(1 − bubble)`` with ``bubble = (p−1)/(v·m+p−1)`` (Megatron §2.2; the
  formula ``engine.plan.explain_plan`` reports);
- **DP**: the gradients of the rank's parameters (Ψ, :func:`params_per_rank`) all-reduced over the DP group
  (ZeRO-1/2: reduce-scatter of gradients + all-gather of parameters, the same volume, performance.md §2.4), by
  ``method``:

  - ``flat``: one ring over the DP group;
  - ``hierarchical``: reduce-scatter inside the node, all-reduce of the ``S/k`` shard across nodes, all-gather
    inside the node (:func:`~kuangchao_core.sched.perf_cluster.hierarchical_all_reduce_s`);
  - ``fp16`` / ``bf16``: the hierarchical scheme on gradients cast to 2 bytes (halves the bytes of an fp32 job;
    nothing changes for a job whose gradients are already 2 bytes);
  - ``topk``: dense reduce-scatter inside the node, then each rank's top ``ratio`` of its shard as (value, index)
    pairs all-gathered across nodes (the sparse exchange of DGC, Lin et al. ICLR'18), dense all-gather inside
    the node; inside one node it is the flat dense all-reduce. Selection time is not counted.

  By default the DP communication is not overlapped with the backward pass (``overlap_dp=False``, what a
  2-core CPU measures, performance.md §3.3); with ``overlap_dp=True`` only the part longer than the backward
  (2/3 of the compute) shows (§2.6). The optimizer step is not counted.

Weak scaling (one layout grown over more GPUs) is :mod:`kuangchao_core.sched.perf_scaling`. Layouts are placed by
:mod:`kuangchao_core.sched.perf_groups` (``aware`` or ``blind``); links and collectives
come from :mod:`kuangchao_core.sched.perf_cluster`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kuangchao_core.sched.perf_cluster import (
    ClusterModel,
    LinkModel,
    all_gather_s,
    all_reduce_bytes,
    all_reduce_s,
    gather_bytes,
    p2p_s,
    reduce_scatter_s,
)
from kuangchao_core.sched.perf_groups import GroupSpan, group_span
from kuangchao_core.sched.perf_moe import ep_comm_s, expert_params, moe_matmul_delta, moe_param_delta

__all__ = [
    "METHODS",
    "ClusterModel",
    "Layout",
    "LinkModel",
    "StepPrediction",
    "flops_per_token",
    "matmul_params",
    "params_per_rank",
    "predict_step",
    "stage_end_params",
]

METHODS = ("flat", "hierarchical", "fp16", "bf16", "topk")

_DTYPE_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Layout:
    """A parallel layout: sizes, ZeRO stage, batch (``micro_batch_size`` × ``gradient_accumulation_steps``
    micro-batches of ``seq_len`` tokens per DP rank and step) and bytes per gradient/activation element."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    seq_len: int = 2048
    bytes_per_element: int = 4
    virtual_pipeline_size: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    ep: int = 1  # expert parallelism, within dp (issue 40; sched.perf_moe)

    @property
    def world_size(self) -> int:
        """Ranks the layout needs: dp × cp × tp × pp."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over the whole job: dp × b × m × T."""
        return self.dp * self.micro_batch_size * self.gradient_accumulation_steps * self.seq_len

    def layout_dict(self) -> dict[str, int]:
        """Sizes, ZeRO stage and batch split, JSON-ready (what reports print; ``cp`` and ``sequence_parallel``
        only when used)."""
        return {
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "zero_stage": self.zero_stage,
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            **({"cp": self.cp} if self.cp > 1 else {}),
            **({"sequence_parallel": True} if self.sequence_parallel else {}),
            **({"ep": self.ep} if self.ep > 1 else {}),
        }

    def with_dp(self, dp: int) -> Layout:
        """The same layout with another data-parallel size (weak scaling keeps everything else)."""
        return dataclasses.replace(self, dp=dp)

    @classmethod
    def from_config(cls, cfg: Any) -> Layout:
        """The layout of a job config (``parallel``, ``data.seq_len``, ``train.dtype``)."""
        par = cfg.parallel
        interleaved = par.pipeline_schedule == "interleaved_1f1b"
        return cls(
            dp=par.data_parallel_size,
            tp=par.tensor_parallel_size,
            pp=par.pipeline_parallel_size,
            zero_stage=par.zero_stage,
            micro_batch_size=par.micro_batch_size,
            gradient_accumulation_steps=par.gradient_accumulation_steps,
            seq_len=cfg.data.seq_len,
            bytes_per_element=_DTYPE_BYTES[cfg.train.dtype],
            virtual_pipeline_size=par.virtual_pipeline_size if interleaved else 1,
            cp=par.context_parallel_size,
            sequence_parallel=par.sequence_parallel,
            ep=getattr(par, "expert_parallel_size", 1),
        )


def matmul_params(model_cfg: Any) -> int:
    """N of ``F_tok``: the layers' projection weights plus the LM head (``vocab × hidden``), no embedding/norms."""
    h, d = model_cfg.hidden_size, model_cfg.hidden_size // model_cfg.num_heads
    layer = 2 * h * model_cfg.num_heads * d + 2 * h * model_cfg.num_kv_heads * d + 3 * h * model_cfg.intermediate_size
    return model_cfg.num_layers * layer + model_cfg.vocab_size * h + moe_matmul_delta(model_cfg)


def flops_per_token(model_cfg: Any, seq_len: int) -> float:
    """Model FLOPs of one trained token: ``6·N + 12·L·h·T`` (performance.md §2.1; H·Q = h; no recompute)."""
    return 6.0 * matmul_params(model_cfg) + 12.0 * model_cfg.num_layers * model_cfg.hidden_size * seq_len


def stage_end_params(model_cfg: Any, tp: int, pp: int) -> tuple[int, int]:
    """Parameters of a TP rank of the first and of the last pipeline stage (the same rank when ``pp == 1``).

    Per layer and TP rank: q and o ``h·(H/t)·d`` each, k and v ``h·max(KV/t, 1)·d`` each (key/value heads are
    replicated when there are fewer than t), the MLP ``3·h·I/t``, two norms ``2h``; ``L/p`` layers per pipeline
    rank; the vocabulary-parallel embedding ``V/t·h`` on the first stage; the LM head ``V/t·h`` (none when tied)
    and the final norm ``h`` on the last.
    """
    h, v, heads, kv = model_cfg.hidden_size, model_cfg.vocab_size, model_cfg.num_heads, model_cfg.num_kv_heads
    d = h // heads
    kv_local = kv // tp if kv >= tp else 1
    layer = 2 * h * (heads // tp) * d + 2 * h * kv_local * d + 3 * h * (model_cfg.intermediate_size // tp) + 2 * h
    layers = -(-model_cfg.num_layers // pp) * layer + moe_param_delta(model_cfg, pp)  # MoE: tp 1 (the config)
    emb = (v // tp) * h
    head = 0 if model_cfg.tie_embeddings else (v // tp) * h
    if pp == 1:
        return (layers + emb + head + h,) * 2
    return layers + emb, layers + head + h


def params_per_rank(model_cfg: Any, tp: int, pp: int) -> int:
    """Parameters of the fullest rank after TP and PP (what its DP gradient all-reduce carries), the larger of
    :func:`stage_end_params`."""
    return max(stage_end_params(model_cfg, tp, pp))


@dataclass
class StepPrediction:
    """The predicted time of one optimizer step of the busiest rank, in seconds, and its parts."""

    method: str
    placement: str
    compute_s: float
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    dp_exposed_s: float
    step_s: float
    tokens_per_step: int
    tokens_per_s: float
    flops_per_token: float
    mfu: float | None
    params_per_rank: int
    dp_bytes_per_rank: float
    dp_node_out_bytes: float
    groups: dict[str, GroupSpan]
    cp_comm_s: float = 0.0
    ep_comm_s: float = 0.0

    @property
    def breakdown(self) -> dict[str, float]:
        """Seconds per part: compute, bubble, tp, pp, dp (exposed), cp (with CP) — they add up to ``step_s``."""
        return {
            "compute_s": self.compute_s,
            "bubble_s": self.bubble_s,
            "tp_comm_s": self.tp_comm_s,
            "pp_comm_s": self.pp_comm_s,
            "dp_comm_s": self.dp_exposed_s,
            **({"cp_comm_s": self.cp_comm_s} if "cp" in self.groups else {}),
            **({"ep_comm_s": self.ep_comm_s} if self.ep_comm_s else {}),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        d = dataclasses.asdict(self)
        d["breakdown"] = self.breakdown
        return d


def _dp_comm(
    psi: int, layout: Layout, cluster: ClusterModel, span: GroupSpan, method: str, ratio: float, index_bytes: int
) -> tuple[float, float, float]:
    """(seconds, bytes one rank sends, bytes leaving one node) of one step's DP gradient synchronisation.

    ZeRO-3 (under PP too: each stage over its DP group) gathers the parameters for every micro-batch's forward and
    again for its backward and reduce-scatters every micro-batch's gradient: per step ``m`` times one
    reduce-scatter and two all-gathers, where ZeRO-1/2 do one of each."""
    t, sent, out, gather = _dp_comm_once(psi, layout, cluster, span, method, ratio, index_bytes)
    if layout.zero_stage >= 3:
        m = layout.gradient_accumulation_steps
        t, sent, out = (m * (x + g) for x, g in zip((t, sent, out), gather, strict=True))
    return t, sent, out


def _dp_comm_once(
    psi: int, layout: Layout, cluster: ClusterModel, span: GroupSpan, method: str, ratio: float, index_bytes: int
) -> tuple[float, float, float, tuple[float, float, float]]:
    """:func:`_dp_comm` of one reduction and one parameter all-gather, and that all-gather's own share."""
    n, k, m_nodes = layout.dp, span.per_node, span.nodes
    if n <= 1:
        return 0.0, 0.0, 0.0, (0.0, 0.0, 0.0)
    eb = layout.bytes_per_element
    param_bytes = psi * eb
    grad_eb = min(eb, 2) if method in ("fp16", "bf16") else eb
    grad_bytes = psi * grad_eb
    zero = layout.zero_stage >= 1
    flat = method == "flat" or not span.spans_nodes or (k == 1 and method != "topk")
    if flat:
        link = cluster.ring_link(span.spans_nodes, span.ring_flows_per_node)
        crossing = span.ring_flows_per_node if span.spans_nodes else 0.0
        g_t, g_sent = all_gather_s(param_bytes, n, link), gather_bytes(param_bytes, n)
        if zero:
            t = reduce_scatter_s(grad_bytes, n, link) + g_t
            sent = gather_bytes(grad_bytes, n) + g_sent
        else:
            t, sent = all_reduce_s(grad_bytes, n, link), all_reduce_bytes(grad_bytes, n)
        return t, sent, sent * crossing, (g_t, g_sent, g_sent * crossing)
    inter = cluster.inter_link(span.crossing_ranks_per_node)
    t = reduce_scatter_s(grad_bytes, k, cluster.intra)
    sent = gather_bytes(grad_bytes, k)
    if method == "topk":
        chunk = ratio * (psi / k) * (eb + index_bytes)
        t += all_gather_s(m_nodes * chunk, m_nodes, inter)
        out = (m_nodes - 1) * chunk
    elif zero:
        t += reduce_scatter_s(grad_bytes / k, m_nodes, inter)
        out = gather_bytes(grad_bytes / k, m_nodes)
    else:
        t += all_reduce_s(grad_bytes / k, m_nodes, inter)
        out = all_reduce_bytes(grad_bytes / k, m_nodes)
    # updated parameters: all-gather across nodes, then inside the node
    g_t = all_gather_s(param_bytes / k, m_nodes, inter) + all_gather_s(param_bytes, k, cluster.intra)
    g_out, g_sent = gather_bytes(param_bytes / k, m_nodes), gather_bytes(param_bytes, k)
    if zero:
        t += g_t
        out += g_out
        sent += g_sent
    else:  # the reduced (dense) shards back to every rank of the node
        t += all_gather_s(grad_bytes, k, cluster.intra)
        sent += gather_bytes(grad_bytes, k)
    crossing = span.crossing_ranks_per_node
    return t, sent + out, out * crossing, (g_t, g_sent + g_out, g_out * crossing)


def predict_step(
    model_cfg: Any,
    layout: Layout,
    cluster: ClusterModel,
    method: str = "flat",
    topk_ratio: float = 0.01,
    placement: str = "aware",
    overlap_dp: bool = False,
    topk_index_bytes: int = 4,
) -> StepPrediction:
    """Predict one optimizer step of ``layout`` for the model ``model_cfg`` (a ``LlamaConfig`` or anything with
    its size fields) on ``cluster``; see the module docstring for every term and its source."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if layout.world_size > cluster.world_size:
        raise ValueError(
            f"layout needs {layout.world_size} ranks (dp {layout.dp} x cp {layout.cp} x tp {layout.tp} x pp "
            f"{layout.pp}); the "
            f"cluster has {cluster.world_size} ({cluster.nodes} x {cluster.ranks_per_node})"
        )
    if not 0.0 < topk_ratio <= 1.0:
        raise ValueError(f"topk_ratio must be in (0, 1], got {topk_ratio}")
    dp, tp, pp, v, cp = layout.dp, layout.tp, layout.pp, layout.virtual_pipeline_size, layout.cp
    b, m, seq, eb = (
        layout.micro_batch_size,
        layout.gradient_accumulation_steps,
        layout.seq_len,
        layout.bytes_per_element,
    )
    kinds = ("tp", "pp", "dp", "cp") if cp > 1 else ("tp", "pp", "dp")
    spans = {k: group_span(k, dp, tp, pp, cluster.ranks_per_node, placement, cp) for k in kinds}
    f_tok = flops_per_token(model_cfg, seq)
    compute_s = f_tok * b * m * seq / (tp * pp * cp) / cluster.flops_per_s
    act_bytes = b * seq / cp * model_cfg.hidden_size * eb
    layers = -(-model_cfg.num_layers // pp)
    tp_comm_s = 0.0
    if tp > 1:
        s = spans["tp"]
        link = cluster.ring_link(s.spans_nodes, s.ring_flows_per_node)
        tp_comm_s = layers * m * 4 * all_reduce_s(act_bytes, tp, link)
        if layout.sequence_parallel:  # the re-gathers and the norm weights' all-reduces
            norm = all_reduce_s(model_cfg.hidden_size * eb, tp, link)
            tp_comm_s += m * (2 * layers * all_gather_s(act_bytes, tp, link) + (2 * layers + 1) * norm)
    pp_comm_s = 0.0
    if pp > 1:
        s = spans["pp"]
        link = cluster.inter_link(s.p2p_flows_per_node) if s.spans_nodes else cluster.intra
        pp_comm_s = 2 * v * m * p2p_s(act_bytes / (tp if layout.sequence_parallel else 1), link)
    cp_comm_s = 0.0
    if cp > 1:
        s = spans["cp"]
        link = cluster.inter_link(s.p2p_flows_per_node) if s.spans_nodes else cluster.intra
        kv_width = max(model_cfg.num_kv_heads // tp, 1) * (model_cfg.hidden_size // model_cfg.num_heads)
        cp_comm_s = layers * m * (6 * cp - 4) * p2p_s(b * seq / cp * kv_width * eb, link)
    bubble = (pp - 1) / (v * m + pp - 1) if pp > 1 else 0.0
    ep_s = ep_comm_s(model_cfg, layout, cluster, placement)
    work_s = compute_s + tp_comm_s + pp_comm_s + cp_comm_s + ep_s
    pipeline_s = work_s / (1.0 - bubble)
    psi = params_per_rank(model_cfg, tp, pp)
    grads = dataclasses.replace(layout, dp=dp * cp, cp=1)  # CP ranks hold the same parameters as DP ones
    span = group_span("dp", dp * cp, tp, pp, cluster.ranks_per_node, placement) if cp > 1 else spans["dp"]
    experts = expert_params(model_cfg, pp) if layout.ep > 1 else 0  # summed over dp/ep, E/ep of them
    dp_s, dp_sent, dp_out = _dp_comm(psi - experts, grads, cluster, span, method, topk_ratio, topk_index_bytes)
    if experts:
        n, extra = dp // layout.ep, (method, topk_ratio, topk_index_bytes)
        span_e = group_span("dp", n, tp, pp, cluster.ranks_per_node, placement)
        extra = _dp_comm(experts // layout.ep, dataclasses.replace(grads, dp=n), cluster, span_e, *extra)
        dp_s, dp_sent, dp_out = (a + b for a, b in zip((dp_s, dp_sent, dp_out), extra, strict=True))
    exposed = max(0.0, dp_s - 2.0 / 3.0 * compute_s) if overlap_dp else dp_s
    step_s = pipeline_s + exposed
    tokens = layout.tokens_per_step
    tps = tokens / step_s
    peak = cluster.peak_flops_per_s
    return StepPrediction(
        method=method,
        placement=placement,
        compute_s=compute_s,
        bubble_s=pipeline_s - work_s,
        tp_comm_s=tp_comm_s,
        pp_comm_s=pp_comm_s,
        dp_comm_s=dp_s,
        dp_exposed_s=exposed,
        step_s=step_s,
        tokens_per_step=tokens,
        tokens_per_s=tps,
        flops_per_token=f_tok,
        mfu=tps * f_tok / (layout.world_size * peak) if peak else None,
        params_per_rank=psi,
        dp_bytes_per_rank=dp_sent,
        dp_node_out_bytes=dp_out,
        groups=spans,
        cp_comm_s=cp_comm_s,
        ep_comm_s=ep_s,
    )
