"""The vision-language model in the engine (issue 31): the decoder this rank built, wrapped in LLaVA's tower and projector.

When ``model.vision`` is set, :func:`wrap_vision` puts the rank's decoder (plain or tensor-parallel, as
:func:`~kuangchao_core.engine.parallel_model.build_parallel_model` built it) under ``language_model.`` of a
:class:`~kuangchao_core.models.vlm.VisionLanguageModel`, initialises the tower and projector from the job's seed
(:func:`~kuangchao_core.models.vlm.init_vision_from_seed`, the same on every rank whatever the layout) and records
their regions as whole tensors, so checkpoints hold them layout-independently beside the decoder's slices.

The encoder's layout (``model.vision.parallel``, default ``data``): the tower and projector are replicated on every
rank. With decoder tensor parallelism each TP rank encodes its share of the micro-batch's images (contiguous, the
first ``n mod tp`` ranks one more) and the features are all-gathered over the TP group for the TP-sharded decoder
(:class:`GatherShares`: the backward keeps this rank's share of the feature gradient, which every TP rank holds whole
because the decoder's first norm all-reduces its input gradient). The encoder's gradients are then partial sums
over the TP group: its placement records them so (axis ``vshare``) and the one step path sums them once the step's
backwards ran (:mod:`~kuangchao_core.parallel.partial_sums`), before the data-parallel reduction. With decoder
pipeline parallelism the tower and projector live on the first stage only: its chunk's ``embed`` merges the features
(the images ride with each micro-batch as a stage input); the later stages hold no encoder.

``model.vision.parallel: tp`` (:mod:`~kuangchao_core.engine.vlm_layout`): the tower is split
(:func:`~kuangchao_core.models.vision_tp.shard_tower`) over encoder TP groups carved out of the decoder's TP group;
the images are shared, as above, between those groups only (the *share group* takes the TP group's place here), and
the split parameters' regions are slices of the whole tensors.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from kuangchao_core.comm import primitives as P
from kuangchao_core.config.vision_schema import image_tokens_per_image
from kuangchao_core.engine.vlm_layout import encoder_layout
from kuangchao_core.errors import ConfigError, PlanError
from kuangchao_core.hal.dtypes import param_dtype
from kuangchao_core.models.layout import Region
from kuangchao_core.models.vision import vision_config
from kuangchao_core.models.vision_tp import shard_tower, tower_regions
from kuangchao_core.models.vlm import VisionLanguageModel, init_vision_from_seed, merge_image_features
from kuangchao_core.parallel.placement import Partial, Replicate, tensor_axis

#: parameter-name prefixes of the encoder side (tower and projector)
ENCODER_PREFIXES = ("vision_tower.", "multi_modal_projector.")


def shares(n: int, parts: int) -> list[int]:
    """How many of ``n`` images each of ``parts`` ranks encodes: contiguous, the first ``n mod parts`` one more."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


