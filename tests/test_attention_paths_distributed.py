"""Attention without a dense mask under tensor and pipeline parallelism (issue 29, item 3).

Two Gloo processes run the engine in float64 at tp2 and at pp2, packed documents (``data.packing: documents``) and
plain concatenated sequences, with the model's attention (the job's path: rows of 32 tokens take one masked call,
``short_rows_mask``), with the per-document path longer rows take (causal SDPA per document, forced at this length:
the ``per_document_attention`` job), both without repeated K/V (``enable_gqa``), and with the reference they replaced (repeated K/V and a dense document mask: the ``dense_attention`` job of
tests/engine_helpers.py). Losses over three steps and the first step's reduced gradients agree within ``FP64_REL``
(tests/tolerances.py: the same sums, blocked differently; gradients by relative norm). Negative control: the packed tp2 job with the first
document boundary of every row ignored differs by at least ``NEGATIVE_MIN``. Each job reports its attention path.
Last, compiled layers (``train.compile``) keep their graphs across batches with new document boundaries.
"""

from __future__ import annotations

import pytest

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
            for path in ("new", "dense", "per_document")[: 3 if packing == "documents" else 2]:
                name = f"{layout}_{packing}_{path}"
                sabotage = {"dense": "dense_attention", "per_document": "per_document_attention"}.get(path)
                jobs.append(_job(tmp_path, name, packing, sabotage, **parallel))
                keys.append((layout, packing, path))
    jobs.append(_job(tmp_path, "tp2_broken", "documents", "first_document_boundary_ignored", **layouts["tp2"]))
    ranks = run_distributed(run_trainers, 2, args=(jobs,))
    for rank_results in ranks:
        by_key = dict(zip(keys, rank_results, strict=False))
        for layout in layouts:
            for packing in ("documents", "concat"):
                dense = by_key[(layout, packing, "dense")]
                new = by_key[(layout, packing, "new")]
                assert new["attention_path"] == ("short_rows_mask" if packing == "documents" else "sdpa_causal")
                for path in ("new", "per_document") if packing == "documents" else ("new",):
                    ours = by_key[(layout, packing, path)]
                    assert max_rel_diff(ours["losses"], dense["losses"]) <= FP64_REL, (layout, packing, path)
                    assert ours["first_grads"], (layout, packing, path)
                    name, rel = worst_rel(ours["first_grads"], dense["first_grads"])
                    assert rel <= FP64_REL, (layout, packing, path, name, rel)
        broken = rank_results[-1]["losses"]
        assert max_rel_diff(broken, by_key[("tp2", "documents", "dense")]["losses"]) >= NEGATIVE_MIN


@pytest.mark.parametrize("short_row_tokens", [0, 128], ids=["sdpa_documents", "short_rows_mask"])
def test_compiled_layers_do_not_recompile_for_new_document_boundaries(monkeypatch, short_row_tokens):
    """``train.compile``: the per-document attention runs outside the graph, so batches with new document boundaries
    reuse the compiled graphs (dynamo's ``eager`` backend: the same tracing and guards as inductor, without its
    compile time) and give the eager layer's output. Without ``keep_documents_out_of_graphs`` the spans become graph
    constants and every new set of boundaries compiles again (one more graph per batch, then the eager fallback).
    The short rows' masked call is traced whole: its mask is computed from the segment ids in the graph."""
    import random

    import torch
    from torch._dynamo.utils import counters

    from kuangchao_core.models import attention
    from kuangchao_core.models.attention import Documents
    from kuangchao_core.models.llama import LlamaForCausalLM
    from tests.fixtures import tiny_llama

    monkeypatch.setattr(attention, "SHORT_ROW_TOKENS", short_row_tokens)
    attention.keep_documents_out_of_graphs()  # as compile_layers does before it compiles

    torch._dynamo.reset()
    counters.clear()
    model = LlamaForCausalLM(tiny_llama(hidden_size=32, intermediate_size=64, max_seq_len=64))
    model.init_weights(0)
    layer = model.model.layers[0]
    compiled = torch.compile(layer, backend="eager")
    h = torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(0))
    cos, sin = model.rotary(32, h.device, h.dtype)
    rng = random.Random(0)

    def graphs_per_batch(compiled, batches: int) -> list[int]:
        graphs = []
        for _ in range(batches):
            seg = torch.zeros(2, 32, dtype=torch.long)
            for cut in rng.sample(range(1, 32), 3):
                seg[:, cut:] += 1
            docs = Documents.from_segment_ids(seg)
            assert torch.allclose(compiled(h, cos, sin, docs), layer(h, cos, sin, docs), rtol=0, atol=1e-6)
            graphs.append(counters["stats"]["unique_graphs"])
        return graphs

    graphs = graphs_per_batch(compiled, 8)
    assert graphs[1] == graphs[-1], graphs  # nothing compiled after the second batch
    if short_row_tokens == 0:  # negative control: the loop traced into the graph compiles again for new boundaries
        monkeypatch.setattr(attention, "_per_document_call", attention._per_document)
        torch._dynamo.reset()
        counters.clear()
        traced = graphs_per_batch(torch.compile(layer, backend="eager"), 3)
        assert traced[2] > traced[1], traced
    torch._dynamo.reset()
