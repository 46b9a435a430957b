"""The estimated memory of each rank of a layout: the state bytes of ``parallel.state_memory`` (the engine's own
model), the half-precision weight copies autocast keeps, and the activations.

``engine.plan`` (``kc plan``, the launch check) and ``engine.recommend`` (``kc recommend``) both call
:func:`estimate_ranks`, so they print the same number for the same layout.

Per rank, Ψ = the parameter elements it holds after TP/PP (:func:`~kuangchao_core.models.layout.slices_for_rank`):

- ``params``, ``grads``, ``optimizer``: :func:`~kuangchao_core.parallel.state_memory.state_bytes` at the ZeRO stage
  of ``parallel.zero_stage`` (under pp each stage over its DP group), for ``train.dtype`` and
  ``train.param_dtype`` (bf16 parameters: fp32 masters and master gradients, no autocast copies); a MoE
  model's routed experts count E/ep per rank under ``parallel.expert_parallel_size``, their state sharded over
  their d/ep replicas (``engine.plan_experts``). With
  ``model.lora`` the base is frozen (whole on every rank; 1/N at ZeRO-3) and the adapters (rank·(in + out) per
  adapted projection, split like its base) are the trainable elements.
- ``autocast_casts`` (bf16/fp16 only): 2 bytes per element of every weight a matmul reads (the projections and the
  head, or the tied embedding; not the embedding lookup nor the norms) whose copy autograd keeps — with LoRA, a
  frozen projection whose input needs no gradient keeps none (on the first stage, before the first adapter) — times
  the (micro-batch, chunk) forwards this rank holds at once in its schedule, over ``v`` chunks. Under activation
  checkpointing they are counted as without it (an upper bound: recomputed layers keep fewer; not measured).
- ``gathered_blocks`` (ZeRO-3): the unit computing and the one prefetched, whole, in the parameters' dtype.
- ``activations_estimate``: per layer and micro-batch the elements its backward keeps, counted from this model's
  operations (h hidden, q = heads·head_dim, kv = kv_heads·head_dim, I the MLP width, t TP; measured on CPU with
  ``hal.heap``, ``tests/test_plan_accuracy.py``): 4h + (6q + 4I)/t per token — the two norms' inputs and outputs,
  the rotary inputs and outputs, SDPA's inputs and output, o_proj's input, and gate, up, SiLU and product for the
  MLP; ``selective`` checkpointing keeps the layer input and the matmul and attention outputs,
  3h + (2q + 2kv + 2I)/t; ``full`` only the input, h (plus one layer's whole activations while it is recomputed).
  Elements are 4 bytes in fp32, 2 under bf16/fp16 autocast, 8 in fp64; the layers' activations are multiplied by
  the micro-batches in flight on the rank (1 without a pipeline; from the schedule itself otherwise:
  min(m, p − r) for 1F1B on stage r, m for all-forward-all-backward, per chunk for interleaved 1F1B), and the last
  stage adds its fp32 logits and their log-softmax, 2·s·b·V/t·4 bytes.
  Sequence parallelism (``parallel.sequence_parallel``) divides the part TP leaves replicated — the h terms: the
  norms' inputs and outputs (the projections keep their input as the shard, re-gathered in the backward), the
  selective and full modes' layer input — by t (Korthikanti et al. 2022 §4.2.2): 4h/t + (6q + 4I)/t per token.
  Context parallelism (``parallel.context_parallel_size`` c) gives each rank s/c tokens of every sequence, and the
  ring attention's backward keeps only the rank's own q, k, v, output and log-sum-exp, so every per-token term,
  the head's logits included, is counted for s/c tokens; ZeRO shards its state over the d·c replicas (the trainer
  reduces gradients over dp×cp).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kuangchao_core.parallel.state_memory import cast_bytes, precision_bytes, state_bytes

#: bytes per activation element by ``train.dtype`` (under bf16/fp16 autocast most saved tensors are half)
ACTIVATION_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}
_MATMUL_ROLES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def layer_activation_elements(mcfg: Any, tp: int, mode: str = "none", sp: bool = False) -> float:
    """Elements per token one decoder layer keeps for its backward (module docstring), by activation
    checkpointing ``mode``: ``none`` 4h + (6q + 4I)/t, ``selective`` 3h + (2q + 2kv + 2I)/t, ``full`` h; with
    sequence parallelism (``sp``) the h terms are divided by t too."""
    h = mcfg.hidden_size / (tp if sp else 1)
    if mode == "full":
        return float(h)
    d = mcfg.head_dim
    q = mcfg.num_heads * d / tp
    kv = max(mcfg.num_kv_heads * d / tp, d)  # fewer kv heads than TP ranks: each rank keeps one, replicated
    inter = mcfg.intermediate_size / tp
    if mode == "selective":
        return 3 * h + 2 * q + 2 * kv + 2 * inter
    return 4 * h + 6 * q + 4 * inter


def activation_bytes_per_layer(
    seq: int, micro_batch: int, mcfg: Any, tp: int, dtype: str, mode: str = "none", sp: bool = False, cp: int = 1
) -> float:
    """Bytes one decoder layer keeps for one micro-batch on one rank (:func:`layer_activation_elements` × the
    rank's s/cp tokens × the bytes of an element under ``dtype``)."""
    return seq / cp * micro_batch * layer_activation_elements(mcfg, tp, mode, sp) * ACTIVATION_BYTES.get(dtype, 4)


def head_activation_bytes(seq: int, micro_batch: int, vocab: int, tp: int, cp: int = 1) -> float:
    """Bytes the output head keeps for one micro-batch on the last stage: the fp32 logits and their log-softmax
    of the rank's s/cp tokens."""
    return 2 * seq / cp * micro_batch * vocab / tp * 4


def micro_batches_in_flight(pp: int, m: int, v: int, schedule: str) -> float:
    """Micro-batches whose activations the first pipeline stage holds at once (the most of any stage): 1 without a
    pipeline, m for all-forward-all-backward, min(m, p) for 1F1B, min(m, p)·(1 + (p−1)/(p·v)) interleaved."""
    if pp == 1:
        return 1.0
    if schedule == "afab":
        return float(m)
    if schedule == "interleaved_1f1b":
        return min(m, pp) * (1 + (pp - 1) / (pp * v))
    return float(min(m, pp))


def rank_in_flight(pp: int, m: int, v: int, schedule: str, pp_rank: int) -> float:
    """Micro-batches' worth of a stage's layers pipeline rank ``pp_rank`` holds at once: the most (micro-batch,
    chunk) forwards its schedule has not yet backwarded, over ``v`` chunks (1 without a pipeline)."""
    if pp == 1:
        return 1.0
    from kuangchao_core.parallel.pp_schedules import get_schedule, max_in_flight

    return max_in_flight(get_schedule(schedule)(pp, pp_rank, m, v)) / v


def unit_sizes(slices: dict[str, Any]) -> dict[str, int]:
    """Elements per ZeRO-3 unit (each decoder layer; the embedding, final norm and head on their own)."""
    units: dict[str, int] = {}
    for name, region in slices.items():
        parts = name.split(".")
        unit = ".".join(parts[:3]) if name.startswith("model.layers.") else name
        units[unit] = units.get(unit, 0) + region.numel
    return units


def kept_cast_elements(slices: dict[str, Any], adapters: dict[str, Any], lora: Any, tied: bool) -> float:
    """Elements of the weights whose autocast copies autograd keeps for the backward on a rank holding ``slices``
    (module docstring): every matmul weight without LoRA; with LoRA (``lora`` settings, ``adapters`` their
    regions) the frozen ones whose input needs a gradient, plus every adapter."""
    from kuangchao_core.models.lora import is_target

    has_embedding = "model.embed_tokens.weight" in slices
    grad_res = lora is None or not has_embedding  # a later stage's input comes from a stage that needs its gradient
    grad_attn = grad_mlp = False
    kept = float(sum(r.numel for r in adapters.values()))
    for name, region in slices.items():
        role = name.split(".")[-2] if "." in name else ""
        if role not in _MATMUL_ROLES:
            continue
        adapted = lora is not None and is_target(name, lora)
        if role in ("q_proj", "k_proj", "v_proj"):
            needs, grad_attn = grad_res, grad_attn or grad_res or adapted
        elif role == "o_proj":
            needs, grad_res, grad_attn = grad_attn, grad_res or grad_attn or adapted, False
        elif role in ("gate_proj", "up_proj"):
            needs, grad_mlp = grad_res, grad_mlp or grad_res or adapted
        elif role == "down_proj":
            needs, grad_res, grad_mlp = grad_mlp, grad_res or grad_mlp or adapted, False
        else:  # the head
            needs = grad_res
        kept += region.numel if needs else 0
    if tied and has_embedding and "model.norm.weight" in slices and grad_res:
        kept += slices["model.embed_tokens.weight"].numel  # the tied head reads the embedding through a matmul
    return kept


def estimate_ranks(cfg: Any, ranks: Iterable[int] | None = None) -> list[dict[str, Any]]:
    """The estimated memory of each rank in ``ranks`` (default: all) of a layout ``engine.plan.check_plan``
    accepts: ``{"rank", "coords", "parameters", "memory_bytes": {params, grads, optimizer, autocast_casts,
    activations_estimate, [gathered_blocks,] total}}`` (module docstring)."""
    from kuangchao_core.axes import MeshAxes
    from kuangchao_core.engine.plan_experts import expert_parallel_size, split_elements
    from kuangchao_core.models.layout import slices_for_rank
    from kuangchao_core.models.llama import config_from_model_section
    from kuangchao_core.models.lora import LoraSettings, lora_regions
    from kuangchao_core.parallel.pipeline import partition_layers

    mcfg = config_from_model_section(cfg.model)
    par = cfg.parallel
    dp, tp, pp = par.data_parallel_size, par.tensor_parallel_size, par.pipeline_parallel_size
    v, m, b = par.virtual_pipeline_size, par.gradient_accumulation_steps, par.micro_batch_size
    chunks = partition_layers(mcfg.num_layers, pp, v)
    seq = getattr(getattr(cfg, "data", None), "seq_len", None) or mcfg.max_seq_len
    dtype = getattr(getattr(cfg, "train", None), "dtype", "fp32")
    pdt = getattr(getattr(cfg, "train", None), "param_dtype", "fp32")
    pdt = pdt if pdt == "bf16" else None  # train.param_dtype: bf16 parameters, fp32 master weights
    recompute = getattr(getattr(cfg, "train", None), "activation_checkpointing", "none")
    sp, cp = bool(getattr(par, "sequence_parallel", False)), getattr(par, "context_parallel_size", 1)
    act_layer = activation_bytes_per_layer(seq, b, mcfg, tp, dtype, sp=sp, cp=cp)
    kept_layer = activation_bytes_per_layer(seq, b, mcfg, tp, dtype, recompute, sp, cp)
    lora = LoraSettings.from_config(getattr(getattr(cfg, "model", None), "lora", None))
    zero = par.zero_stage  # the engine runs it in every layout (ZeRO-3 under pp: per stage)
    ep = expert_parallel_size(par)
    out = []
    axes = MeshAxes.from_parallel(par)
    for rank in range(axes.world_size) if ranks is None else ranks:
        at = axes.coords_of(rank)
        tp_rank, pp_rank = at["tp"], at["pp"]
        slices = slices_for_rank(mcfg, tp, tp_rank, pp, pp_rank, v)
        psi = sum(r.numel for r in slices.values())
        adapters = lora_regions(slices, lora) if lora is not None else {}
        if lora is None:  # ZeRO shards over dp×cp; the routed experts, E/ep of them here, over their dp/ep replicas
            dense, experts = split_elements(slices, ep)
            state = state_bytes(dense, dp * cp, zero, dtype, param_dtype=pdt)
            extra = state_bytes(experts, dp * cp // ep, zero, dtype, param_dtype=pdt)
            state = {k: x + extra[k] for k, x in state.items()}
            psi = dense + experts
        else:  # a frozen base (whole on every replica below ZeRO-3); gradients and AdamW state of adapters only
            trained = sum(r.numel for r in adapters.values())
            state = state_bytes(trained, dp * cp, zero, dtype, frozen=psi, param_dtype=pdt)
            psi += sum(r.numel for r in adapters.values())
        layers = sum(c.end - c.start for c in chunks[pp_rank])
        last = any(c.has_head for c in chunks[pp_rank])
        in_flight = rank_in_flight(pp, m, v, par.pipeline_schedule, pp_rank)
        casts = cast_bytes(kept_cast_elements(slices, adapters, lora, mcfg.tie_embeddings), in_flight, dtype, pdt)
        # ZeRO-3 holds whole blocks while they run: the one computing and the one prefetched
        gathered = 2 * precision_bytes(dtype, pdt).param * max(unit_sizes(slices).values()) if zero == 3 else 0
        acts = kept_layer * layers * in_flight + (head_activation_bytes(seq, b, mcfg.vocab_size, tp, cp) if last else 0)
        if recompute != "none" and layers:
            acts += act_layer  # the layer being recomputed in the backward holds all of its activations
        mem = {
            "params": state["params"],
            "grads": state["grads"],
            "optimizer": state["optimizer"],
            "autocast_casts": casts,
            "activations_estimate": acts,
            **({"gathered_blocks": gathered} if zero == 3 else {}),
        }
        mem = {k: float(round(x)) for k, x in mem.items()}
        mem["total"] = float(round(sum(mem.values())))
        out.append(
            {"rank": rank, "coords": {k: at[k] for k in axes.shown()},
             "parameters": psi,
             "memory_bytes": mem}
        )  # fmt: skip
    return out
