"""`kc plan` and check_plan: the layout explained before launch, and every bad plan refused with its numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kuangchao.cli.main import app
from kuangchao_core.config import load_config
from kuangchao_core.engine.plan import check_plan, explain_plan, raise_for_plan
from kuangchao_core.errors import PlanError
from kuangchao_core.models.llama import config_from_model_section

TINY = str(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml")
RUN = CliRunner()


def _sets(**kw) -> list[str]:
    out: list[str] = []
    for k, v in kw.items():
        out += ["--set", f"{k.replace('__', '.')}={v}"]
    return out


def _plan(**kw):
    return RUN.invoke(app, ["plan", "--config", TINY, *_sets(**kw)])


LAYOUT_3D = dict(
    parallel__data_parallel_size=2,
    parallel__tensor_parallel_size=2,
    parallel__pipeline_parallel_size=2,
    parallel__virtual_pipeline_size=2,
    parallel__pipeline_schedule="interleaved_1f1b",
    parallel__gradient_accumulation_steps=4,
    parallel__zero_stage=1,
    model__num_layers=4,
    cluster__nproc_per_node=8,
)


def test_plan_json_3d_layout():
    res = RUN.invoke(app, ["plan", "--config", TINY, "--json", *_sets(**LAYOUT_3D)])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    assert plan["sizes"]["world_size"] == 8
    # rank = dp*(pp*tp) + pp*tp_size + tp: TP consecutive, then PP, then DP
    assert list(plan["groups"]["tp_groups"].values()) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert list(plan["groups"]["pp_groups"].values()) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert list(plan["groups"]["dp_groups"].values()) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # 4 layers over p*v = 4 virtual stages; chunk c of rank r is virtual stage c*p + r
    layers = {(s["pp_rank"], c["chunk"]): c["layers"] for s in plan["stages"] for c in s["chunks"]}
    assert layers == {(0, 0): [0], (1, 0): [1], (0, 1): [2], (1, 1): [3]}
    assert plan["bubble_fraction"] == pytest.approx((2 - 1) / (2 * 4 + 2 - 1))
    assert plan["batch"]["global_batch_size"] == 8 * 4 * 2  # the demo's micro-batch 8, m = 4, dp = 2
    # ZeRO-1: optimizer bytes = 8 Psi / N with Psi the elements this rank holds after TP and PP
    mcfg = config_from_model_section(load_config(TINY, _sets(**LAYOUT_3D)[1::2]).model)
    total = sum(r["parameters"] for r in plan["ranks"] if r["coords"]["dp"] == 0)
    replicated_norms = (mcfg.num_layers * 2 + 1) * mcfg.hidden_size  # held by both TP ranks of their stage
    assert total == mcfg.num_params() + replicated_norms
    for r in plan["ranks"]:
        mem = r["memory_bytes"]
        assert mem["optimizer"] == pytest.approx(8 * r["parameters"] / 2, abs=1)
        assert mem["params"] == 4 * r["parameters"] and mem["grads"] == 4 * r["parameters"]


def test_plan_text_and_interleaved_bubble():
    res = _plan(
        parallel__pipeline_parallel_size=2, parallel__data_parallel_size=1, parallel__gradient_accumulation_steps=6
    )
    assert res.exit_code == 0, res.output
    assert "pipeline rank 0: chunk 0 (virtual stage 0): layers 0-0 embedding" in res.output
    assert "pipeline rank 1: chunk 0 (virtual stage 1): layers 1-1 norm+head" in res.output
    assert f"expected bubble {1 / 7:.3f} = (p-1)/(m+p-1) = (2-1)/(6+2-1)" in res.output


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            dict(parallel__tensor_parallel_size=3, parallel__data_parallel_size=1, cluster__nproc_per_node=3),
            "num_heads 4 is not divisible by tensor_parallel_size 3",
        ),
        (
            dict(
                parallel__tensor_parallel_size=4,
                parallel__data_parallel_size=1,
                cluster__nproc_per_node=4,
                model__vocab_size=258,
            ),
            "model.vocab_size 258 is not divisible by tensor_parallel_size 4",
        ),
        (
            dict(
                parallel__pipeline_parallel_size=2,
                parallel__data_parallel_size=1,
                model__num_layers=3,
                parallel__gradient_accumulation_steps=2,
            ),
            "num_layers 3 is not divisible by pipeline_parallel_size × virtual_pipeline_size = 2×1 = 2",
        ),
        (dict(parallel__pipeline_parallel_size=2, parallel__data_parallel_size=1), "m=1 < p=2"),
        (
            dict(
                parallel__pipeline_parallel_size=2,
                parallel__data_parallel_size=1,
                model__num_layers=4,
                parallel__virtual_pipeline_size=2,
                parallel__pipeline_schedule="interleaved_1f1b",
                parallel__gradient_accumulation_steps=3,
            ),
            "gradient_accumulation_steps 3) to be a multiple of pipeline_parallel_size 2",
        ),
        (dict(cluster__nproc_per_node=3), "2×1×1 = 2, but cluster.nproc_per_node is 3"),
    ],
)
def test_bad_plans_refused_with_numbers(overrides, expected):
    res = _plan(**overrides)
    assert res.exit_code == 2, res.output
    assert expected in res.output
    assert "nothing was started" in res.output


def test_check_plan_direct():
    cfg = load_config(TINY, ["parallel.pipeline_parallel_size=2", "parallel.data_parallel_size=1"])
    errors = check_plan(cfg)
    assert [p for p, _ in errors] == ["parallel.gradient_accumulation_steps"]
    assert "m=1 < p=2" in errors[0][1]
    ok = load_config(TINY)
    assert check_plan(ok) == []
    bad_world = check_plan(ok, world_size=3)
    assert any("= 2 processes, but the world size is 3" in m for _, m in bad_world)
    with pytest.raises(PlanError, match="world size is 3"):
        raise_for_plan(ok, world_size=3)
    plan = explain_plan(ok)
    assert plan["bubble_fraction"] == 0.0 and plan["schedule"] is None
