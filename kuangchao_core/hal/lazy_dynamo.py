"""Keep ``torch._dynamo`` out of processes that never compile (about 2 s of CPU per process, every rank).

torch wraps a few eager entry points so that dynamo does not trace into them: ``Optimizer.add_param_group``,
``zero_grad``, ``state_dict`` and ``load_state_dict`` (``torch._disable_dynamo``) and ``Adam.step`` (whose wrapper
calls ``torch._dynamo.graph_break()``). Each wrapper imports ``torch._dynamo`` on its first call, so building an
AdamW imported dynamo (and inductor) in every worker. Outside a compilation both wrappers do nothing but run the
function: with no dynamo imported no frame is being traced, there is no eval-frame callback to disable, and
``graph_break`` is an empty function in eager mode. :func:`install` puts in front of each wrapper a check: while
``torch._dynamo`` is not imported, the wrapped function runs directly (``Adam.step`` with torch's own grad-mode
handling); once it is (``train.compile``, or any other user of dynamo), torch's wrapper runs, as before.

Each target is checked to still be the wrapper this was written against (a torch upgrade that changes one leaves it
as torch has it).
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch

_DYNAMO = "torch._dynamo"
OPTIMIZER_METHODS = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
_installed: list[str] = []


def dynamo_imported() -> bool:
    """Whether ``torch._dynamo`` is imported in this process."""
    return _DYNAMO in sys.modules


def _is_torch_wrapper(fn: Any, code_name: str, module: Any) -> bool:
    """Whether ``fn`` is torch's wrapper function ``code_name`` of ``module`` (``functools.wraps`` gave it the
    wrapped function's names, not its code's)."""
    code = getattr(fn, "__code__", None)
    return (
        hasattr(fn, "__wrapped__")
        and code is not None
        and code.co_name == code_name
        and code.co_filename == module.__file__
    )


def skip_disable(wrapped: Callable) -> Callable:
    """``wrapped`` (a ``torch._disable_dynamo`` wrapper) that calls its function directly until dynamo is imported;
    anything else comes back unchanged."""
    if not _is_torch_wrapper(wrapped, "inner", importlib.import_module("torch._compile")):
        return wrapped
    raw = wrapped.__wrapped__

    @functools.wraps(raw)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _DYNAMO in sys.modules:
            return wrapped(*args, **kwargs)
        return raw(*args, **kwargs)

    call.__kc_torch_wrapper__ = wrapped
    return call


def _skip_graph_break(wrapped: Callable) -> Callable:
    """An optimizer ``step`` wrapped by torch's ``_use_grad_for_differentiable``: the same grad mode around the
    step (``defaults["differentiable"]``), without the ``graph_break`` calls until dynamo is imported."""
    raw = wrapped.__wrapped__

    @functools.wraps(raw)
    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if _DYNAMO in sys.modules:
            return wrapped(self, *args, **kwargs)
        previous = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return raw(self, *args, **kwargs)
        finally:
            torch.set_grad_enabled(previous)

    step.__kc_torch_wrapper__ = wrapped
    return step


def install() -> list[str]:
    """Put the checks in front of torch's wrappers (idempotent); returns the names of the entry points changed."""
    if _installed or dynamo_imported():
        return list(_installed)
    optimizer = torch.optim.Optimizer
    for name in OPTIMIZER_METHODS:
        fn = optimizer.__dict__.get(name)
        if fn is not None and skip_disable(fn) is not fn:
            setattr(optimizer, name, skip_disable(fn))
            _installed.append(f"Optimizer.{name}")
    adam = torch.optim.Adam
    fn = adam.__dict__.get("step")
    if _is_torch_wrapper(fn, "_use_grad", importlib.import_module("torch.optim.optimizer")):
        adam.step = _skip_graph_break(fn)
        _installed.append("Adam.step")
    return list(_installed)
