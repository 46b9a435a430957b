"""``train.compile``: each decoder layer compiled with ``torch.compile`` (as torchtitan compiles per block).

Compiling per layer keeps parameter names, pipeline stage cuts and activation checkpointing as they are (the
checkpoint wraps the compiled call), and one layer's graph serves every layer of the same shape. Compilation is
lazy: the first forward of each layer pays it (tens of seconds with inductor on a CPU, seconds on a GPU).
"""

from __future__ import annotations

from torch import nn


def compile_layers(model: nn.Module, backend: str = "inductor") -> int:
    """``torch.compile`` every decoder layer of ``model`` in place (layers other stages hold are skipped); returns
    how many were compiled."""
    count = 0
    for layer in model.model.layers:
        if isinstance(layer, nn.Identity):
            continue
        layer.compile(backend=backend)
        count += 1
    return count
