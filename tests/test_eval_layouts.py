"""The whole held-out split in every layout (issue 39 item 1): the engine's held-out loss of the same model at dp2,
ZeRO-3 dp2, tp2, pp2 and cp2 equals the token-weighted mean over every held-out window computed in one forward in
this process (fp64), with the same windows and labelled tokens counted (and the bytes they spell, issue 39 item 5,
reduced with the loss); the split is longer than the old cap (the
first 8 micro-batches), so the full-split number differs from the capped one. Control: the DP reduction of the
evaluation skipped (each rank reports its own share) misses the reference.
"""

from __future__ import annotations

import pytest
import torch

from kuangchao_core.data import build_dataset
from kuangchao_core.engine.evaluation import EVAL_MICRO_BATCHES
from kuangchao_core.models.llama import IGNORE_INDEX, LlamaForCausalLM, causal_lm_loss, config_from_model_section
from kuangchao_core.perm import guard_api
from tests.engine_helpers import tiny_job
from tests.mp import run_distributed
from tests.tolerances import FP64_REL

SEQ, MICRO = 16, 2
LAYOUTS = {
    "dp2": {"data_parallel_size": 2},
    "zero3_dp2": {"data_parallel_size": 2, "zero_stage": 3},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2},
    "cp2": {"context_parallel_size": 2},
}


def _job(tmp, name, parallel):
    held_out = tmp / "held_out.txt"
    if not held_out.exists():
        held_out.write_text("\n\n".join(f"held-out line {i}: words to predict, {i * 7 % 13}" for i in range(60)))
    return tiny_job(
        str(tmp / name),
        data={"format": "txt", "path": str(held_out), "eval_path": str(held_out), "seq_len": SEQ},
        parallel={"micro_batch_size": MICRO, **parallel},
        train={"dtype": "fp64", "steps": 1},
    )


def _held_out_losses(rank: int, world_size: int, jobs: list):
    """Each job's held-out loss of its freshly built model (every layout builds the same weights from the seed),
    the windows and tokens it covered; ``unreduced``: the evaluation's DP/PP sums skipped (the control)."""
    from kuangchao_core.comm import init_distributed, world_group
    from kuangchao_core.config.settings import run_settings
    from kuangchao_core.engine import evaluation
    from kuangchao_core.engine.trainer import Trainer
    from kuangchao_core.parallel.mesh import ParallelMesh

    guard_api.install_guard(guard_api.AllowAll())
    init_distributed(backend="gloo", timeout_ms=120_000)
    out = []
    for cfg, unreduced in jobs:
        mesh = ParallelMesh.from_config(cfg.parallel, rank, world_size)
        trainer = Trainer(run_settings(cfg), rank, world_size, torch.device("cpu"), world_group(), mesh)
        reduce = evaluation.P.all_reduce
        if unreduced:
            evaluation.P.all_reduce = lambda *a, **k: None
        try:
            loss = trainer.evaluator()
        finally:
            evaluation.P.all_reduce = reduce
        params = {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters()} if world_size == 1 else {}
        ev = trainer.evaluator
        out.append({"loss": loss, "tokens": ev.tokens, "windows": ev.windows, "params": params, "text": ev.text_bytes})
        trainer.barrier()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval_layouts")
    one = run_distributed(_held_out_losses, 1, args=([(_job(tmp, "one", {}), False)],), timeout=300)[0][0]
    jobs = [(_job(tmp, name, parallel), False) for name, parallel in LAYOUTS.items()]
    jobs.append((_job(tmp, "dp2_unreduced", LAYOUTS["dp2"]), True))
    two = run_distributed(_held_out_losses, 2, args=(jobs,), timeout=400)
    by_name = {name: [r[i] for r in two] for i, name in enumerate([*LAYOUTS, "dp2_unreduced"])}
    return {"one": one, **by_name, "cfg": _job(tmp, "one", {})}


def _direct(runs, windows: int) -> tuple[float, int]:
    cfg = runs["cfg"]
    model = LlamaForCausalLM(config_from_model_section(cfg.model)).double()
    model.load_state_dict({n: torch.from_numpy(v) for n, v in runs["one"]["params"].items()})
    with guard_api.thread_guard(guard_api.AllowAll()):
        ds = build_dataset(cfg.data, 256, split="eval")
    ids = torch.stack([ds[i]["input_ids"] for i in range(windows)])
    labels = torch.stack([ds[i]["labels"] for i in range(windows)])
    with torch.no_grad():
        total = causal_lm_loss(model(ids), labels, reduction="sum")
    count = int((labels != IGNORE_INDEX).sum())
    return float(total) / count, count


def test_one_process_covers_every_window(runs):
    one = runs["one"]
    assert one["windows"] > EVAL_MICRO_BATCHES * MICRO, "longer than the old cap, so covering it all shows"
    want, tokens = _direct(runs, one["windows"])
    assert one["tokens"] == tokens and abs(one["loss"] - want) <= FP64_REL * want
    capped, _ = _direct(runs, EVAL_MICRO_BATCHES * MICRO)
    assert abs(capped - want) > 100 * FP64_REL * want, "the old cap's number is another one"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_evaluates_the_whole_split_like_one_process(runs, layout):
    want, tokens = _direct(runs, runs["one"]["windows"])
    for rank, res in enumerate(runs[layout]):
        assert res["windows"] == runs["one"]["windows"] and res["tokens"] == tokens, (layout, rank, res["tokens"])
        assert res["text"] == tokens, (layout, rank, res["text"])  # the byte tokenizer: one byte per labelled token
        assert abs(res["loss"] - want) <= FP64_REL * want, (layout, rank, res["loss"], want)


def test_control_an_unreduced_evaluation_misses_the_reference(runs):
    want, _ = _direct(runs, runs["one"]["windows"])
    assert all(abs(r["loss"] - want) > 100 * FP64_REL * want for r in runs["dp2_unreduced"])
