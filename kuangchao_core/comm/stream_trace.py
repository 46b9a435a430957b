"""What this rank issued, in host order, for the NCCL stream replay (``KC_COMM_RULES=nccl``; ``comm.stream_model``).

Recorded only while the stand-in device tracks tensors (CI), as JSON-ready lists:

- ``["op", id, stream, group, parts]``: an operation on a device group. ``parts`` holds ``[kind, peer, what, tag]``
  per send/receive (``peer`` a global rank) or one ``[collective, None, what, 0]``; ``stream`` is the group's name
  for collectives and grouped batches, ``"<group>:<low>-<high>"`` for a single send or receive (torch's NCCL
  process group runs those on a communicator of the pair);
- ``["wait", id]``: the compute stream waits for operation ``id`` (a handle's ``wait()``, or a blocking primitive);
- ``["sync"]``: the host read a device value (``.item()``, ``.cpu()``), so it waited for the compute stream;
- ``["host", group, op, peer]``: a blocking operation on the host group (``peer`` None for a collective).

The comm layer records issues in ``comm.rules.admit`` (every primitive passes it), waits in ``comm.dispatch``, and
grouped batches through :func:`batch`. Host reads are noticed from the stand-in's counter when the next event is
recorded and when :func:`take` hands the window over.
"""

from __future__ import annotations

import contextlib
import threading

from kuangchao_core.hal import stand_in

_lock = threading.Lock()
_events: list[list] = []
_state = {"next": 0, "last": None, "reads": 0, "batch": None}


def recording() -> bool:
    """Whether operations are being recorded (the stand-in device is active)."""
    return stand_in.active()


def _note_reads() -> None:
    reads = stand_in.host_reads()
    if reads != _state["reads"]:
        _state["reads"] = reads
        _events.append(["sync"])


def issue(group, op: str, peer: int | None, what: str, tag: int = 0) -> None:
    """Record an operation on device ``group`` (inside :func:`batch`: one part of the batch)."""
    with _lock:
        part = [op, peer, what, int(tag)]
        if _state["batch"] is not None:
            _state["batch"].append(part)
            return
        _note_reads()
        _state["next"] += 1
        oid = _state["next"]
        if peer is None:
            stream = group.name
        else:
            low, high = sorted((group.global_rank, int(peer)))
            stream = f"{group.name}:{low}-{high}"
        _events.append(["op", oid, stream, group.name, [part]])
        _state["last"] = oid


@contextlib.contextmanager
def batch(group):
    """The operations issued inside run as one grouped operation on ``group``'s stream (``batch_isend_irecv``)."""
    if not recording():
        yield
        return
    with _lock:
        _state["batch"] = []
    try:
        yield
    finally:
        with _lock:
            parts, _state["batch"] = _state["batch"], None
            if parts:
                _note_reads()
                _state["next"] += 1
                _events.append(["op", _state["next"], group.name, group.name, parts])
                _state["last"] = _state["next"]


def last_issued() -> int | None:
    """The id of the operation recorded last (the one the dispatch is about to run), or None."""
    return _state["last"] if recording() else None


def wait(oid: int | None) -> None:
    """Record that the compute stream waits for operation ``oid``."""
    if oid is None or not recording():
        return
    with _lock:
        _note_reads()
        _events.append(["wait", oid])


def host_op(group, op: str, peer: int | None = None) -> None:
    """Record a blocking operation on the host group ``group``."""
    if not recording():
        return
    with _lock:
        _note_reads()
        _events.append(["host", group.name, op, None if peer is None else int(peer)])


def take() -> list[list]:
    """This rank's events since the last call (a host read since the last event ends them as a sync)."""
    with _lock:
        _note_reads()
        out = list(_events)
        _events.clear()
        return out


def reset() -> None:
    """Forget everything recorded (a new process group: a new job in this process)."""
    with _lock:
        _events.clear()
        _state.update(next=0, last=None, reads=stand_in.host_reads(), batch=None)
