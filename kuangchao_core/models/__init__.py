"""kuangchao_core.models: model definitions (a Llama-style decoder)."""

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
