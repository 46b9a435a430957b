"""The vision encoder's layout, memory and traffic in ``kc plan`` (issue 31, ``model.vision.parallel``).

Under the default layout (``data``) the tower and projector are replicated on every rank that holds the decoder's
first pipeline stage; each TP rank encodes ``ceil(images / tp)`` of a micro-batch's images, the features are
all-gathered over the TP group, and the encoder's gradients are summed over TP and averaged over DP (so reduced over
the tp x dp ranks that replicate it). Memory per holding rank: parameters, gradients and AdamW state (none of the two
when ``model.vision.freeze``), and a rough activation estimate (``ACTIVATION_VALUES`` values per token per layer for
the backward, this rank's share of the micro-batch's images); parameters are counted on the meta device.

Under ``parallel: tp`` (:mod:`kuangchao_core.engine.vlm_layout`) the decoder's TP group of ``tp`` ranks holds
``tp / e`` encoder TP groups of ``e`` ranks: each rank keeps 1/e of the split weights (q/k/v, out_proj, fc1, fc2:
:data:`~kuangchao_core.models.vision_tp.VISION_TP_PLAN`) and all of the rest, encodes ``ceil(images / (tp / e))``
of a micro-batch's images with ``SPLIT_ACTIVATION_VALUES`` of its activation values split e ways, and all-reduces
its group's hidden states twice per layer forward and (when trained) twice backward.
"""

from __future__ import annotations

from typing import Any

#: values kept per token per tower layer for the backward (inputs of two norms, q/k/v, scores' output, MLP's two)
ACTIVATION_VALUES = 12
#: of those, the values an encoder TP group splits (q, k, v, the attention output, the MLP's two)
SPLIT_ACTIVATION_VALUES = 8
DTYPE_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}