class GatherShares(torch.autograd.Function):
    """Forward: all-gather each TP rank's features (padded to the largest share) and concatenate them in rank
    order; backward: this rank's rows of the (TP-replicated) gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], group: Any, rank: int) -> torch.Tensor:
        ctx.counts, ctx.rank = counts, rank
        buf = local.new_zeros((max(counts), *local.shape[1:]))
        buf[: local.shape[0]] = local
        parts = P.all_gather(None, buf.contiguous(), group=group)
        return torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]], None, None, None


class ShardedEncoderVLM(VisionLanguageModel):
    """A :class:`VisionLanguageModel` whose images are encoded data-parallel across ``tp_group``."""

    def __init__(self, cfg, vision_cfg, language_model, tp_group):
        super().__init__(cfg, vision_cfg, language_model)
        object.__setattr__(self, "encoder_group", tp_group)

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        group = self.encoder_group
        counts = shares(pixel_values.shape[0], group.size)
        start = sum(counts[: group.rank])
        if counts[group.rank]:
            local = super().image_features(pixel_values[start : start + counts[group.rank]])
        else:  # fewer images than TP ranks: this rank encodes none (its encoder gradient is zero)
            per_image = image_tokens_per_image(self.vision_config)
            local = pixel_values.new_zeros((0, per_image, self.config.hidden_size))
        return GatherShares.apply(local, counts, group, group.rank)


#: ``model.vision`` fields that are the job's choice, never the checkpoint's
JOB_ONLY = ("freeze", "parallel", "tensor_parallel_size")
#: where a LLaVA ``config.json`` keeps the ``model.vision`` fields that are not the tower's ``vision_config``
LLAVA_KEYS = {
    "feature_layer": "vision_feature_layer",
    "feature_select": "vision_feature_select_strategy",
    "projector_hidden_act": "projector_hidden_act",
    "projector_bias": "multimodal_projector_bias",
    "image_token_id": "image_token_index",
}


def pretrained_vision(model: Any) -> Any:
    """``model.vision`` of a job that starts from a LLaVA directory (``model.checkpoint``): the tower and projector
    the directory's ``config.json`` describes, with the job's :data:`JOB_ONLY` fields (freezing, encoder layout). A
    field the job sets must equal the directory's, else ConfigError naming ``model.vision.<field>`` and both
    values. Without a checkpoint the section is returned as it is; a text-only job (``model.vision`` unset) whose
    checkpoint is a LLaVA directory is refused (its tower would be dropped silently); ``model.vision`` with a Llama
    directory is refused by the reader (a LLaVA model is needed)."""
    from kuangchao_core.ckpt.hf_llava import VISION_KEYS, load_hf_llava_config
    from kuangchao_core.config.vision_schema import VisionSection
    from kuangchao_core.models.llava_config import is_llava

    section, checkpoint = model.vision, model.checkpoint
    if not checkpoint:
        return section
    if section is None:
        raw_path = Path(checkpoint) / "config.json"
        if raw_path.is_file() and is_llava(_json_or_none(raw_path)):
            msg = f"{checkpoint} is a LLaVA model (a vision tower and a decoder): set model.vision ({{}} takes both)"
            raise ConfigError([("model.checkpoint", msg)])
        return section
    _, found = load_hf_llava_config(checkpoint)
    errors = []
    for name in sorted(section.model_fields_set - set(JOB_ONLY)):
        mine, theirs = getattr(section, name), getattr(found, name)
        if mine is not None and mine != theirs:
            key = LLAVA_KEYS.get(name) or f"vision_config.{VISION_KEYS.get(name, name)}"
            errors.append((f"model.vision.{name}", f"{mine!r} in the job, but {checkpoint} has {theirs!r} ({key})"))
    if errors:
        raise ConfigError(errors)
    values = {n: getattr(found, n) for n in VisionSection.model_fields if n not in JOB_ONLY}
    return VisionSection(**values, **{n: getattr(section, n) for n in JOB_ONLY})


def _json_or_none(path: Path) -> Any:
    from kuangchao_core.config.bounded_json import read_json_file

    try:
        return read_json_file(path)
    except (OSError, ValueError):
        return None  # the decoder's own reader reports it


def with_pretrained_vision(run: Any) -> Any:
    """``run`` (:class:`~kuangchao_core.config.settings.RunSettings`) with ``model.vision`` resolved by
    :func:`pretrained_vision`, in the model section the trainer builds from and in the checkpoints' manifest (which
    the export reads); ``run`` itself when nothing changes."""
    vision = pretrained_vision(run.model)
    if vision is run.model.vision:
        return run
    model = run.model.model_copy(update={"vision": vision})
    meta = {**run.checkpoint.model_meta, "vision": vision.model_dump(mode="json")}
    return dataclasses.replace(run, model=model, checkpoint=dataclasses.replace(run.checkpoint, model_meta=meta))


def wrap_vision(parts: Any, build: Any, vision_section: Any, llama_cfg: Any, mesh: Any, device: torch.device) -> Any:
    """``parts`` (a :class:`~kuangchao_core.engine.parallel_model.ParallelModel`) with its model wrapped in the
    vision-language model; ``parts.vision`` is the tower's config."""
    if getattr(parts.model, "sequence_parallel", False) or getattr(mesh, "cp", 1) > 1:
        raise PlanError([("model.vision", "sequence or context parallelism with a vision tower: not built yet")])
    vcfg = vision_config(vision_section, llama_cfg.vocab_size)
    layout = encoder_layout(vision_section, mesh)
    if layout.share_group is not None:
        model = ShardedEncoderVLM(llama_cfg, vcfg, parts.model, layout.share_group)
    else:
        model = VisionLanguageModel(llama_cfg, vcfg, parts.model)
    init_vision_from_seed(model, build.seed)
    shard_tower(model.vision_tower, layout.tp_group)  # model.vision.parallel: tp (models.vision_tp)
    if mesh.pp > 1 and mesh.pp_rank > 0:  # the encoder lives on the first stage only
        del model.vision_tower, model.multi_modal_projector
    elif mesh.pp > 1:  # the first stage's chunk embeds through the decoder: merge the images' features there
        object.__setattr__(parts.model, "embed", _merged_embed(model, parts.model.embed))
    for prefix in ("vision_tower", "multi_modal_projector"):
        if hasattr(model, prefix):
            getattr(model, prefix).to(device=device, dtype=param_dtype(build.dtype))
    frozen = bool(getattr(vision_section, "freeze", False))
    names = [n for n, _ in model.named_parameters() if n.startswith(ENCODER_PREFIXES)]
    params = dict(model.named_parameters())
    unused = unused_encoder_parameters(model) if names else set()
    for n in names:
        params[n].requires_grad_(not frozen and n not in unused)
    regions = {f"language_model.{n}": r for n, r in parts.regions.items()}
    encoder_regions = tower_regions(model.vision_tower) if hasattr(model, "vision_tower") else {}
    regions.update({n: encoder_regions.get(n, Region.full(params[n].shape)) for n in names})
    placement = parts.placement  # the TP axis is cut in two: the split tower over vtp, the images' shares over vshare
    placement.params = {f"language_model.{n}": axes for n, axes in placement.params.items()}
    placement.sizes.update(vtp=layout.tp, vshare=layout.shares)
    shared = Partial() if layout.shares > 1 else Replicate()  # each rank's share of the images: a partial gradient
    for n in names:
        placement.params[n] = {**placement.stage_axes(), "vtp": tensor_axis(regions[n], layout.tp), "vshare": shared}
    parts.groups.update(vtp=layout.tp_group, vshare=layout.share_group)
    parts.model, parts.regions, parts.vision = model, regions, vcfg
    return parts


