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
    # about 125 M parameters with a 32 k vocabulary (GPT-2 small's width and depth, head_dim 64); embedding and head
    # apart, so pipeline stages can hold them
    "125m": {
        "vocab_size": 32000,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_layers": 12,
        "num_heads": 12,
        "num_kv_heads": 4,
        "max_seq_len": 1024,
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "tie_embeddings": False,
    },
    # the published Llama-3.2-1B shape (1.24 B parameters, embedding tied to the head, so no pipeline stages), without
    # its long-context RoPE scaling: 8 k positions
    "1b": {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_layers": 16,
        "num_heads": 32,
        "num_kv_heads": 8,
        "max_seq_len": 8192,
        "rope_theta": 500000.0,
        "norm_eps": 1e-5,
        "tie_embeddings": True,
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
