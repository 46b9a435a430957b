"""When each pipeline rank issues its sends and receives: grouped exchanges in one global order (SPEC L3.3).

On NCCL a rank's point-to-point traffic runs on one stream in issue order (a group's grouped batches on the
group's communicator; single sends and receives of a pair on the pair's), and a send completes only with its
receive (a rendezvous, for messages of any size). A schedule's actions alone do not say when to post a receive:
posted one compute early and issued apart from the sends, 1F1B deadlocks at its first exchange in both directions;
grouped only with the sends next to it, interleaved 1F1B and a chunked all-forward-all-backward deadlock too.

:func:`exchange_plan` gives every message an **exchange slot**: the time its producing compute ends in the
schedule's reference timeline (every rank's actions run with eager sends, forward 1 and backward 2 units). Each
rank issues, per slot and in slot order, one grouped operation holding its sends produced at that slot and its
receives of the messages its peers produce then, at the first point of its own list at or after that time. Every
grouped operation of slot ``t`` depends only on operations of earlier slots and on its partners of slot ``t``,
which all ranks issue in the same slot order, so the plan cannot deadlock whatever the real compute times; and a
receive is posted as soon as its message exists, so it overlaps the receiver's compute until the action that
reads it. Within a slot a pair of ranks exchanges at most one message per direction, so posting order pairs them.

:func:`simulate` runs the plan on a model machine (rendezvous exchanges, a rank blocked only where it reads a
receive) and returns the makespan and the bubble; it raises ``PlanError`` if a list deadlocks, reads a message
before receiving it, or pairs a receive with a different message.
"""

from __future__ import annotations

from collections.abc import Callable

from kuangchao_core.errors import PlanError
from kuangchao_core.parallel.pp_schedules import (
    COMPUTE,
    FORWARD,
    RECV_ACT,
    RECV_GRAD,
    RECVS,
    SENDS,
    Action,
    message_key,
    stage_of,
)

#: rank -> {action index: [the action indices of each grouped operation issued there, in slot order]}
Plan = list[dict[int, list[list[int]]]]


def _unit_cost(a: Action) -> float:
    return 1.0 if a.kind == FORWARD else 2.0


def _fail(message: str) -> PlanError:
    return PlanError([("pipeline", message)])


def timeline(actions: list[list[Action]], p: int, cost: Callable[[Action], float] = _unit_cost) -> list[dict]:
    """Each rank's computes with their (start, end) times when sends complete at once and a receive waits for its
    message: ``[{action index: (start, end)}]``. Raises ``PlanError`` on a deadlock, or when a compute reads a
    message its rank has not received."""
    pc, clock = [0] * p, [0.0] * p
    sent: dict[tuple, float] = {}
    times: list[dict[int, tuple[float, float]]] = [{} for _ in range(p)]
    have: list[set] = [set() for _ in range(p)]  # (kind, mb, chunk) this rank has received
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while pc[r] < len(actions[r]):
                a = actions[r][pc[r]]
                if a.kind in SENDS:
                    sent[message_key(a, p, r)] = clock[r]
                elif a.kind in RECVS:
                    key = message_key(a, p, r)
                    if key not in sent:
                        break
                    clock[r] = max(clock[r], sent[key])
                    have[r].add((a.kind, a.mb, a.chunk))
                else:
                    _check_inputs(actions[r], pc[r], have[r], p, r)
                    times[r][pc[r]] = (clock[r], clock[r] + cost(a))
                    clock[r] += cost(a)
                pc[r] += 1
                progressed = True
    stuck = [(r, str(actions[r][pc[r]])) for r in range(p) if pc[r] < len(actions[r])]
    if stuck:
        raise _fail(f"schedule deadlocks; blocked ranks and actions: {stuck}")
    return times


def _check_inputs(acts: list[Action], i: int, have: set, p: int, r: int) -> None:
    a, s = acts[i], stage_of(p, r, acts[i].chunk)
    needs = None
    if a.kind == FORWARD and s > 0:
        needs = (RECV_ACT, a.mb, a.chunk)
    elif a.kind != FORWARD and any(x.kind == RECV_GRAD and (x.mb, x.chunk) == (a.mb, a.chunk) for x in acts):
        needs = (RECV_GRAD, a.mb, a.chunk)
    if needs is not None and needs not in have:
        raise _fail(f"rank {r} action {i} ({a}) reads {needs[0]} of micro-batch {a.mb} before receiving it")


