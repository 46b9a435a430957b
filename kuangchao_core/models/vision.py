"""A ViT vision tower with the architecture and parameter names of transformers' ``CLIPVisionModel`` (issue 31).

Pixels (batch, channels, H, W) -> a strided convolution cuts the image into patches (no bias) -> a learnt class
embedding is put in front -> learnt absolute position embeddings are added -> the pre-norm ``pre_layrnorm`` (CLIP's
spelling) -> pre-LN encoder layers (LayerNorm, biased multi-head self-attention over all tokens, LayerNorm, MLP
fc1-act-fc2 with quick_gelu). The hidden state LLaVA reads is ``feature_layer`` (0 = after the pre-norm, k = after
layer k, negative from the end) with the class token dropped for ``feature_select: default``.

Only the layers up to the feature layer run; the rest and ``post_layernorm`` (CLIP's pooled output, which LLaVA
never reads) are kept so that a checkpoint round-trips unchanged, and are frozen (no gradient could reach them).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

from kuangchao_core.config.vision_schema import VisionSection, image_tokens_per_image, vision_errors
from kuangchao_core.errors import ConfigError


@dataclass
class VisionConfig:
    """Sizes of the vision tower and projector (the fields of ``model.vision``, with the placeholder id resolved)."""

    tower: str
    image_size: int
    patch_size: int
    num_channels: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    hidden_act: str
    feature_layer: int
    feature_select: str
    projector_hidden_act: str
    projector_bias: bool
    image_token_id: int

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def num_patches(self) -> int:
        """Patches of one image."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens (features) one image fills in the sequence."""
        return image_tokens_per_image(self)

    @property
    def layers_used(self) -> int:
        """Encoder layers that run before the feature layer's hidden state."""
        return self.feature_layer % (self.num_layers + 1)

    def validate(self, vocab_size: int | None = None) -> VisionConfig:
        """Raise ConfigError naming every ``model.vision.…`` field that is inconsistent; return self."""
        errs = vision_errors(self, vocab_size)
        if errs:
            raise ConfigError(errs)
        return self


_FIELDS = [f.name for f in fields(VisionConfig)]


def vision_config(section: Any = None, vocab_size: int | None = None, **changes: Any) -> VisionConfig:
    """The VisionConfig of a ``model.vision`` section (a VisionSection, a dict or None for the defaults) with
    ``changes`` applied, validated against the decoder's ``vocab_size``; an unset ``image_token_id`` becomes the
    vocabulary's last id."""
    if isinstance(section, VisionSection):
        section = section.model_dump()
    try:
        sec = VisionSection(**{**(section or {}), **changes})
    except ValidationError as exc:
        raise ConfigError([(".".join(["model.vision", *map(str, e["loc"])]), e["msg"]) for e in exc.errors()]) from None
    values = sec.model_dump()
    if values["image_token_id"] is None:
        if vocab_size is None:
            raise ConfigError([("model.vision.image_token_id", "not set and no vocabulary size to default from")])
        values["image_token_id"] = vocab_size - 1
    return VisionConfig(**{k: values[k] for k in _FIELDS}).validate(vocab_size)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation, x·sigmoid(1.702·x)."""
    return x * torch.sigmoid(1.702 * x)


#: activation name (transformers' ``ACT2FN``) -> function
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": quick_gelu,
    "silu": F.silu,
    "relu": F.relu,
}


class VisionEmbeddings(nn.Module):
    """Patch convolution, class token, absolute position embeddings (``embeddings.*`` of CLIP)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.image_size = cfg.image_size
        self.class_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(cfg.num_patches + 1, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(
                f"pixel_values must be (images, channels, {self.image_size}, {self.image_size}) "
                f"(model.vision.image_size), got {tuple(pixel_values.shape)}"
            )
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.to(patches.dtype).expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention with biased projections; heads follow the projections' sizes."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        h = cfg.hidden_size
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.out_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # scale 1/sqrt(head_dim), no mask: every token sees all
        return self.out_proj(out.transpose(1, 2).reshape(b, s, -1))


class VisionMLP(nn.Module):
    """fc1 -> activation -> fc2, both biased."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """One pre-LN block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.self_attn = VisionAttention(cfg)
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """The stack of encoder layers (``encoder.layers.N``)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg) for _ in range(cfg.num_layers))


class VisionTower(nn.Module):
    """CLIP's vision transformer; ``forward(pixel_values) -> features`` (images, tokens_per_image, hidden_size)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg.validate()
        self.embeddings = VisionEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = VisionEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        for module in [*self.encoder.layers[cfg.layers_used :], self.post_layernorm]:
            module.requires_grad_(False)

    def hidden_state(self, pixel_values: torch.Tensor, index: int) -> torch.Tensor:
        """Hidden state ``index`` (0: after the pre-norm, k: after encoder layer k) of every token."""
        h = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.encoder.layers[:index]:
            h = layer(h)
        return h

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        h = self.hidden_state(pixel_values, self.config.layers_used)
        return h[:, 1:] if self.config.feature_select == "default" else h
