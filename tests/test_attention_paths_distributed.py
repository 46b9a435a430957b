"""Attention without a dense mask under tensor and pipeline parallelism (issue 29, item 3).

Two Gloo processes run the engine in float64 at tp2 and at pp2, packed documents (``data.packing: documents``) and
plain concatenated sequences, once with the model's attention (per-document causal SDPA, ``enable_gqa``) and once
with the reference it replaced (repeated K/V and a dense document mask: the ``dense_attention`` job of
tests/engine_helpers.py). Losses over three steps and the first step's reduced gradients agree within ``FP64_REL``
(tests/tolerances.py: the same sums, blocked differently; gradients by relative norm). Negative control: the packed tp2 job with the first
document boundary of every row ignored differs by at least ``NEGATIVE_MIN``. Each job reports its attention path.
"""

from __future__ import annotations

from tests.engine_helpers import run_trainers, tiny_job
from tests.mp import run_distributed
from tests.tolerances import FP64_REL, NEGATIVE_MIN, max_rel_diff, worst_rel


def _job(tmp_path, name: str, packing: str, sabotage: str | None = None, **parallel):
    return {
        "cfg": tiny_job(
            str(tmp_path / name),
            data={"seq_len": 32, "packing": packing},
            parallel={"micro_batch_size": 2, "gradient_accumulation_steps": 2, **parallel},
            train={"steps": 3, "dtype": "fp64"},
        ),
        "sabotage": sabotage,
    }


def test_tp2_and_pp2_attention_equals_the_dense_mask_in_fp64(tmp_path):
    layouts = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}
    jobs, keys = [], []
    for layout, parallel in layouts.items():
        for packing in ("documents", "concat"):
            for path in ("new", "dense"):
                name = f"{layout}_{packing}_{path}"
                jobs.append(_job(tmp_path, name, packing, "dense_attention" if path == "dense" else None, **parallel))
                keys.append((layout, packing, path))
    jobs.append(_job(tmp_path, "tp2_broken", "documents", "first_document_boundary_ignored", **layouts["tp2"]))
    ranks = run_distributed(run_trainers, 2, args=(jobs,))
    for rank_results in ranks:
        by_key = dict(zip(keys, rank_results, strict=False))
        for layout in layouts:
            for packing in ("documents", "concat"):
                new, dense = by_key[(layout, packing, "new")], by_key[(layout, packing, "dense")]
                assert new["attention_path"] == ("sdpa_documents" if packing == "documents" else "sdpa_causal")
                assert max_rel_diff(new["losses"], dense["losses"]) <= FP64_REL, (layout, packing)
                assert new["first_grads"], (layout, packing)
                name, rel = worst_rel(new["first_grads"], dense["first_grads"])
                assert rel <= FP64_REL, (layout, packing, name, rel)
        broken = rank_results[-1]["losses"]
        assert max_rel_diff(broken, by_key[("tp2", "documents", "dense")]["losses"]) >= NEGATIVE_MIN
