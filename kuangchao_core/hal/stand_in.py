"""A stand-in accelerator on the CPU, so that CI can tell a device tensor from a host tensor (``KC_COMM_RULES=nccl``).

On a GPU a stray host tensor on an NCCL group fails at once; on a CPU machine every tensor is on the CPU and the
same bug passes unseen. With ``KC_COMM_RULES=nccl`` set, ``device_init("cpu")`` hands out :data:`DEVICE`
(``cpu:0``) as the job's device and :func:`install` makes the process track which tensors live there:

- a tensor is on the stand-in device when an op created it with ``device=cpu:0`` (``torch.zeros(n,
  device=ctx.device)``, ``batch.to(ctx.device)``, ``torch.tensor(x, device=ctx.device)``) or computed it from a
  tensor that is (parameters, activations, gradients, optimizer state: forward and backward alike); the mark
  belongs to the storage, so views and ``.grad`` share it;
- everything else — ``torch.tensor([step])``, a batch before its copy, ``x.cpu()`` — is a host tensor; ``.cpu()`` /
  ``.to("cpu")`` of a device tensor is a real copy (a device-to-host transfer, as on a GPU), while
  ``.to(torch.device("cpu"))`` stays a no-op (torch's own code passes the C++ device it grouped tensors by);
- ``x.device`` reports ``cpu:0`` for device tensors, so ``torch.zeros(1, device=x.device)`` stays on the device;
- ``.numpy()`` of a device tensor fails as it does on CUDA; ``.item()``, ``.tolist()`` and device-to-host copies
  are counted in :func:`host_reads` (each is a host sync on a GPU).

Only the thread that called :func:`install` is tracked (torch's modes are per thread): a loader thread makes host
tensors, as it does on a GPU machine. The tracking costs a Python call per op: it is for tests, never for speed.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kuangchao_core.hal.lazy_dynamo import skip_disable

ENV = "KC_COMM_RULES"
#: the stand-in accelerator: a CPU device with an index, which torch keeps in ops' ``device`` arguments
DEVICE = torch.device("cpu", 0)
_HOST = torch.device("cpu")

_marked: weakref.WeakSet = weakref.WeakSet()  # storages on the stand-in device
_state = threading.local()
_installed: list[object] = []
_reads = {"count": 0}
_DEVICE_GETTER = torch._C.TensorBase.__dict__["device"]
_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default


def requested() -> bool:
    """Whether this process was asked to enforce NCCL's rules (``KC_COMM_RULES=nccl``)."""
    return os.environ.get(ENV, "").strip().lower() == "nccl"


def active() -> bool:
    """Whether the stand-in device is tracking tensors in this process."""
    return bool(_installed)


def is_device_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on the job's device: a CUDA tensor, or a tensor on the stand-in device."""
    if t.device.type != "cpu":
        return True
    if not _installed:
        return False
    try:
        return t.untyped_storage() in _marked
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, sparse)
        return False


def host_reads() -> int:
    """Device-to-host reads so far in this process (``.item()``, ``.tolist()``, ``.cpu()`` of device tensors)."""
    return _reads["count"]


def _mark(out) -> None:
    for o in tree_flatten(out)[0]:
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            with contextlib.suppress(RuntimeError, NotImplementedError):
                _marked.add(o.untyped_storage())


def _mark_fresh(out, inputs: list[torch.Tensor]) -> None:
    """Mark ``out`` unless it is (a view of) one of the op's inputs: an in-place op leaves a tensor where it was."""
    if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
        return
    with contextlib.suppress(RuntimeError, NotImplementedError):
        storage = out.untyped_storage()
        if not any(storage._cdata == a.untyped_storage()._cdata for a in inputs if a.device.type == "cpu"):
            _marked.add(storage)


def _names_host(args, kwargs) -> bool:
    """Whether ``Tensor.to``'s arguments name the host as the string ``"cpu"``. A ``torch.device("cpu")`` object is
    what torch's own code passes after grouping tensors by their C++ device (``clip_grad_norm_``, foreach
    optimizers), where a GPU would pass ``cuda``: that stays a no-op on the stand-in device."""
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and target.strip().lower() == "cpu"


def _is_stand_in(device) -> bool:
    if device is None:
        return False
    d = torch.device(device)
    return d.type == "cpu" and d.index == 0


@contextlib.contextmanager
def _host_copy():
    _state.host = True
    try:
        yield
    finally:
        _state.host = False


class _Dispatch(TorchDispatchMode):
    """Marks the outputs of every op that runs on the stand-in device (forward and backward)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _LOCAL_SCALAR:
            if is_device_tensor(args[0]):
                _reads["count"] += 1
            return out
        if getattr(_state, "host", False):
            return out
        if _is_stand_in(kwargs.get("device")):
            _mark(out)
            return out
        # a plain ``cpu`` device argument is what torch's own code passes for a tensor's C++ device
        # (``new_empty_strided`` when autograd accumulates a gradient): such an op stays where its inputs are
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if func.__name__.startswith("_foreach_") and isinstance(out, (list, tuple)):
            # element i of a multi-tensor op comes from element i of each list argument
            lists = [a for a in args if isinstance(a, (list, tuple)) and len(a) == len(out)]
            for i, o in enumerate(out):
                if any(isinstance(x[i], torch.Tensor) and is_device_tensor(x[i]) for x in lists):
                    _mark_fresh(o, inputs)
        elif any(is_device_tensor(a) for a in inputs):
            for o in tree_flatten(out)[0]:
                _mark_fresh(o, inputs)
        return out


_Dispatch.__torch_dispatch__ = skip_disable(_Dispatch.__torch_dispatch__)  # torch's wrapper imports dynamo


class _Function(TorchFunctionMode):
    """``x.device`` of device tensors, device-to-host copies and reads, ``torch.tensor(..., device=cpu:0)``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DEVICE_GETTER:
            return DEVICE if is_device_tensor(args[0]) else _HOST
        name = getattr(func, "__name__", "")
        if name in ("to", "cpu") and args and isinstance(args[0], torch.Tensor) and is_device_tensor(args[0]):
            out = func(*args, **kwargs)
            if name == "cpu" or _names_host(args[1:], kwargs):
                _reads["count"] += 1
                with _host_copy():
                    out = out.clone() if out.untyped_storage() in _marked else out
            return out
        if name == "tolist" and args and is_device_tensor(args[0]):
            _reads["count"] += 1
        elif name == "numpy" and args and is_device_tensor(args[0]):
            raise TypeError(
                f"a {tuple(args[0].shape)} {args[0].dtype} tensor on the job's device read with .numpy(): on a GPU "
                "this fails (can't convert a cuda tensor to numpy); copy it to the host with .cpu() first"
            )
        return func(*args, **kwargs)


def install() -> None:
    """Track the stand-in device in this thread from now on (idempotent). ``torch.tensor`` and ``torch.as_tensor``
    do not reach torch's modes, so they are wrapped to see their ``device`` argument."""
    if _installed:
        return
    for mode in (_Dispatch(), _Function()):
        mode.__enter__()
        _installed.append(mode)
    for name in ("tensor", "as_tensor"):
        plain = getattr(torch, name)

        def placed(*args, _plain=plain, **kwargs):
            out = _plain(*args, **kwargs)
            if _is_stand_in(kwargs.get("device")):
                _mark(out)
            return out

        placed.__doc__ = plain.__doc__
        setattr(torch, name, placed)
