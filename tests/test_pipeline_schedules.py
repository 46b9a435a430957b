"""Pipeline schedule definitions (SPEC L3.3): 1F1B properties, interleaving, deadlock freedom, bubbles, refusals.

The executed order on real processes is checked against these definitions in ``test_pipeline.py``.
"""

from __future__ import annotations

import pytest

from kuangchao_core.errors import PlanError
from kuangchao_core.parallel.pipeline import (
    BACKWARD,
    FORWARD,
    RECV_ACT,
    SEND_ACT,
    Action,
    bubble_fraction,
    build_all,
    exchange_plan,
    get_schedule,
    max_in_flight,
    partition_layers,
    simulate,
    validate_schedule,
)

CASES = [(2, 4, 1), (4, 8, 1), (2, 4, 2), (4, 8, 2), (3, 6, 3), (8, 16, 2), (4, 4, 2)]


def _compute(actions):
    return [a for a in actions if a.kind in (FORWARD, BACKWARD)]


@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 32)])
def test_1f1b_definition_has_the_1f1b_shape(p, m):
    for r, acts in enumerate(build_all("1f1b", p, m)):
        comp = _compute(acts)
        warmup = p - r - 1
        assert [a.kind for a in comp[:warmup]] == [FORWARD] * warmup, f"rank {r}: warm-up is {warmup} forwards"
        steady = comp[warmup : warmup + 2 * (m - warmup)]
        assert [a.kind for a in steady] == [FORWARD, BACKWARD] * (m - warmup), f"rank {r}: steady state alternates"
        assert [a.kind for a in comp[warmup + 2 * (m - warmup) :]] == [BACKWARD] * warmup
        assert [a.mb for a in comp if a.kind == FORWARD] == list(range(m))
        assert [a.mb for a in comp if a.kind == BACKWARD] == list(range(m))
        assert max_in_flight(acts) == min(p - r, m) <= p
        # traffic sits next to its compute and goes to the neighbours
        for i, a in enumerate(acts):
            if a.kind == SEND_ACT:
                assert acts[i - 1] == Action(FORWARD, a.mb, 0) and a.peer == r + 1
            if a.kind == RECV_ACT:
                assert acts[i + 1] == Action(FORWARD, a.mb, 0) and a.peer == r - 1


