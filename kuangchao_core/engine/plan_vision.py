"""The vision encoder's layout, memory and traffic in ``kc plan`` (issue 31, ``model.vision.parallel``).

Under the default layout (``data``) the tower and projector are replicated on every rank that holds the decoder's
first pipeline stage; each TP rank encodes ``ceil(images / tp)`` of a micro-batch's images, the features are
all-gathered over the TP group, and the encoder's gradients are summed over TP and averaged over DP (so reduced over
the tp x dp ranks that replicate it). Memory per holding rank: parameters, gradients and AdamW state (none of the two
when ``model.vision.freeze``), and a rough activation estimate (``ACTIVATION_VALUES`` values per token per layer for
the backward, this rank's share of the micro-batch's images); parameters are counted on the meta device.
"""

from __future__ import annotations

from typing import Any

#: values kept per token per tower layer for the backward (inputs of two norms, q/k/v, scores' output, MLP's two)
ACTIVATION_VALUES = 12
DTYPE_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}


def vision_plan(cfg: Any) -> dict[str, Any] | None:
    """The encoder's part of :func:`~kuangchao_core.engine.plan.explain_plan`; None without ``model.vision``."""
    import torch

    from kuangchao_core.config.vision_schema import image_tokens_per_image
    from kuangchao_core.models.vision import VisionTower, vision_config
    from kuangchao_core.models.vlm import LlavaProjector

    section = cfg.model.vision
    if section is None:
        return None
    text_hidden, vocab = int(cfg.model.hidden_size), int(cfg.model.vocab_size)
    v = vision_config(section, vocab)
    with torch.device("meta"):
        tower = sum(p.numel() for p in VisionTower(v).parameters())
        proj = sum(
            p.numel()
            for p in LlavaProjector(v.hidden_size, text_hidden, v.projector_hidden_act, v.projector_bias).parameters()
        )
    par = cfg.parallel
    tp, dp, micro = par.tensor_parallel_size, par.data_parallel_size, par.micro_batch_size
    width = DTYPE_BYTES.get(str(cfg.train.dtype), 4)
    params = (tower + proj) * width
    trained = 0 if section.freeze else params
    per_image = image_tokens_per_image(v)
    share = -(-micro // tp)  # images of a micro-batch this rank encodes, one image per row
    tokens = share * (v.num_patches + 1)
    activations = tokens * v.hidden_size * v.num_layers * ACTIVATION_VALUES * width
    features = micro * per_image * text_hidden * width
    return {
        "layout": section.parallel,
        "held_by": f"every rank of pipeline stage 0 (tp {tp} x dp {dp} replicas)",
        "images_per_rank_per_micro_batch": share,
        "parameters": {"tower": tower, "projector": proj},
        "memory_bytes": {
            "params": params,
            "grads": trained,
            "optimizer": 2 * trained,
            "activations_estimate": activations,
            "total": params + 3 * trained + activations,
        },
        "traffic_bytes_per_step": {
            "feature_all_gather_tp": features * (tp - 1) // tp * par.gradient_accumulation_steps if tp > 1 else 0,
            "gradient_all_reduce_tp": trained if tp > 1 else 0,
            "gradient_all_reduce_dp": trained if dp > 1 else 0,
        },
        "frozen": bool(section.freeze),
    }


def format_vision(vision: dict[str, Any] | None) -> list[str]:
    """The ``kc plan`` lines of :func:`vision_plan`'s result (none without a vision tower)."""
    if vision is None:
        return []
    p, m, t = vision["parameters"], vision["memory_bytes"], vision["traffic_bytes_per_step"]
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    return [
        f"vision encoder ({vision['layout']} parallel{', frozen' if vision['frozen'] else ''}): "
        f"{p['tower']:,} tower + {p['projector']:,} projector parameters on {vision['held_by']}; "
        f"{vision['images_per_rank_per_micro_batch']} images per rank per micro-batch",
        f"  encoder memory per rank (MiB): params {mib(m['params'])} / grads {mib(m['grads'])} / optimizer "
        f"{mib(m['optimizer'])} / activations (rough) {mib(m['activations_estimate'])} / total {mib(m['total'])}",
        f"  encoder traffic per step (MiB): features all-gathered over TP {mib(t['feature_all_gather_tp'])}; "
        f"gradients all-reduced over TP {mib(t['gradient_all_reduce_tp'])}, over DP {mib(t['gradient_all_reduce_dp'])}",
    ]
