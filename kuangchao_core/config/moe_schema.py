"""The ``model.moe`` section: mixture-of-experts feed-forward blocks in the decoder (issue 40, ``models.moe``).

Absent (the default), every decoder layer has the dense SwiGLU MLP. Present, the layers ``layers`` names (or every
``layer_interval``-th layer from the first) get a MoE block instead. :func:`moe_errors` holds the checks that involve
more than one field, run by the job config (``config.checks``) and by the model's own config
(``models.llama.LlamaConfig.validate``); :func:`moe_layout_errors` refuses what the single-process block does not
support yet, each with one line naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kuangchao_core.config.section import Float, Int, Section

#: upper bound of ``num_experts`` (refused before anything is built)
MAX_EXPERTS = 4096


class MoeSection(Section):
    """Routed experts (each a SwiGLU MLP), shared experts, the router and how the load is balanced."""

    num_experts: Int = Field(default=8, ge=1, le=MAX_EXPERTS, description="routed experts per MoE block")
    top_k: Int = Field(default=2, ge=1, description="experts each token is routed to (at most num_experts)")
    num_shared_experts: Int = Field(default=0, ge=0, le=64, description="experts every token passes through")
    #: one expert's SwiGLU width (unset: ``model.intermediate_size``); shared experts have it too
    expert_intermediate_size: Int | None = Field(default=None, ge=1, le=1 << 20)
    #: ``softmax`` over the experts' logits, or each logit's ``sigmoid`` (DeepSeek-V3); top-k gate weights are
    #: renormalised to sum 1 when top_k > 1
    router: Literal["softmax", "sigmoid"] = "softmax"
    #: an expert takes at most ceil(capacity_factor × tokens × top_k / num_experts) assignments of a micro-batch, the
    #: first in token order (the rest are dropped); null: dropless, every assignment computed
    capacity_factor: Float | None = Field(default=None, gt=0)
    #: weight of the load-balancing loss E·Σ f_i·P_i added to the loss (0: none); used under either ``balance``
    aux_loss_coef: Float = Field(default=0.01, ge=0)
    #: weight of the router z-loss mean(logsumexp(logits)²) added to the loss (0: none)
    z_loss_coef: Float = Field(default=0.0, ge=0)
    #: ``aux_loss``: the balancing loss alone; ``bias``: DeepSeek-V3's auxiliary-loss-free per-expert routing bias,
    #: moved by ``bias_update_rate`` toward balance after each optimizer step (with any ``aux_loss_coef`` beside it)
    balance: Literal["aux_loss", "bias"] = "aux_loss"
    bias_update_rate: Float = Field(default=0.001, gt=0, description="the bias step of balance: bias")
    layer_interval: Int = Field(default=1, ge=1, description="MoE in layers 0, k, 2k, … (1: every layer)")
    #: the decoder layers (0-based) whose MLP is a MoE block; replaces ``layer_interval``
    layers: list[Int] | None = Field(default=None, min_length=1)


def moe_errors(moe: Any, num_layers: int | None, prefix: str = "model.moe") -> list[tuple[str, str]]:
    """``(path, message)`` for each inconsistent setting of ``moe`` (a :class:`MoeSection` or the model's
    ``MoeConfig``) in a decoder of ``num_layers`` layers (None: not known yet)."""
    errs: list[tuple[str, str]] = []
    if moe.top_k > moe.num_experts:
        errs.append((f"{prefix}.top_k", f"{moe.top_k} is more than num_experts {moe.num_experts}"))
    if moe.balance == "aux_loss" and moe.aux_loss_coef == 0:
        errs.append((f"{prefix}.aux_loss_coef", "is 0 under balance: aux_loss, so nothing balances the experts"))
    if moe.layers is not None:
        if moe.layer_interval != 1:
            errs.append((f"{prefix}.layer_interval", "give layers or layer_interval, not both"))
        if len(set(moe.layers)) != len(moe.layers):
            errs.append((f"{prefix}.layers", f"lists a layer twice: {list(moe.layers)}"))
        if num_layers is not None and any(not 0 <= i < num_layers for i in moe.layers):
            errs.append((f"{prefix}.layers", f"{list(moe.layers)} has a layer outside 0..{num_layers - 1}"))
    elif num_layers is not None and moe.layer_interval > num_layers:
        errs.append((f"{prefix}.layer_interval", f"{moe.layer_interval} is more than model.num_layers {num_layers}"))
    return errs


def moe_layout_errors(model: Any, parallel: Any, train: Any, tracking: Any) -> list[tuple[str, str]]:
    """What a job with ``model.moe`` may not combine it with yet (data parallelism with ZeRO 0-2 and expert
    parallelism, ``parallel.expert_parallel_size``, are what runs): one ``(path, message)`` for each setting.
    A Hugging Face ``model.checkpoint`` is a Mixtral's (``models.hf_moe_config.merge_moe`` checks the section
    against it when the model config is built).
    (Only values count: a worker reads back the resolved config, where every field is set. ``tracking.log_model``
    and ``bias_update_rate`` under ``balance: aux_loss`` are unused settings, ``config.unused``.)"""
    why = "only data and expert parallelism run MoE blocks for now (issue 40)"
    refused = [
        (parallel.tensor_parallel_size > 1, "parallel.tensor_parallel_size", "must be 1"),
        (parallel.pipeline_parallel_size > 1, "parallel.pipeline_parallel_size", "must be 1"),
        (parallel.context_parallel_size > 1, "parallel.context_parallel_size", "must be 1"),
        (parallel.zero_stage == 3, "parallel.zero_stage", "must not be 3"),
        (model.lora is not None, "model.lora", "LoRA does not adapt experts"),
        (model.vision is not None, "model.vision", "a vision tower is not built beside MoE"),
        (bool(train.compile), "train.compile", "MoE blocks are not compiled"),
        (tracking.register_model is not None, "tracking.register_model", "no Hugging Face export to register"),
    ]
    return [(path, f"{what} with model.moe: {why}") for bad, path, what in refused if bad]