def _merged_embed(vlm: VisionLanguageModel, token_embed: Any) -> Any:
    """The first pipeline stage's ``embed(input_ids, pixel_values=None)``: token embeddings with the images'
    features merged (``vlm``'s tower and projector)."""

    def embed(input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None) -> torch.Tensor:
        features = None if pixel_values is None else vlm.image_features(pixel_values)
        return merge_image_features(token_embed(input_ids), input_ids, features, vlm.vision_config.image_token_id)

    return embed


def unused_encoder_parameters(model: VisionLanguageModel) -> set[str]:
    """Names of tower parameters the features do not depend on (the layers after ``feature_layer``, the post-norm):
    found by one backward of a blank image; they stay frozen, so no optimizer state is kept (or expected) for them."""
    vcfg = model.vision_config
    pixels = torch.zeros((1, vcfg.num_channels, vcfg.image_size, vcfg.image_size), dtype=next(model.parameters()).dtype)
    encoder = [(n, p) for n, p in model.named_parameters() if n.startswith(ENCODER_PREFIXES)]
    for _, p in encoder:
        p.requires_grad_(True)
    with torch.enable_grad():
        out = VisionLanguageModel.image_features(model, pixels).sum()
        grads = torch.autograd.grad(out, [p for _, p in encoder], allow_unused=True)
    return {n for (n, _), g in zip(encoder, grads, strict=True) if g is None}
