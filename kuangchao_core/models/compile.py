"""``train.compile``: each decoder layer compiled with ``torch.compile`` (as torchtitan compiles per block).

Compiling per layer keeps parameter names, pipeline stage cuts and activation checkpointing as they are (the
checkpoint wraps the compiled call), and one layer's graph serves every layer of the same shape. Compilation is
lazy: the first forward of each layer pays it, and its backward graph is compiled at the first backward (tens of
seconds with inductor on a CPU, seconds on a GPU).

Tensor parallelism: a TP layer's norms and row-parallel projections communicate (an all-reduce in the forward or
the backward, through :mod:`kuangchao_core.comm`). Left to itself dynamo cannot put those autograd functions in a
graph (the communication layer mutates its counters), breaks the graph there and then traces the communication
layer's own Python frames (guard check, sequence numbers) as they run. Those submodules therefore run eagerly, with
dynamo off (:func:`torch.compiler.disable`): each layer compiles into the pieces between its collectives, and every
collective runs exactly as without compilation.

The compile time is measured with dynamo's compile start/end callbacks (tracing, AOTAutograd and inductor of every
forward graph, and of each backward graph compiled at its first use) and logged once per process, by the rank that
asks for it, when the first backward pass through compiled layers has ended: ``compiled N decoder layers with
inductor in X s``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kuangchao_core.models.attention import keep_documents_out_of_graphs
from kuangchao_core.parallel.tensor import ColumnParallelLinear, ReplicatedHeadsLinear, tp_size_of

log = logging.getLogger("kuangchao.models.compile")


@dataclass
class CompileClock:
    """Wall time this process spent in ``torch.compile`` compilations (fed by dynamo's compile callbacks).

    ``seconds``: the sum over compilations; ``compilations``: how many (forward frames and lazily compiled
    backward graphs); ``backward_compilations``: how many of them were backward graphs compiled at first use."""

    seconds: float = 0.0
    compilations: int = 0
    backward_compilations: int = 0
    _started: float | None = field(default=None, repr=False)

    def install(self) -> None:
        """Register the callbacks with dynamo (again after ``torch._dynamo.reset()``, which clears them)."""
        from torch._dynamo.callback import callback_handler

        if self._on_start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(self._on_start)
        if self._on_end not in callback_handler.end_callbacks:
            callback_handler.register_end_callback(self._on_end)

    def _on_start(self, args: Any) -> None:
        self._started = time.perf_counter()

    def _on_end(self, args: Any) -> None:
        if self._started is None:
            return
        self.seconds += time.perf_counter() - self._started
        self._started = None
        self.compilations += 1
        if getattr(getattr(args, "callback_trigger", None), "name", "") == "LAZY_BACKWARD":
            self.backward_compilations += 1


#: this process's compile clock
CLOCK = CompileClock()
_reported = False  # the compile time has been logged in this process


def communicates(module: nn.Module) -> bool:
    """Whether ``module``'s own forward or backward runs a collective of a tensor-parallel group of more than one
    rank: row-parallel projections (all-reduce forward), replicated-head projections (all-reduce of the weight
    gradient), column-parallel ones that copy their input in or gather their output, and any other module holding
    such a group (the TP norms, whose backward all-reduces)."""
    if tp_size_of(getattr(module, "group", None)) == 1:
        return False
    if isinstance(module, ColumnParallelLinear) and not isinstance(module, ReplicatedHeadsLinear):
        return bool(module.copy_input or module.gather_output)
    return True


def keep_collectives_eager(layer: nn.Module) -> int:
    """Run every submodule of ``layer`` that :func:`communicates` with dynamo off (its forward wrapped in
    :func:`torch.compiler.disable`, on that instance only); returns how many were."""
    count = 0
    for module in layer.modules():
        if module is not layer and communicates(module):
            module.forward = torch.compiler.disable(module.forward, recursive=True)
            count += 1
    return count


def compile_layers(model: nn.Module, backend: str = "inductor", report: bool = False) -> int:
    """``torch.compile`` every decoder layer of ``model`` in place (layers other stages hold are skipped; the
    collectives of tensor-parallel layers stay eager, :func:`keep_collectives_eager`); returns how many were
    compiled. ``report``: this process logs the compile time once, after its first backward pass through them
    (give it to rank 0)."""
    CLOCK.install()
    keep_documents_out_of_graphs()
    layers = [layer for layer in model.model.layers if not isinstance(layer, nn.Identity)]
    for layer in layers:
        keep_collectives_eager(layer)
        layer.compile(backend=backend)
    if report and not _reported and layers:
        _FirstBackwardReport(layers, backend).arm()
    return len(layers)


class _FirstBackwardReport:
    """Wraps each layer's compiled call until the first backward pass through one of them has ended, then logs the
    compile time once and puts the plain compiled calls back."""

    def __init__(self, layers: list[nn.Module], backend: str) -> None:
        self.layers = layers
        self.backend = backend
        self.compiled = [layer._compiled_call_impl for layer in layers]
        self.hooked = False

    def arm(self) -> None:
        for layer, call in zip(self.layers, self.compiled, strict=True):
            layer._compiled_call_impl = self._watching(call)

    def _watching(self, call: Any) -> Any:
        def watched(*args: Any, **kwargs: Any) -> Any:
            CLOCK.install()
            out = call(*args, **kwargs)
            if not self.hooked and isinstance(out, torch.Tensor) and out.requires_grad:
                self.hooked = True
                out.register_hook(self._in_backward)
            return out

        return watched

    def _in_backward(self, grad: torch.Tensor) -> None:
        # runs inside the backward pass: the report waits until that whole pass (every compiled backward) has ended
        torch.autograd.Variable._execution_engine.queue_callback(self._report)

    def _report(self) -> None:
        global _reported
        for layer, call in zip(self.layers, self.compiled, strict=True):
            layer._compiled_call_impl = call
        if _reported:
            return
        _reported = True
        n = len(self.layers)
        log.info(
            "compiled %d decoder layer%s with %s in %.1f s",
            n,
            "" if n == 1 else "s",
            self.backend,
            CLOCK.seconds,
            extra={
                "fields": {
                    "layers": n,
                    "backend": self.backend,
                    "compile_s": round(CLOCK.seconds, 3),
                    "compilations": CLOCK.compilations,
                    "backward_compilations": CLOCK.backward_compilations,
                }
            },
        )
