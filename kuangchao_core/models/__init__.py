"""L3 models: the Llama-style decoder and its tensor-parallel form.

May import: ``errors``, ``config``, ``hal``, ``comm``, ``parallel``; the guard interface ``guard_api`` (beside
``errors``).
"""

from kuangchao_core.models.llama import (
    PRESETS,
    LlamaConfig,
    LlamaForCausalLM,
    causal_lm_loss,
    config_from_model_section,
    load_hf_llama_config,
)

__all__ = [
    "PRESETS",
    "LlamaConfig",
    "LlamaForCausalLM",
    "causal_lm_loss",
    "config_from_model_section",
    "load_hf_llama_config",
]
