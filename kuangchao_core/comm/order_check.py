"""The same collectives in the same order on every rank, and an order NCCL can run, checked (``KC_COMM_RULES=nccl``).

NCCL matches collectives by their order alone and pairs point-to-point messages in posting order; a rank that
issues another op, shape or order than its peers hangs or silently mixes data on a GPU. :func:`verify_order`
gathers every rank's :class:`~kuangchao_core.comm.rules.OrderLog` of each device group over the host group and
names the first difference; then it replays every rank's stream trace (``comm.stream_trace``) under NCCL's
execution rules (``comm.stream_model``) and names the cycle of a deadlock. The trainer calls it after every step
and once at the end of the run; it does nothing unless the stand-in device tracks tensors.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from kuangchao_core.comm import primitives as P
from kuangchao_core.comm import stream_trace
from kuangchao_core.comm.registry import all_groups
from kuangchao_core.comm.stream_model import StreamReplay
from kuangchao_core.errors import CommError
from kuangchao_core.hal import stand_in


def _exchange(host, payload: bytes) -> list[bytes]:
    """Every member's ``payload`` over the host group (JSON bytes in uint8 tensors: no pickle)."""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [int(s) for s in P.all_gather(None, size, group=host)]
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return [bytes(b[:n].tolist()) for b, n in zip(P.all_gather(None, buf, group=host), sizes, strict=True)]


def order_problems(logs: dict[int, dict[str, dict[str, list]]], members: dict[str, list[int]]) -> list[str]:
    """Where the members of a group issued different ops: ``logs`` is rank -> group name -> ``OrderLog.summary()``,
    ``members`` group name -> its global ranks. A send stream ``send>B`` of rank A must equal rank B's
    ``recv<A``."""
    problems = []
    for name, ranks in sorted(members.items()):
        present = [r for r in ranks if r in logs]
        colls = {r: logs[r].get(name, {}).get("coll", [0, "", []]) for r in present}
        first = colls[present[0]] if present else None
        for r in present[1:]:
            if colls[r][:2] != first[:2]:
                problems.append(
                    f"group {name!r}: rank {present[0]} issued {first[0]} collectives (last: {first[2]}) but rank "
                    f"{r} issued {colls[r][0]} (last: {colls[r][2]}); NCCL matches collectives by order alone"
                )
        for a in present:
            for key, (count, digest, recent) in logs[a].get(name, {}).items():
                if not key.startswith("send>"):
                    continue
                b = int(key[5:])
                theirs = logs.get(b, {}).get(name, {}).get(f"recv<{a}", [0, "", []])
                if [count, digest] != theirs[:2]:
                    problems.append(
                        f"group {name!r}: rank {a} sent {count} messages to rank {b} (last: {recent}) but rank {b} "
                        f"posted {theirs[0]} receives from {a} (last: {theirs[2]}); NCCL pairs them in posting order"
                    )
    return problems


_replay: dict = {"world": None, "model": None}


def _stream_replay() -> StreamReplay:
    """This job's replay (a new process group in this process starts a new one)."""
    world = dist.group.WORLD
    if _replay["model"] is None or _replay["world"] is not world:
        _replay.update(world=world, model=StreamReplay())
    return _replay["model"]


def verify_order(host, final: bool = False) -> None:
    """Collective over ``host`` (every rank): raise ``CommError`` if any group's members issued different ops, or if
    the ops issued since the last call would deadlock under NCCL's stream rules (``final``: the run's last check,
    where an op that can never complete is an error too). A no-op unless the stand-in device tracks tensors
    (``KC_COMM_RULES=nccl``)."""
    if not stand_in.active() or host.size == 1:
        stream_trace.take()
        return
    mine = {g.name: g.order.summary() for g in all_groups() if g.kind == "device" and g.is_member}
    members = {g.name: list(g.ranks) for g in all_groups()}
    trace = stream_trace.take()
    gathered = _exchange(host, json.dumps({"order": mine, "trace": trace, "members": members}).encode())
    reports = {host.ranks[i]: json.loads(raw) for i, raw in enumerate(gathered)}
    logs = {r: rep["order"] for r, rep in reports.items()}
    device = {g.name: list(g.ranks) for g in all_groups() if g.kind == "device"}
    problems = order_problems(logs, device)
    if problems:
        raise CommError("collective order differs between ranks: " + "; ".join(problems[:3]))
    for rep in reports.values():
        members.update(rep["members"])
    _stream_replay().feed({r: rep["trace"] for r, rep in reports.items()}, members, final=final)
