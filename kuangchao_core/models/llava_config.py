"""The decoder part of a Hugging Face ``config.json``: a Llama's own keys, or a LLaVA's ``text_config`` (issue 31).

:func:`decoder_config` is what :func:`~kuangchao_core.models.llama.llama_config_from_hf` reads, so a job whose
``model.checkpoint`` is a LLaVA directory takes the decoder's shape from it like a Llama directory's; the tower's
shape is read by :mod:`kuangchao_core.ckpt.hf_llava`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kuangchao_core.errors import ConfigError
from kuangchao_core.models.hf_moe_config import MIXTRAL, UNSUPPORTED

#: transformers' ``LlamaConfig`` defaults, for the keys a LLaVA ``text_config`` may leave out (llava-1.5's does)
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
}


def is_llava(raw: Any) -> bool:
    """Whether a parsed ``config.json`` is a LLaVA model's."""
    return isinstance(raw, dict) and raw.get("model_type") == "llava"


def decoder_config(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """The Llama decoder's keys of ``raw`` (the parsed ``config.json`` at ``path``): ``raw`` itself for a Llama,
    its ``text_config`` over :data:`TEXT_DEFAULTS` for a LLaVA; a Mixtral's (``models.hf_moe_config`` reads its
    experts). Any other ``model_type`` raises ConfigError (naming what differs for the MoE families it knows)."""
    kind = raw.get("model_type", "llama")
    if kind == "llava":
        text = raw.get("text_config") or {}
        if not isinstance(text, dict):
            raise ConfigError([("model.checkpoint", f"{path}: text_config must be an object")])
        raw, kind = {**TEXT_DEFAULTS, **text}, text.get("model_type", "llama")
    if kind in UNSUPPORTED:
        raise ConfigError([("model.checkpoint", f"{path}: model_type {kind!r} is not imported: {UNSUPPORTED[kind]}")])
    if kind not in ("llama", MIXTRAL):
        why = "only 'llama' and 'mixtral' load (or a LLaVA with a Llama decoder)"
        raise ConfigError([("model.checkpoint", f"{path}: model_type {kind!r}; {why}")])
    return raw