def vision_plan(cfg: Any) -> dict[str, Any] | None:
    """The encoder's part of :func:`~kuangchao_core.engine.plan.explain_plan`; None without ``model.vision``."""
    import torch

    from kuangchao_core.config.vision_schema import encoder_tp_size, image_tokens_per_image
    from kuangchao_core.engine.vlm_model import pretrained_vision
    from kuangchao_core.models.llama import config_from_model_section
    from kuangchao_core.models.vision import VisionTower, vision_config
    from kuangchao_core.models.vision_tp import split_dim
    from kuangchao_core.models.vlm import LlavaProjector

    section = pretrained_vision(cfg.model)  # a LLaVA checkpoint's tower
    if section is None:
        return None
    text = config_from_model_section(cfg.model)
    text_hidden, vocab = text.hidden_size, text.vocab_size
    v = vision_config(section, vocab)
    par = cfg.parallel
    tp, dp, micro = par.tensor_parallel_size, par.data_parallel_size, par.micro_batch_size
    e = encoder_tp_size(section, tp)  # the config's checks made sure it divides tp
    groups = tp // e  # encoder TP groups in a decoder TP group, each encoding its share of the images
    with torch.device("meta"):
        named = list(VisionTower(v).named_parameters())
        proj = sum(
            p.numel()
            for p in LlavaProjector(v.hidden_size, text_hidden, v.projector_hidden_act, v.projector_bias).parameters()
        )
    tower = sum(p.numel() for _, p in named)
    tower_per_rank = sum(p.numel() // (e if split_dim(n) is not None else 1) for n, p in named)
    width = DTYPE_BYTES.get(str(cfg.train.dtype), 4)
    params = (tower_per_rank + proj) * width
    trained = 0 if section.freeze else params
    per_image = image_tokens_per_image(v)
    share = -(-micro // groups)  # images of a micro-batch this rank encodes, one image per row
    tokens = share * (v.num_patches + 1)
    values = ACTIVATION_VALUES - SPLIT_ACTIVATION_VALUES + SPLIT_ACTIVATION_VALUES / e
    activations = int(tokens * v.hidden_size * v.num_layers * values * width)
    features = micro * per_image * text_hidden * width
    accumulation = par.gradient_accumulation_steps
    passes = 2 if section.freeze else 4  # out_proj and fc2 forward; their inputs' copies backward (none when frozen)
    hidden_all_reduce = passes * v.layers_used * tokens * v.hidden_size * width * accumulation if e > 1 else 0
    if e > 1:
        held_by = f"encoder TP groups of {e} ranks, {groups} per decoder TP group (x dp {dp})"
    else:
        held_by = f"every rank of pipeline stage 0 (tp {tp} x dp {dp} replicas)"
    return {
        "layout": section.parallel,
        "tensor_parallel_size": e,
        "held_by": held_by,
        "images_per_rank_per_micro_batch": share,
        "parameters": {"tower": tower, "projector": proj, "tower_per_rank": tower_per_rank},
        "memory_bytes": {
            "params": params,
            "grads": trained,
            "optimizer": 2 * trained,
            "activations_estimate": activations,
            "total": params + 3 * trained + activations,
        },
        "traffic_bytes_per_step": {
            "feature_all_gather_tp": features * (groups - 1) // groups * accumulation if groups > 1 else 0,
            "hidden_all_reduce_encoder_tp": hidden_all_reduce,
            "gradient_all_reduce_tp": trained if groups > 1 else 0,
            "gradient_all_reduce_dp": trained if dp > 1 else 0,
        },
        "frozen": bool(section.freeze),
    }


def pretrained_tower_problems(cfg: Any) -> list[tuple[str, str]]:
    """The encoder's TP size (``model.vision.parallel: tp``) against the tower of a LLaVA ``model.checkpoint``, whose
    heads and MLP width only its ``config.json`` knows (the config's own checks leave them out): each size it does
    not divide, named by the field that set the TP size, with the directory's value and key (and, whatever the
    layout, a field of ``model.vision`` that disagrees with the directory, as the flow would refuse it). Part of
    :func:`~kuangchao_core.engine.plan.check_plan`, so ``kc train`` refuses such a job before launch."""
    from kuangchao_core.ckpt.hf_llava import VISION_KEYS
    from kuangchao_core.config.vision_schema import encoder_tp_size
    from kuangchao_core.engine.vlm_model import pretrained_vision
    from kuangchao_core.errors import ConfigError

    model = cfg.model
    section = getattr(model, "vision", None)
    if section is None or not model.checkpoint:
        return []
    try:
        tower = pretrained_vision(model)
    except ConfigError as exc:  # a field that disagrees with the directory, or no LLaVA there
        return list(exc.errors)
    if tower.parallel != "tp":
        return []
    tp = int(cfg.parallel.tensor_parallel_size)
    e = encoder_tp_size(tower, tp)
    field, whose = "model.vision.tensor_parallel_size", ""
    if not section.tensor_parallel_size:  # the encoder takes the decoder's TP size
        field, whose = "parallel.tensor_parallel_size", f" (the decoder's: {field} is unset)"
    sizes = {name: int(getattr(tower, name)) for name in ("num_heads", "intermediate_size")}
    fits = [d for d in range(1, tp + 1) if tp % d == 0 and all(n % d == 0 for n in sizes.values())]
    return [
        (
            field,
            f"the encoder's TP size {e}{whose} does not divide the tower's {name} {n} in {model.checkpoint} "
            f"(vision_config.{VISION_KEYS[name]}); set model.vision.tensor_parallel_size to one that fits: "
            + ", ".join(map(str, fits)),
        )
        for name, n in sizes.items()
        if n % e
    ]


def format_vision(vision: dict[str, Any] | None) -> list[str]:
    """The ``kc plan`` lines of :func:`vision_plan`'s result (none without a vision tower)."""
    if vision is None:
        return []
    p, m, t = vision["parameters"], vision["memory_bytes"], vision["traffic_bytes_per_step"]
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    e = vision["tensor_parallel_size"]
    layout = f"tensor parallel {e}" if vision["layout"] == "tp" else f"{vision['layout']} parallel"
    split = f" ({p['tower_per_rank']:,} of the tower per rank)" if e > 1 else ""
    return [
        f"vision encoder ({layout}{', frozen' if vision['frozen'] else ''}): "
        f"{p['tower']:,} tower{split} + {p['projector']:,} projector parameters on {vision['held_by']}; "
        f"{vision['images_per_rank_per_micro_batch']} images per rank per micro-batch",
        f"  encoder memory per rank (MiB): params {mib(m['params'])} / grads {mib(m['grads'])} / optimizer "
        f"{mib(m['optimizer'])} / activations (rough) {mib(m['activations_estimate'])} / total {mib(m['total'])}",
        f"  encoder traffic per step (MiB): features all-gathered over TP {mib(t['feature_all_gather_tp'])}; "
        + (
            f"hidden states all-reduced in the encoder TP group {mib(t['hidden_all_reduce_encoder_tp'])}; "
            if e > 1
            else ""
        )
        + f"gradients all-reduced over TP {mib(t['gradient_all_reduce_tp'])}, over DP {mib(t['gradient_all_reduce_dp'])}",
    ]
