"""The mixture-of-experts keys of a Hugging Face ``config.json`` (issue 40 item 4): a Mixtral's read into
``LlamaConfig.moe`` and a MoE Llama's written back as a Mixtral's.

Mixtral's block is the one of :mod:`~kuangchao_core.models.moe` in every layer: a softmax router, the top
``num_experts_per_tok`` renormalised to sum 1, SwiGLU experts of width ``intermediate_size``, no shared experts,
dropless. What Kuangchao computes differently is refused with one line naming it (``model.checkpoint`` on import,
the checkpoint's ``model.moe`` field on export): a top-1 Mixtral (its single gate weight is renormalised to 1,
Kuangchao keeps the router probability, as Switch does), a sliding window shorter than the context, and on export a
sigmoid router, shared experts, dense layers between the MoE ones and ``balance: bias`` (the routing bias decides
the experts; Mixtral has none). Other families (Qwen2-MoE: a sigmoid-gated shared expert, top-k weights left
unnormalised, biased q/k/v; Qwen3-MoE: normalised queries and keys) are refused naming what differs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kuangchao_core.errors import CheckpointError, ConfigError
from kuangchao_core.models.moe import MoeConfig

#: the ``model_type`` of a MoE family whose ``config.json`` is read here
MIXTRAL = "mixtral"
#: families transformers ships that Kuangchao's block does not compute: why, for the refusal
UNSUPPORTED = {
    "qwen2_moe": (
        "Qwen2-MoE gates its shared expert by a learned sigmoid, can leave the top-k weights unnormalised "
        "(norm_topk_prob) and biases q/k/v; Kuangchao's shared experts are ungated and its attention bias-free"
    ),
    "qwen3_moe": "Qwen3-MoE normalises queries and keys per head (q_norm, k_norm), which Kuangchao's attention lacks",
}
#: ``model.moe`` fields that decide what the block computes: a job's ``model.moe`` must have the checkpoint's (the
#: others — losses, balance, capacity — are how it trains)
SHAPE_FIELDS = ("num_experts", "top_k", "num_shared_experts", "expert_intermediate_size", "router", "layers")


def _refuse(path: Path, why: str) -> ConfigError:
    return ConfigError([("model.checkpoint", f"{path}: {why}")])


def moe_from_hf(raw: dict[str, Any], path: Path) -> MoeConfig | None:
    """The MoE block a parsed ``config.json`` (at ``path``; a family ``llava_config.decoder_config`` accepted)
    describes: None for a dense Llama, the block of a Mixtral; ConfigError naming what differs for a Mixtral
    Kuangchao cannot compute exactly."""
    if raw.get("model_type", "llama") != MIXTRAL:
        return None
    try:
        experts, top_k = int(raw.get("num_local_experts", 8)), int(raw.get("num_experts_per_tok", 2))
        window = raw.get("sliding_window")
        aux = float(raw.get("router_aux_loss_coef") or 0.0)
    except (TypeError, ValueError) as exc:
        raise _refuse(path, f"an expert setting is not a number ({exc})") from None
    if top_k == 1:
        raise _refuse(
            path,
            "num_experts_per_tok 1: Mixtral renormalises a single expert's gate weight to 1, Kuangchao's top_k 1 "
            "keeps the router probability (Switch); not imported",
        )
    if window is not None and int(window) < int(raw.get("max_position_embeddings", 2048)):
        raise _refuse(path, f"sliding_window {window}: Kuangchao's attention sees the whole context; not imported")
    if raw.get("hidden_act", "silu") != "silu":
        raise _refuse(path, f"hidden_act {raw.get('hidden_act')!r}: the experts are SwiGLU (silu)")
    # transformers' balancing loss sums E·Σ f·P over the top_k choices: top_k times Kuangchao's (f over all choices)
    coef = aux * top_k if aux > 0 else MoeConfig.aux_loss_coef
    return MoeConfig(num_experts=experts, top_k=top_k, aux_loss_coef=coef)


def with_hf_moe(cfg: Any, raw: dict[str, Any], path: Path) -> Any:
    """``cfg`` (a LlamaConfig read from ``raw``) with the MoE block :func:`moe_from_hf` finds."""
    return dataclasses.replace(cfg, moe=moe_from_hf(raw, path))


def merge_moe(checkpoint: MoeConfig | None, section: Any, where: str) -> Any:
    """``model.moe`` of a job that starts from a Hugging Face checkpoint (``where``) whose block is ``checkpoint``
    (None: dense): the checkpoint's block trained as the section says. A MoE checkpoint needs the section (so the
    job's MoE checks run), whose :data:`SHAPE_FIELDS` and ``layer_interval`` — given or default, so that a worker
    reading back the resolved config, where every field is set, decides alike — must be the checkpoint's; a dense
    checkpoint takes no section. Neither: None."""
    if section is None:
        if checkpoint is not None:
            what = f"num_experts: {checkpoint.num_experts}, top_k: {checkpoint.top_k}"
            raise ConfigError([("model.moe", f"{where} is a Mixtral: set model.moe ({what}) so its checks run")])
        return None
    mine = MoeConfig.from_section(section)
    if checkpoint is None:
        raise ConfigError([("model.moe", f"{where} is a dense Llama: its MLPs have no experts to load")])
    for name in (*SHAPE_FIELDS, "layer_interval"):
        ours, theirs = getattr(mine, name), getattr(checkpoint, name)
        if ours != theirs:
            raise ConfigError([(f"model.moe.{name}", f"{ours}, the checkpoint {where} has {theirs}")])
    return mine


def mixtral_config(cfg: Any, where: str) -> dict[str, Any]:
    """The Mixtral keys of the ``config.json`` of ``cfg`` (a LlamaConfig with ``moe``), over a Llama's; raises
    CheckpointError naming the first ``model.moe`` field whose block Mixtral does not compute."""
    moe = cfg.moe
    dense = [i for i in range(cfg.num_layers) if i not in moe.moe_layers(cfg.num_layers)]
    refused = [
        (moe.router != "softmax", "router", f"{moe.router}: Mixtral's router is a softmax"),
        (moe.top_k == 1, "top_k", "1: Mixtral renormalises a single gate weight to 1, Kuangchao keeps it"),
        (moe.num_shared_experts > 0, "num_shared_experts", f"{moe.num_shared_experts}: Mixtral has no shared expert"),
        (bool(dense), "layers", f"layers {dense} are dense: every Mixtral layer is MoE"),
        (moe.balance == "bias", "balance", "bias: the routing bias picks the experts, and Mixtral has none"),
    ]
    for bad, field, why in refused:
        if bad:
            raise CheckpointError(f"{where}: model.moe.{field} {why}; not exportable as a Mixtral")
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": MIXTRAL,
        "intermediate_size": moe.width(cfg.intermediate_size),
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coef / moe.top_k,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }
