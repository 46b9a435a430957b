"""A Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU MLP and grouped-query attention.

Parameter names are those of Hugging Face ``LlamaForCausalLM`` (its weights load unchanged); parallel layers hook in:

- every projection is built by :meth:`LlamaForCausalLM.make_linear` (``role`` names which one), so a
  tensor-parallel subclass can return column/row-parallel layers; attention infers its local head counts from the
  projections' output sizes, so sharded q/k/v projections work without other changes;
- :meth:`LlamaForCausalLM.embed`, :meth:`LlamaForCausalLM.run_layers` and :meth:`LlamaForCausalLM.head` are the
  pieces a pipeline stage runs on its own slice of layers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kuangchao_core.config.access import setting
from kuangchao_core.config.moe_schema import moe_errors
from kuangchao_core.config.presets import MODEL_PRESETS
from kuangchao_core.errors import ConfigError
from kuangchao_core.hal.dtypes import at_least_fp32
from kuangchao_core.models.attention import Documents, attend
from kuangchao_core.models.hf_moe_config import merge_moe, with_hf_moe
from kuangchao_core.models.llava_config import decoder_config
from kuangchao_core.models.lm_loss import IGNORE_INDEX, causal_lm_loss, expected_initial_loss  # noqa: F401
from kuangchao_core.models.moe import MoeBlock, MoeConfig
from kuangchao_core.models.recompute import run_layer

#: Roles a projection can have (how tensor parallelism splits each is ``models.tp_llama.TP_PLAN``).
PROJECTION_ROLES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


@dataclass
class LlamaConfig:
    """Sizes of a Llama-style decoder."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 176
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dropout: float = 0.0  # residual dropout after attention and MLP (training only; 0 = off, as in Llama)
    moe: MoeConfig | None = None  # mixture-of-experts feed-forward blocks (issue 40, models.moe); None: dense

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    def validate(self) -> LlamaConfig:
        """Raise ConfigError listing every inconsistent or out-of-bounds size (:data:`SIZE_LIMITS`); return self."""
        errs: list[tuple[str, str]] = []
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if int(getattr(self, name)) < 1:
                errs.append((f"model.{name}", f"must be >= 1, got {getattr(self, name)}"))
        for name, limit in SIZE_LIMITS.items():
            if int(getattr(self, name)) > limit:
                errs.append((f"model.{name}", f"{getattr(self, name)} is above the limit {limit}"))
        if self.max_seq_len < 1:
            errs.append(("model.max_seq_len", f"must be >= 1, got {self.max_seq_len}"))
        if not errs:
            if self.hidden_size % self.num_heads:
                errs.append(
                    (
                        "model.num_heads",
                        f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}",
                    )
                )
            elif self.head_dim % 2:
                errs.append(("model.num_heads", f"head_dim {self.head_dim} must be even for rotary embeddings"))
            if self.num_heads % self.num_kv_heads:
                errs.append(
                    (
                        "model.num_kv_heads",
                        f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}",
                    )
                )
        if self.rope_theta <= 0:
            errs.append(("model.rope_theta", f"must be > 0, got {self.rope_theta}"))
        if self.norm_eps <= 0:
            errs.append(("model.norm_eps", f"must be > 0, got {self.norm_eps}"))
        errs += moe_errors(self.moe, self.num_layers) if self.moe is not None else []
        if errs:
            raise ConfigError(errs)
        return self

    def num_params(self) -> int:
        """Number of distinct parameters of the model this config builds."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h
        moe = len(self.moe.moe_layers(self.num_layers)) * (self.moe.num_params(h, i) - 3 * h * i) if self.moe else 0
        return emb * (1 if self.tie_embeddings else 2) + self.num_layers * layer + h + moe


#: Named shapes, from the config layer's presets (one source of truth).
PRESETS: dict[str, LlamaConfig] = {name: LlamaConfig(**shape) for name, shape in MODEL_PRESETS.items()}

_FIELDS = [f.name for f in fields(LlamaConfig)]


def config_from_model_section(model_section: Any) -> LlamaConfig:
    """Build a LlamaConfig from the job config's ``model`` section (an object or a dict).

    Fields set in the section win; unset ones come from ``checkpoint`` (a local Hugging Face directory) when given,
    else from ``preset``. Raises ConfigError naming every field that stays unset or is inconsistent.
    """
    base: dict[str, Any] = {}
    checkpoint = setting(model_section, "checkpoint")
    preset = setting(model_section, "preset")
    if checkpoint:
        base = vars(load_hf_llama_config(checkpoint)).copy()
    elif preset:
        if preset not in PRESETS:
            raise ConfigError([("model.preset", f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")])
        base = vars(PRESETS[preset]).copy()
    missing = []
    for name in _FIELDS:
        value = setting(model_section, name)
        if name == "moe" and checkpoint:  # the checkpoint's experts, the section's training settings
            base[name] = merge_moe(base["moe"], value, checkpoint)
        elif value is not None:
            base[name] = value
        elif name not in base:
            if name in ("rope_theta", "norm_eps", "tie_embeddings", "dropout", "moe"):
                base[name] = getattr(LlamaConfig, name)
            else:
                missing.append((f"model.{name}", "not set and no preset or checkpoint supplies it"))
    if missing:
        raise ConfigError(missing)
    ints = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "max_seq_len")
    base.update({name: int(base[name]) for name in ints})
    base.update(rope_theta=float(base["rope_theta"]), norm_eps=float(base["norm_eps"]))
    base["tie_embeddings"] = bool(base["tie_embeddings"])
    base["dropout"] = float(base["dropout"])
    base["moe"] = MoeConfig.from_section(base["moe"])
    return LlamaConfig(**base).validate()


#: upper bounds of a model's sizes (a config, or a checkpoint's config.json, beyond them is refused before anything
#: is planned or allocated; the largest public Llama-style models are well inside them)
SIZE_LIMITS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 20,
    "num_layers": 1024,
    "num_heads": 1024,
    "num_kv_heads": 1024,
    "max_seq_len": 1 << 22,
}
#: config.json key of each LlamaConfig size
HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "max_seq_len": "max_position_embeddings",
}


def _hf_sizes(raw: dict, path: Path) -> None:
    """Refuse config.json sizes that are not whole numbers within :data:`SIZE_LIMITS`, naming the key."""
    errs = []
    for field_name, key in HF_KEYS.items():
        if key not in raw or raw[key] is None:
            continue
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            errs.append(("model.checkpoint", f"{path}: {key} must be a whole number, got {value!r}"))
        elif not 1 <= value <= SIZE_LIMITS[field_name]:
            errs.append(("model.checkpoint", f"{path}: {key} {int(value)} is outside [1, {SIZE_LIMITS[field_name]}]"))
    if errs:
        raise ConfigError(errs)


def load_hf_llama_config(directory: str | Path) -> LlamaConfig:
    """Read a local Hugging Face Llama ``config.json`` (never the hub) into a LlamaConfig."""
    if str(directory).startswith("models:/"):
        msg = (
            f"{directory} is a registered MLflow model: `kc train` (the flow) resolves it to its files; "
            "elsewhere give its local directory (kc plan --set model.checkpoint=DIR)"
        )
        raise ConfigError([("model.checkpoint", msg)])
    path = Path(directory)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            [("model.checkpoint", f"no config.json at {path}; give a local Hugging Face model directory")]
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError([("model.checkpoint", f"cannot read {path}: {exc}")]) from exc
    return llama_config_from_hf(raw, path)


def llama_config_from_hf(raw: Any, path: Path) -> LlamaConfig:
    """A Hugging Face Llama config (``raw``, the parsed JSON of ``path``; a LLaVA's decoder) as a LlamaConfig."""
    if not isinstance(raw, dict):
        raise ConfigError([("model.checkpoint", f"{path} is not a JSON object (got {type(raw).__name__})")])
    raw = decoder_config(raw, path)  # a LLaVA directory's decoder is its text_config
    _hf_sizes(raw, path)
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError([("model.checkpoint", f"{path}: rope_scaling must be an object, got {rope!r:.40}")])
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ConfigError(
            [("model.checkpoint", f"{path}: rope type {rope_type!r} is not supported; only plain RoPE ('default')")]
        )
    theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    try:
        cfg = LlamaConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            num_kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
            max_seq_len=int(raw.get("max_position_embeddings", 2048)),
            rope_theta=float(theta),
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )
    except KeyError as exc:
        raise ConfigError([("model.checkpoint", f"{path} lacks the key {exc.args[0]!r}")]) from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError([("model.checkpoint", f"{path}: a size or setting is not a number ({exc})")]) from None
    head_dim = raw.get("head_dim")
    if head_dim is not None and int(head_dim) != cfg.head_dim:
        raise ConfigError(
            [("model.checkpoint", f"{path}: head_dim {head_dim} != hidden_size/num_heads {cfg.head_dim}; unsupported")]
        )
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ConfigError([("model.checkpoint", f"{path}: biased projections are not supported")])
    return with_hf_moe(cfg, raw, path).validate()


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in at least fp32 and cast back (as Hugging Face does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """torch's fused kernel; half precision normalised in fp32, cast back before the scale (as HF does)."""
        if self.weight.dtype == x.dtype == at_least_fp32(x).dtype:
            return F.rms_norm(x, self.weight.shape, self.weight, eps=self.eps)
        return self.weight * F.rms_norm(at_least_fp32(x), self.weight.shape, eps=self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embeddings in the rotate_half layout (frequencies repeated over the two
    halves), the sin table's first half negated: :func:`apply_rotary` rotates with one ``roll`` instead of a ``cat``."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        if torch.get_default_device().type == "meta":  # shapes only; these ops on meta would import torch._dynamo
            inv_freq = torch.empty(head_dim // 2)
        else:
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for ``positions`` (seq,) -> (seq, head_dim), or per sequence (batch, seq) -> (batch, 1, seq,
        head_dim), which broadcasts over the heads."""
        # the tables are computed in fp32 for every dtype, as Hugging Face does, so fp64 logits match theirs
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        if emb.dim() == 3:
            emb = emb.unsqueeze(1)
        sin = emb.sin()
        sin[..., : freqs.shape[-1]].neg_()
        return emb.cos().to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embeddings on ``x`` (batch, heads, seq, head_dim): HF's ``x·cos + (−x2, x1)·sin`` as ``x·cos + (x2,
    x1)·(−sin, sin)`` with :class:`RotaryEmbedding`'s tables, the same numbers (a negation is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


LinearFactory = Callable[[int, int, str], nn.Module]


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention; head counts follow the projections' output sizes. ``attend_fn``: the
    kernel, ``attend`` unless set (``models.ring_attention.use_attention``: the CP ring)."""

    attend_fn: Callable | None = None

    def __init__(self, cfg: LlamaConfig, make_linear: LinearFactory):
        super().__init__()
        d = cfg.head_dim
        self.head_dim = d
        self.q_proj = make_linear(cfg.hidden_size, cfg.num_heads * d, "q_proj")
        self.k_proj = make_linear(cfg.hidden_size, cfg.num_kv_heads * d, "k_proj")
        self.v_proj = make_linear(cfg.hidden_size, cfg.num_kv_heads * d, "v_proj")
        self.o_proj = make_linear(cfg.num_heads * d, cfg.hidden_size, "o_proj")

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        """Causal attention, inside each of the packed ``documents`` when given (no dense mask, no repeated K/V)."""
        b, s, _ = x.shape
        q, k, v = (
            proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = (self.attend_fn or attend)(q, k, v, documents)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig, make_linear: LinearFactory):
        super().__init__()
        self.gate_proj = make_linear(cfg.hidden_size, cfg.intermediate_size, "gate_proj")
        self.up_proj = make_linear(cfg.hidden_size, cfg.intermediate_size, "up_proj")
        self.down_proj = make_linear(cfg.intermediate_size, cfg.hidden_size, "down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """One pre-norm transformer block (decoder layer ``index``); its MLP is a MoE block in ``cfg.moe``'s layers."""

    def __init__(self, cfg: LlamaConfig, make_linear: LinearFactory, index: int = 0):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, make_linear)
        moe = cfg.moe is not None and index in cfg.moe.moe_layers(cfg.num_layers)
        self.mlp = MoeBlock(cfg.hidden_size, cfg.intermediate_size, cfg.moe) if moe else LlamaMLP(cfg, make_linear)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.dropout = float(cfg.dropout)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout > 0.0 and self.training:
            return F.dropout(x, self.dropout, training=True)
        return x

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        h = h + self._drop(self.self_attn(self.input_layernorm(h), cos, sin, documents))
        return h + self._drop(self.mlp(self.post_attention_layernorm(h)))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (the ``model.`` prefix of Hugging Face names)."""

    def __init__(self, cfg: LlamaConfig, make_linear: LinearFactory, make_embedding: Callable[[int, int], nn.Module]):
        super().__init__()
        self.embed_tokens = make_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, make_linear, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)


class LlamaForCausalLM(nn.Module):
    """Decoder-only language model with Hugging Face parameter names; ``forward(input_ids) -> logits``.

    ``activation_checkpointing``: ``none``, ``full`` or ``selective`` (:mod:`kuangchao_core.models.recompute`),
    applied to each decoder layer while autograd records."""

    activation_checkpointing: str = "none"

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg.validate()
        self.model = LlamaModel(cfg, self.make_linear, self.make_embedding)
        self.lm_head = self.make_linear(cfg.hidden_size, cfg.vocab_size, "lm_head")
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_linear(self, in_features: int, out_features: int, role: str) -> nn.Module:
        """Build one bias-free projection; ``role`` is q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
        down_proj or lm_head. Override to return parallel layers."""
        return nn.Linear(in_features, out_features, bias=False)

    def make_embedding(self, num_embeddings: int, dim: int) -> nn.Module:
        """Build the token embedding. Override to return a vocabulary-parallel embedding."""
        weight = torch.empty(num_embeddings, dim)
        if weight.device.type != "meta":  # nn.Embedding's own N(0, 1); on meta normal_ would import torch._dynamo
            nn.init.normal_(weight)
        return nn.Embedding(num_embeddings, dim, _weight=weight)

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (``model.layers``)."""
        return self.model.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (batch, seq, hidden)."""
        return self.model.embed_tokens(input_ids)

    def rotary(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables for positions 0..seq_len-1."""
        positions = torch.arange(seq_len, device=device)
        return self.model.rotary_emb(positions, dtype)

    def run_layers(
        self,
        h: torch.Tensor,
        start: int = 0,
        end: int | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run decoder layers ``start``..``end``-1 (indices into ``model.layers``) on hidden states ``h``.

        ``position_ids`` (batch, seq): rotary positions per token (default 0..seq-1); ``segment_ids`` (batch, seq):
        which packed document each token belongs to — attention stays inside a document."""
        end = len(self.model.layers) if end is None else end
        if position_ids is None:
            cos, sin = self.rotary(h.shape[1], h.device, h.dtype)
        else:
            cos, sin = self.model.rotary_emb(position_ids.to(h.device), h.dtype)
        documents = None if segment_ids is None else Documents.from_segment_ids(segment_ids.to(h.device))
        for layer in self.model.layers[start:end]:
            h = run_layer(layer, h, cos, sin, self.activation_checkpointing, documents)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and output projection: hidden states -> logits (batch, seq, vocab)."""
        return self.lm_head(self.model.norm(h))

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for every position of ``input_ids`` (batch, seq); ``position_ids``/``segment_ids`` as in
        :meth:`run_layers` (packed documents)."""
        if input_ids.shape[-1] > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {input_ids.shape[-1]} exceeds model.max_seq_len {self.config.max_seq_len}; "
                "shorten data.seq_len or raise model.max_seq_len"
            )
        h = self.run_layers(self.embed(input_ids), position_ids=position_ids, segment_ids=segment_ids)
        return self.head(h)

    def init_weights(self, seed: int) -> None:
        """Deterministic initialisation (:func:`init_from_seed` with every tensor whole)."""
        init_from_seed(self, seed)


@torch.no_grad()
def init_from_seed(model: LlamaForCausalLM, seed: int, slices: dict[str, tuple[int, int, int] | None] | None = None):
    """The one weight initialisation: norms to one, every other weight N(0, 0.02) from a CPU generator seeded with
    ``seed``, one full tensor at a time in parameter-name order, each rank keeping its ``slices`` entry
    ``(dim, start, length)`` (None or absent: the whole tensor). Every layout therefore starts from the same
    network as one process, and no rank ever holds more than one full tensor at a time."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    slices = slices or {}
    params = dict(model.named_parameters())
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in LlamaForCausalLM(model.config).named_parameters()}
    for name, shape in shapes.items():
        param = params[name]
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        full = torch.randn(shape, generator=gen, dtype=torch.float32).mul_(0.02)
        spec = slices.get(name)
        param.copy_(full if spec is None else full.narrow(spec[0], spec[1], spec[2]))
