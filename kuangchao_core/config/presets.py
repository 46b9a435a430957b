"""Named model shapes. A preset fills every ``model`` field the config leaves unset."""

from __future__ import annotations

MODEL_PRESETS: dict[str, dict[str, object]] = {
    # byte-level vocabulary; small enough for CPU tests and the demo
    "tiny": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "max_seq_len": 128,
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "tie_embeddings": False,
    },
    "small": {
        "vocab_size": 256,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_layers": 4,
        "num_heads": 8,
        "num_kv_heads": 4,
        "max_seq_len": 512,
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "tie_embeddings": False,
    },
    # the published Meta-Llama-3-8B shape
    "llama3-8b": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_layers": 32,
        "num_heads": 32,
        "num_kv_heads": 8,
        "max_seq_len": 8192,
        "rope_theta": 500000.0,
        "norm_eps": 1e-5,
        "tie_embeddings": False,
    },
}

#: the fields a preset provides
SHAPE_FIELDS: tuple[str, ...] = tuple(MODEL_PRESETS["tiny"])
