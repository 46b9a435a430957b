"""What each group accepts, and the same order on every rank: NCCL's rules, enforced on Gloo in CI.

NCCL communicates device tensors only, matches every rank's collectives by their order alone, and pairs sends
with receives in the order they were posted between two ranks (it ignores tags). A job that breaks one of these
fails or silently corrupts on its first GPU run, while Gloo on a CPU forgives all three. So every primitive passes
:func:`admit`:

- a **device group** enforcing ``nccl`` rules (a real NCCL group, or any device group while the stand-in device of
  ``KC_COMM_RULES=nccl`` tracks tensors) refuses a host tensor, naming the op, the group, the tensor and the fix;
- the **host group** refuses a device tensor (host coordination travels as CPU tensors);
- under the stand-in device, every admitted op is appended to the group's :class:`OrderLog` (op, dtype, shape;
  per peer and direction for point-to-point), which :mod:`kuangchao_core.comm.order_check` compares across ranks,
  and to the rank's :mod:`~kuangchao_core.comm.stream_trace`, which it replays under NCCL's stream rules.
"""

from __future__ import annotations

import hashlib
from collections import deque

import torch

from kuangchao_core.comm import stream_trace
from kuangchao_core.errors import CommError
from kuangchao_core.hal import stand_in

_RECENT = 6  # ops kept per stream for the message that names a mismatch


class OrderLog:
    """A running digest of what one group issued on this rank: collectives, and point-to-point per peer and
    direction, with the last few ops of each in words."""

    __slots__ = ("streams",)

    def __init__(self) -> None:
        self.streams: dict[str, list] = {}  # key -> [count, digest hex, recent ops]

    def add(self, key: str, entry: str) -> None:
        """Append ``entry`` to stream ``key`` (``coll``, ``send>3``, ``recv<1``)."""
        count, digest, recent = self.streams.get(key) or [0, "", deque(maxlen=_RECENT)]
        recent.append(entry)
        digest = hashlib.sha256(f"{digest}|{entry}".encode()).hexdigest()[:16]
        self.streams[key] = [count + 1, digest, recent]

    def summary(self) -> dict[str, list]:
        """``{key: [count, digest, [recent ops]]}`` (JSON-ready)."""
        return {k: [c, d, list(r)] for k, (c, d, r) in self.streams.items()}


def _describe(t: torch.Tensor) -> str:
    return f"a {tuple(t.shape)} {t.dtype} tensor"


def admit(op: str, group, *tensors: torch.Tensor, peer: int | None = None, tag: int = 0) -> None:
    """Refuse what ``group`` must not carry (see the module docstring); under the stand-in device, log the op (and
    record it for the stream replay, :mod:`kuangchao_core.comm.stream_trace`)."""
    if group.kind == "host":
        stream_trace.host_op(group, op, peer)
        for t in tensors:
            if stand_in.is_device_tensor(t):
                raise CommError(
                    f"{op} on host group {group.name!r}: {_describe(t)} is on the job's device ({t.device}); the "
                    "host group carries CPU tensors for coordination (send device tensors on a device group)"
                )
        return
    if group.rules != "nccl":
        return
    for t in tensors:
        if not stand_in.is_device_tensor(t):
            where = "a host tensor" if t.device.type == "cpu" else str(t.device)
            raise CommError(
                f"{op} on NCCL group {group.name!r}: {_describe(t)} is on {t.device} ({where}); NCCL communicates "
                "device tensors only (create it on the job's device, or use the host group for coordination)"
            )
    if stand_in.active() and tensors:
        t = tensors[0]
        what = f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
        if peer is None:
            group.order.add("coll", f"{op} {what}")
        else:  # a send and the receive it pairs with log the same entry
            group.order.add(f"{'send>' if op == 'send' else 'recv<'}{peer}", what)
        stream_trace.issue(group, op, peer, what, tag)