@pytest.mark.parametrize("p,m,v", CASES)
def test_interleaved_definition(p, m, v):
    per_rank = build_all("interleaved_1f1b", p, m, v)
    for r, acts in enumerate(per_rank):
        comp = _compute(acts)
        fwd = [(a.mb, a.chunk) for a in comp if a.kind == FORWARD]
        bwd = [(a.mb, a.chunk) for a in comp if a.kind == BACKWARD]
        units = {(mb, c) for mb in range(m) for c in range(v)}
        assert sorted(fwd) == sorted(units) and sorted(bwd) == sorted(units), "each unit once each way"
        first_b = next(i for i, a in enumerate(comp) if a.kind == BACKWARD)
        warmup = min(2 * (p - r - 1) + (v - 1) * p, m * v)
        assert [a.kind for a in comp[:warmup]] == [FORWARD] * warmup
        assert first_b == (warmup + 1 if warmup < m * v else m * v), "one forward, then backwards start"
        pos = {(a.kind, a.mb, a.chunk): i for i, a in enumerate(comp)}
        for mb, c in units:
            assert pos[(FORWARD, mb, c)] < pos[(BACKWARD, mb, c)]
            if c:
                assert pos[(FORWARD, mb, c - 1)] < pos[(FORWARD, mb, c)], "a micro-batch goes up the chunks"
        # the first p*v forwards: p micro-batches through chunk 0, then the same p through chunk 1, ...
        head = fwd[: min(p * v, len(fwd))]
        assert head == [(k % p, k // p) for k in range(len(head))]
        assert max_in_flight(acts) == min(warmup + 1, m * v)


_SIM_CASES = CASES + [(1, 3, 1), (2, 6, 1), (3, 9, 1)]


@pytest.mark.parametrize(
    "name,p,m,v",
    [  # 1f1b has one chunk per rank: only v == 1 cases for it
        (name, p, m, v)
        for name in ("afab", "1f1b", "interleaved_1f1b")
        for p, m, v in _SIM_CASES
        if not (name == "1f1b" and v != 1)
    ],
)
def test_schedules_never_deadlock_and_keep_pair_order(name, p, m, v):
    if name == "afab":
        m = max(1, m - 1)
    result = simulate(build_all(name, p, m, v), p, v)
    assert result["makespan"] > 0


@pytest.mark.parametrize("p,m,v", [(2, 8, 1), (4, 8, 1), (2, 8, 2), (4, 8, 2), (8, 16, 2), (4, 16, 4)])
def test_simulated_bubble_is_the_formula(p, m, v):
    name = "1f1b" if v == 1 else "interleaved_1f1b"
    # forward 1, backward 2 per chunk of 1/v of a stage's layers
    got = simulate(build_all(name, p, m, v), p, v, cost=lambda a: (1.0 if a.kind == FORWARD else 2.0) / v)["bubble"]
    assert got == pytest.approx(bubble_fraction(p, m, v), abs=1e-9)
    afab = simulate(build_all("afab", p, m, 1), p, 1)["bubble"]
    assert afab == pytest.approx(bubble_fraction(p, m, 1), abs=1e-9), "GPipe has the same bubble as 1F1B"


def test_simulator_catches_deadlock_and_misordering():
    recv_first = [
        [Action(RECV_ACT, 0, 0, 1), Action(FORWARD, 0, 0), Action(SEND_ACT, 0, 0, 1)],
        [Action(RECV_ACT, 0, 0, 0), Action(FORWARD, 0, 0), Action(SEND_ACT, 0, 0, 0)],
    ]
    with pytest.raises(PlanError, match="deadlock"):
        simulate(recv_first, 2)
    swapped = build_all("1f1b", 2, 2)
    i, j = [k for k, a in enumerate(swapped[1]) if a.kind == RECV_ACT]
    swapped[1][i], swapped[1][j] = swapped[1][j], swapped[1][i]
    with pytest.raises(PlanError, match=r"F0.0\) reads RECV_ACT of micro-batch 0 before receiving it"):
        simulate(swapped, 2)
    # a plan that posts rank 1's two receives of activations in the wrong order: NCCL pairs by posting order
    acts = build_all("1f1b", 2, 2)
    plan = exchange_plan(acts, 2)
    recvs = sorted(((at, g) for at, gs in plan[1].items() for g in gs if acts[1][g[0]].kind == RECV_ACT))
    (at0, g0), (at1, g1) = recvs[:2]
    plan[1][at1].remove(g1)
    plan[1][at0][plan[1][at0].index(g0)] = g1 + g0  # one exchange, the second message's receive posted first
    with pytest.raises(PlanError, match="expects"):
        simulate(acts, 2, plan=plan)


def _runs_between_computes(actions):
    """The grouping the exchange plan replaces: each run of traffic between two computes, issued where it stands."""
    plan, run = {}, []
    for i, a in enumerate([*actions, Action(FORWARD, -1)]):
        if a.kind in (FORWARD, BACKWARD):
            if run:
                plan[run[0]] = [run]
            run = []
        else:
            run.append(i)
    return plan


@pytest.mark.parametrize(
    "name,p,m,v", [("interleaved_1f1b", 2, 4, 2), ("afab", 2, 4, 2), ("interleaved_1f1b", 4, 8, 2)]
)
def test_exchange_slots_are_what_keeps_chunked_schedules_from_deadlocking(name, p, m, v):
    acts = build_all(name, p, m, v)
    assert simulate(acts, p, v)["makespan"] > 0  # the slot plan
    with pytest.raises(PlanError, match="deadlock"):  # control: grouping each run of traffic where it stands
        simulate(acts, p, v, plan=[_runs_between_computes(a) for a in acts])


def test_partition_is_balanced_with_embedding_first_and_head_last():
    plan = partition_layers(8, 2, 2)
    assert [(c.start, c.end) for c in plan[0]] == [(0, 2), (4, 6)]
    assert [(c.start, c.end) for c in plan[1]] == [(2, 4), (6, 8)]
    assert [c.stage for r in plan for c in r] == [0, 2, 1, 3]
    flags = {(c.pp_rank, c.chunk): (c.has_embedding, c.has_head) for r in plan for c in r}
    assert flags == {(0, 0): (True, False), (0, 1): (False, False), (1, 0): (False, False), (1, 1): (False, True)}
    plan4 = partition_layers(4, 4)
    assert [(r[0].start, r[0].end) for r in plan4] == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize(
    "call,numbers",
    [
        (lambda: partition_layers(6, 4), ["6 layers", "4 x 1 = 4", "remainder 2"]),
        (lambda: partition_layers(8, 2, 3), ["8 layers", "2 x 3 = 6"]),
        (lambda: validate_schedule("1f1b", 4, 3), ["m=3 < p=4"]),
        (lambda: validate_schedule("interleaved_1f1b", 4, 6, 2), ["m=6, p=4", "m % p = 2", "use m = 8"]),
        (lambda: validate_schedule("interleaved_1f1b", 4, 2, 2), ["m=2, p=4", "use m = 4"]),
        (lambda: validate_schedule("1f1b", 2, 4, 2), ["virtual_pipeline_size=2"]),
        (lambda: get_schedule("zero_bubble"), ["'zero_bubble'", "interleaved_1f1b"]),
        (lambda: validate_schedule("afab", 2, 0), ["got 0"]),
    ],
)
def test_bad_plans_are_refused_with_the_numbers(call, numbers):
    with pytest.raises(PlanError) as info:
        call()
    for text in numbers:
        assert text in str(info.value)
