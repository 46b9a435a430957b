"""dp2 normalises the step's loss by the loader's count of the global batch's labelled tokens, without an
all-reduce (issue 39), and still trains exactly like one process: packed documents (``data.packing: documents``)
mask the label at each document boundary, so the ranks' micro-batches hold different numbers of labelled tokens.
fp64, losses and every parameter within ``FP64_REL`` of one process (micro-batch 2); negative control: every rank
takes the others' windows to hold as many labelled tokens as its own (``own_count_for_every_rank``): its
parameters must differ by ≥ ``NEGATIVE_MIN`` (its losses barely move: at the start every window's mean loss is
near log V, whatever it is weighed by)."""

from __future__ import annotations

import pytest

from tests.engine_helpers import gather_full, run_trainers, tiny_job
from tests.mp import run_distributed
from tests.tolerances import FP64_REL, NEGATIVE_MIN, rel_norm, worst_rel


def _job(root, parallel: dict):
    return tiny_job(
        str(root),
        data={"seq_len": 48, "packing": "documents"},
        parallel={"micro_batch_size": 2, **parallel},
        train={"steps": 3, "warmup_steps": 0, "dtype": "fp64"},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("step_count")
    (one,) = run_distributed(run_trainers, 1, args=([{"cfg": _job(tmp / "one", {})}],), timeout=300)
    dp2 = {"data_parallel_size": 2, "micro_batch_size": 1}
    jobs = [
        {"cfg": _job(tmp / "dp2", dp2)},
        {"cfg": _job(tmp / "control", dp2), "sabotage": "own_count_for_every_rank"},
    ]
    per_rank = run_distributed(run_trainers, 2, args=(jobs,), timeout=300)
    return {"one": one[0], "dp2": [r[0] for r in per_rank], "control": [r[1] for r in per_rank]}


def test_the_ranks_micro_batches_hold_different_numbers_of_labelled_tokens(runs):
    counts = [int((b["labels"] != -100).sum()) for r in runs["dp2"] for b in r["first_step"]]
    assert len(set(counts)) > 1, counts  # otherwise the control's count would be right: no test


def test_dp2_with_the_loader_s_count_trains_like_one_process_in_fp64(runs):
    ref = runs["one"]
    for r in runs["dp2"]:
        assert rel_norm(r["losses"], ref["losses"]) <= FP64_REL, (r["losses"], ref["losses"])
    name, worst = worst_rel(gather_full(runs["dp2"]), gather_full([ref]))
    assert worst <= FP64_REL, (name, worst)


def test_negative_control_a_count_of_the_rank_s_own_windows_differs(runs):
    name, worst = worst_rel(gather_full(runs["control"]), gather_full([runs["one"]]))
    assert worst >= NEGATIVE_MIN, (name, worst)
