"""Shared test helpers: the tiny model's config, free ports, a fake S3 server over HTTP.

``tests/conftest.py`` serves them as fixtures (``tiny_model``, ``free_port``, ``s3_endpoint``); code that runs outside
a fixture (module constants, bodies run on worker processes) imports them from here.
"""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Iterator

__all__ = ["free_port", "hf_llama_config", "moto_server", "tiny_llama"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the launcher's own choice of rendezvous port)."""
    from kuangchao_core.sched import launcher

    return launcher.free_port()


def tiny_llama(**changes):
    """The ``tiny`` preset's ``LlamaConfig`` (that of configs/tiny.yaml: 256 byte tokens, hidden 64, 2 layers, 4 heads,
    2 kv heads), with ``changes`` (``LlamaConfig`` field names) applied."""
    import dataclasses

    from kuangchao_core.models.llama import PRESETS

    return dataclasses.replace(PRESETS["tiny"], **changes)


def hf_llama_config(cfg, **changes):
    """``cfg`` (a ``LlamaConfig``) as a ``transformers.LlamaConfig`` with eager attention, with ``changes``
    (transformers' field names) applied."""
    import transformers

    fields = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attn_implementation": "eager",
    }
    return transformers.LlamaConfig(**{**fields, **changes})


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server over HTTP on a free local port, for the duration of the block; yields its endpoint URL.
    Clients need credentials (any: ``AWS_ACCESS_KEY_ID=testing``); buckets start empty."""
    from moto.server import ThreadedMotoServer

    # port 0: the kernel picks the port as the server binds it (a port chosen before, then freed, can be taken by
    # another test's server in between: two workers once shared one moto server that way)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    # moto keeps its buckets in one store per process, shared by every server this process starts: without a reset a
    # module sees the objects an earlier module on the same test worker left behind
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"), timeout=30).close()
    try:
        yield endpoint
    finally:
        server.stop()
