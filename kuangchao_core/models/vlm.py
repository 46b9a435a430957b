"""The vision-language model (LLaVA's scheme, issue 31): vision tower -> projector -> features merged into the decoder.

A sequence carries one image placeholder token (``model.vision.image_token_id``) per image feature, the expanded
form LLaVA's processor produces: ``tokens_per_image`` placeholders for each image, images in batch order. The
decoder embeds the tokens, the placeholders' embeddings are replaced by the projected features (first image's
features into the first placeholders, row-major over the batch, as transformers' ``masked_scatter``), and the decoder
runs on the result unchanged.

Parameter names are those of transformers' LLaVA checkpoints on disk: ``vision_tower.*`` (CLIP's vision model),
``multi_modal_projector.linear_{1,2}.*`` and the decoder under ``language_model.`` (``language_model.model.*``,
``language_model.lm_head.weight``), so :mod:`kuangchao_core.ckpt.hf_llava` maps names one to one. The decoder is
any :class:`~kuangchao_core.models.llama.LlamaForCausalLM` (a tensor-parallel one too); the tower is built whole.
"""

from __future__ import annotations

import torch
from torch import nn

from kuangchao_core.hal.stand_in import is_device_tensor
from kuangchao_core.models.llama import LlamaConfig, LlamaForCausalLM, init_from_seed
from kuangchao_core.models.vision import ACTIVATIONS, VisionConfig, VisionTower

#: added to the job's seed for the vision tower's and projector's initial weights (the decoder uses the seed itself)
VISION_SEED_OFFSET = 1_000_003


class LlavaProjector(nn.Module):
    """linear_1 -> activation -> linear_2: vision width to the decoder's width (``multi_modal_projector``)."""

    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.act = ACTIVATIONS[act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def merge_image_features(
    embeds: torch.Tensor, input_ids: torch.Tensor, features: torch.Tensor | None, image_token_id: int
) -> torch.Tensor:
    """``embeds`` (batch, seq, hidden) with the positions where ``input_ids`` holds ``image_token_id`` replaced, in
    row-major order, by ``features`` (images, tokens_per_image, hidden). Raises ValueError when the placeholders
    and the features do not pair up one to one (no images: there must be no placeholder).

    On the job's device the count is checked without reading it back (a host read per micro-batch would stall a
    GPU's queue; the data gate has checked every record's placeholders already): a mismatch fails the next sync."""
    mask = input_ids == image_token_id
    have = 0 if features is None else features.shape[0] * features.shape[1]
    if is_device_tensor(input_ids):
        torch._assert_async(mask.sum() == have, f"image placeholders do not pair up with {have} image features")
        placeholders = have
    else:
        placeholders = int(mask.sum())
    if placeholders != have:
        images = 0 if features is None else features.shape[0]
        raise ValueError(
            f"{placeholders} image placeholder tokens (id {image_token_id}) but {images} images give {have} "
            "features; each image needs exactly model.vision's tokens_per_image placeholders"
        )
    if features is None:
        return embeds
    return embeds.masked_scatter(mask.unsqueeze(-1), features.to(embeds.dtype))


class VisionLanguageModel(nn.Module):
    """LLaVA: ``forward(input_ids, pixel_values) -> logits`` (batch, seq, vocab)."""

    def __init__(self, cfg: LlamaConfig, vision_cfg: VisionConfig, language_model: LlamaForCausalLM | None = None):
        super().__init__()
        self.config = cfg.validate()
        self.vision_config = vision_cfg.validate(cfg.vocab_size)
        self.vision_tower = VisionTower(vision_cfg)
        self.multi_modal_projector = LlavaProjector(
            vision_cfg.hidden_size, cfg.hidden_size, vision_cfg.projector_hidden_act, vision_cfg.projector_bias
        )
        self.language_model = language_model if language_model is not None else LlamaForCausalLM(cfg)

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Projected features of each image: (images, tokens_per_image, decoder hidden)."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings with the image placeholders replaced by the images' features (batch, seq, hidden)."""
        h = self.language_model.embed(input_ids)
        features = None if pixel_values is None else self.image_features(pixel_values)
        return merge_image_features(h, input_ids, features, self.vision_config.image_token_id)

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for every position; ``position_ids``/``segment_ids`` as in the decoder's ``run_layers``."""
        if input_ids.shape[-1] > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {input_ids.shape[-1]} exceeds model.max_seq_len {self.config.max_seq_len}"
            )
        lm = self.language_model
        h = lm.run_layers(self.embed(input_ids, pixel_values), position_ids=position_ids, segment_ids=segment_ids)
        return lm.head(h)

    def init_weights(self, seed: int) -> None:
        """The decoder as :func:`~kuangchao_core.models.llama.init_from_seed`, then :func:`init_vision_from_seed`."""
        init_from_seed(self.language_model, seed)
        init_vision_from_seed(self, seed)


@torch.no_grad()
def init_vision_from_seed(model: VisionLanguageModel, seed: int) -> None:
    """The tower's and projector's initial weights, whatever the decoder's layout: from a CPU generator seeded
    ``seed + VISION_SEED_OFFSET``, in parameter-name order, norms' scales one, biases zero, every other weight
    N(0, 0.02)."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed) + VISION_SEED_OFFSET)
    for prefix in ("vision_tower", "multi_modal_projector"):
        for name, p in getattr(model, prefix).named_parameters():
            if "norm" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02))