def exchange_plan(actions: list[list[Action]], p: int) -> Plan:
    """Where each rank issues which grouped sends and receives (see the module docstring)."""
    times = timeline(actions, p)
    slot: list[dict[int, float]] = [{} for _ in range(p)]
    produced: dict[tuple, float] = {}
    for r in range(p):
        end = 0.0
        for i, a in enumerate(actions[r]):
            if a.kind in COMPUTE:
                end = times[r][i][1]
            elif a.kind in SENDS:
                slot[r][i] = end
                produced[message_key(a, p, r)] = end
    for r in range(p):
        for i, a in enumerate(actions[r]):
            if a.kind in RECVS:
                slot[r][i] = produced[message_key(a, p, r)]
    plan: Plan = []
    for r in range(p):
        starts = [(i, t[0]) for i, t in sorted(times[r].items())]
        by_slot: dict[float, list[int]] = {}
        for i, t in slot[r].items():
            by_slot.setdefault(t, []).append(i)
        where: dict[int, list[list[int]]] = {}
        for t in sorted(by_slot):
            at = next((i for i, start in starts if start >= t), len(actions[r]))
            while at > 0 and actions[r][at - 1].kind not in COMPUTE:  # before the traffic that precedes it
                at -= 1
            where.setdefault(at, []).append(sorted(by_slot[t]))
        plan.append(where)
    return plan


def simulate(
    actions: list[list[Action]],
    p: int,
    v: int = 1,
    cost: Callable[[Action], float] | None = None,
    plan: Plan | None = None,
) -> dict:
    """Run ``actions`` with their exchange ``plan`` (default: :func:`exchange_plan`) on a model machine: one stream
    of grouped exchanges per rank, each starting when issued and its predecessor is done and completing when all its
    partners have started; a rank waits only where it reads a receive; compute takes ``cost(action)`` (1 forward,
    2 backward by default). Returns ``{"makespan", "busy": [per rank], "bubble"}`` (``bubble``: the idle fraction
    ``1 - mean(busy) / makespan``). ``v`` is accepted for the callers' symmetry (chunks are in the actions)."""
    cost = cost or _unit_cost
    plan = exchange_plan(actions, p) if plan is None else plan
    pc, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    issued = [-1] * p
    streams: list[list[dict]] = [[] for _ in range(p)]
    holds: list[dict[int, dict]] = [{} for _ in range(p)]  # action index -> its grouped exchange
    counters: dict[tuple, int] = {}
    pairs: dict[tuple, dict[str, tuple]] = {}

    def issue(r: int, at: int) -> None:
        for run in plan[r].get(at, []):
            ex = {"issued": clock[r], "start": None, "done": None, "slots": []}
            for j in run:
                a = actions[r][j]
                side, src, dst = ("send", r, a.peer) if a.kind in SENDS else ("recv", a.peer, r)
                k = counters.get((side, src, dst), 0)
                counters[(side, src, dst)] = k + 1
                pairs.setdefault((src, dst, k), {})[side] = (ex, message_key(a, p, r), r, j)
                ex["slots"].append((src, dst, k))
                holds[r][j] = ex
            streams[r].append(ex)

    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while True:
                if issued[r] < pc[r]:
                    issue(r, pc[r])
                    issued[r] = pc[r]
                    progressed = True
                if pc[r] >= len(actions[r]):
                    break
                a = actions[r][pc[r]]
                if a.kind in COMPUTE:
                    clock[r] += cost(a)
                    busy[r] += cost(a)
                elif a.kind in RECVS:
                    ex = holds[r].get(pc[r])
                    if ex is None:
                        raise _fail(f"rank {r} action {pc[r]} ({a}) reads a receive the plan has not issued by then")
                    if ex["done"] is None:
                        break
                    clock[r] = max(clock[r], ex["done"])
                pc[r] += 1
                progressed = True
        progressed |= _advance(streams, pairs, actions)
    stuck = [
        (r, str(actions[r][pc[r]]) if pc[r] < len(actions[r]) else "its last exchanges")
        for r in range(p)
        if pc[r] < len(actions[r]) or any(e["done"] is None for e in streams[r])
    ]
    if stuck:
        raise _fail(f"schedule deadlocks; blocked ranks and actions: {stuck}")
    ends = [e["done"] for s in streams for e in s]
    makespan = max(clock + ends) if clock else 0.0
    return {"makespan": makespan, "busy": busy, "bubble": 1.0 - sum(busy) / (p * makespan) if makespan else 0.0}


def _advance(streams: list[list[dict]], pairs: dict, actions: list[list[Action]]) -> bool:
    """Start each stream's next exchange and complete those whose partners have all started."""
    moved = False
    for stream in streams:
        before = 0.0
        for ex in stream:
            if ex["start"] is None:
                ex["start"] = max(ex["issued"], before)
                moved = True
            if ex["done"] is None:
                break
            before = ex["done"]
    for stream in streams:
        for ex in stream:
            if ex["start"] is None or ex["done"] is not None:
                continue
            ends = [ex["start"]]
            for slot in ex["slots"]:
                pair = pairs[slot]
                if len(pair) < 2 or any(side[0]["start"] is None for side in pair.values()):
                    break
                (_, skey, sr, _), (_, rkey, rr, rj) = pair["send"], pair["recv"]
                if skey != rkey:
                    raise _fail(
                        f"rank {rr} action {rj} ({actions[rr][rj]}) expects {rkey} but the next message from rank "
                        f"{sr} is {skey}"
                    )
                ends += [side[0]["start"] for side in pair.values()]
            else:
                ex["done"] = max(ends)
                moved = True
    return moved
