"""The step's loss is the mean over every labelled token of the global batch, in every layout.

Instruction data masks the prompt (labels -100), so micro-batches hold different numbers of labelled tokens; the
mean of per-micro-batch means then weighs a token by ``1 / (labelled tokens of its micro-batch)`` and differs from
one process training on the whole batch. Here one process (micro-batch 8) is the reference and gradient accumulation
(2 × 4), dp2, tp2 and dp2×pp2 must equal it in fp64 (losses and every parameter within ``FP64_REL``); negative
control: dp2 averaging the micro-batch means (the engine before the fix) differs by ≥ ``NEGATIVE_MIN``.
"""

from __future__ import annotations

import pytest

from tests.engine_helpers import gather_full, run_trainers, tiny_job
from tests.mp import run_distributed
from tests.tolerances import FP64_REL, NEGATIVE_MIN, rel_norm, worst_rel

STEPS = 4


def _job(root, parallel: dict) -> dict:
    return tiny_job(
        str(root),
        data={
            "seq_len": 12,
            "synthetic": {"task": "subtraction", "instructions": True, "num_train": 512, "num_eval": 16, "seed": 3},
        },
        parallel={"micro_batch_size": 8, **parallel},
        train={"steps": STEPS, "warmup_steps": 0, "dtype": "fp64"},
    )


LAYOUTS = {
    "accum2": (1, {"micro_batch_size": 4, "gradient_accumulation_steps": 2}),
    "dp2": (2, {"data_parallel_size": 2, "micro_batch_size": 4}),
    "tp2": (2, {"tensor_parallel_size": 2}),
    "dp2pp2": (
        4,
        {"data_parallel_size": 2, "pipeline_parallel_size": 2, "micro_batch_size": 2, "gradient_accumulation_steps": 2},
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("step_loss")
    out = {}
    for world in (1, 2, 4):
        names = (["one"] if world == 1 else []) + [n for n, (w, _) in LAYOUTS.items() if w == world]
        jobs = [{"cfg": _job(tmp / n, LAYOUTS[n][1] if n in LAYOUTS else {})} for n in names]
        if world == 2:
            names.append("control")
            jobs.append({"cfg": _job(tmp / "control", LAYOUTS["dp2"][1]), "sabotage": "mean_of_micro_batch_means"})
        per_rank = run_distributed(run_trainers, world, args=(jobs,), timeout=300)
        for j, name in enumerate(names):
            out[name] = [per_rank[r][j] for r in range(world)]
    out["one"] = out["one"][0]
    return out


def test_the_data_gives_micro_batches_unequal_labelled_tokens(runs):
    counts = [int((b["labels"] != -100).sum()) for b in runs["accum2"][0]["first_step"]]
    assert len(set(counts)) > 1, counts  # otherwise the mean of means would equal the token mean: no test


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_weighs_each_labelled_token_as_one_process(runs, layout):
    ref = runs["one"]
    results = runs[layout]
    last = [r for r in results if r["losses"]][-1]
    assert rel_norm(last["losses"], ref["losses"]) <= FP64_REL, (last["losses"], ref["losses"])
    name, worst = worst_rel(gather_full(results), gather_full([ref]))
    assert worst <= FP64_REL, (name, worst)


def test_negative_control_mean_of_micro_batch_means_differs(runs):
    ref = runs["one"]
    control = runs["control"][0]
    assert rel_norm(control["losses"], ref["losses"]) >= NEGATIVE_MIN, (control["losses"], ref["losses"])
