"""A model's shape for planning when only part of it is known: a preset, a Hugging Face directory, a parameter
count (``--params 8e9``), or a config whose ``model.checkpoint`` is not readable on this machine.

A parameter count maps to the preset whose size is within 10 % of it (``llama3-8b`` for 8e9), else to a shape of
the Llama 3 family: head dim 128; 1, 2, 4 or a multiple of 8 heads (so that TP sizes divide them) and a quarter as
many key/value heads; MLP width 3.5·h (a multiple of 256); vocabulary 128256 (32000 when embedding and head would
hold more than half the parameters); a layer count near h/128 (Llama 3 8B: 4096 wide, 32 layers), a multiple of 4
from 8 layers on (so that pipeline sizes divide it). The estimate is for planning only; nothing is built from it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kuangchao_core.config.access import setting
from kuangchao_core.errors import ConfigError
from kuangchao_core.models.llama import PRESETS, LlamaConfig, config_from_model_section, load_hf_llama_config

_VOCAB = 128256
_SMALL_VOCAB = 32000  # Llama 2's, for counts too small for Llama 3's vocabulary
_HEAD_DIM = 128


def _synthesized(n_params: float, vocab: int) -> LlamaConfig | None:
    best: tuple[float, LlamaConfig] | None = None
    for heads in (1, 2, 4, *range(8, 257, 8)):
        h = heads * _HEAD_DIM
        ffn = max(256, int(round(3.5 * h / 256)) * 256)
        shape = {
            "vocab_size": vocab,
            "hidden_size": h,
            "intermediate_size": ffn,
            "num_heads": heads,
            "num_kv_heads": heads // 4 if heads % 4 == 0 else heads,
            "max_seq_len": 8192,
            "rope_theta": 500000.0,
        }
        fixed = LlamaConfig(num_layers=0, **shape).num_params()
        per_layer = LlamaConfig(num_layers=1, **shape).num_params() - fixed
        layers = round((n_params - fixed) / per_layer)
        if layers >= 8:
            layers = 4 * round(layers / 4)
        if layers < 1:
            continue
        score = abs(math.log(h / layers / 128.0))
        if best is None or score < best[0]:
            best = (score, LlamaConfig(num_layers=layers, **shape))
    return None if best is None else best[1]


def shape_for_params(n_params: float) -> tuple[LlamaConfig, str]:
    """A shape of about ``n_params`` parameters and a sentence saying where it comes from (module docstring)."""
    if not n_params > 0:
        raise ConfigError([("model.params", f"must be > 0, got {n_params}")])
    name, cfg = min(PRESETS.items(), key=lambda kv: abs(kv[1].num_params() - n_params))
    if abs(cfg.num_params() - n_params) <= 0.1 * n_params:
        return cfg, f"preset {name} ({cfg.num_params():,} parameters), the preset nearest to {n_params:g}"
    cfg = _synthesized(n_params, _VOCAB)
    if cfg is None or 2 * cfg.vocab_size * cfg.hidden_size > 0.5 * n_params:
        cfg = _synthesized(n_params, _SMALL_VOCAB) or cfg
    if cfg is None:
        raise ConfigError(
            [("model.params", f"{n_params:g} parameters is too few for a Llama-style shape; name a preset instead")]
        )
    return cfg, (
        f"a Llama-style shape of {cfg.num_params():,} parameters for {n_params:g} (hidden {cfg.hidden_size}, "
        f"{cfg.num_layers} layers, {cfg.num_heads} heads, {cfg.num_kv_heads} kv heads, MLP {cfg.intermediate_size})"
    )


def shape_for_name(model: str) -> tuple[LlamaConfig, str]:
    """A preset name or a local Hugging Face directory (with ``config.json``) → its shape and a note."""
    if model in PRESETS:
        return PRESETS[model], f"preset {model} ({PRESETS[model].num_params():,} parameters)"
    if Path(model).exists():
        cfg = load_hf_llama_config(model)
        return cfg, f"{model} ({cfg.num_params():,} parameters)"
    raise ConfigError(
        [("model", f"{model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a local model directory")]
    )


def shape_for_section(model_section: Any) -> tuple[LlamaConfig, str]:
    """The shape of a config's ``model`` section; when its checkpoint cannot be read here but ``params`` is set,
    the shape for that parameter count (the note says so). Other errors are raised as they are."""
    try:
        cfg = config_from_model_section(model_section)
    except ConfigError as exc:
        params = setting(model_section, "params")
        if params is None or not any(path == "model.checkpoint" for path, _ in exc.errors):
            raise
        cfg, note = shape_for_params(float(params))
        reason = "; ".join(msg for path, msg in exc.errors if path == "model.checkpoint")
        return cfg, f"{note}, from model.params (model.checkpoint unusable here: {reason})"
    return cfg, f"the config's model section ({cfg.num_params():,} parameters)"


def model_section_of(cfg: LlamaConfig) -> dict[str, Any]:
    """A config ``model`` section that spells out every field of ``cfg`` (no checkpoint, no preset needed; a MoE
    model's ``moe`` as its section's fields)."""
    moe = None if cfg.moe is None else {k: list(v) if isinstance(v, tuple) else v for k, v in vars(cfg.moe).items()}
    return {"type": "llama", "checkpoint": None, **vars(cfg), "moe": moe}


def with_model_shape(cfg: Any, model_cfg: LlamaConfig) -> Any:
    """A copy of job config ``cfg`` whose ``model`` section spells out ``model_cfg`` (and names no checkpoint)."""
    from kuangchao_core.config import config_from_dict

    data = cfg.to_dict()
    data["model"] = {**model_section_of(model_cfg), "params": data["model"].get("params")}
    return config_from_dict(data)
