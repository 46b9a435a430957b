"""Attention without a dense mask (issue 29, item 3): the paths of ``kuangchao_core.models.attention``.

The reference is the attention the model had before: K/V repeated with ``repeat_interleave`` for grouped-query
attention, and a dense (batch, 1, s, s) document mask for packed documents (``tests.engine_helpers.dense_reference_attention``). In float64 the
new paths (one causal SDPA per document, ``sdpa_documents``; one masked call for rows of at most
``SHORT_ROW_TOKENS``, ``short_rows_mask``; both ``enable_gqa``) equal it to rounding (``FP64_REL`` of tests/tolerances.py:
both compute the same softmax sums, blocked differently), for logits and every parameter's gradient, packed and
unpacked. Negative controls: one document boundary ignored, and K/V heads grouped the wrong way, each differ by at
least ``NEGATIVE_MIN``. Memory: the attention's peak allocated bytes for packed documents of a fixed length grow
linearly with the sequence (8x tokens: < 12x bytes), where the dense mask's grow with s² (> 32x). The tp2 and pp2
equivalences run the engine in tests/test_attention_paths_distributed.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kuangchao_core.hal.heap import peak_tensor_bytes
from kuangchao_core.models import attention, llama
from kuangchao_core.models.attention import SHORT_ROW_TOKENS, Documents, attend, attention_path, job_attention_path
from kuangchao_core.models.llama import LlamaForCausalLM, causal_lm_loss
from tests.attention_helpers import dense_reference_attention as dense_reference
from tests.fixtures import tiny_llama
from tests.tolerances import FP64_REL, NEGATIVE_MIN


def _segments(lengths_per_row: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths_per_row])


def _qkv(b: int, s: int, heads: int = 4, kv_heads: int = 2, d: int = 16, seed: int = 0, grad: bool = False):
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(b, n, s, d, generator=gen, dtype=torch.float64) for n in (heads, kv_heads, kv_heads)]
    return [t.requires_grad_(grad) for t in out]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_documents_find_boundaries_and_contiguity():
    docs = Documents.from_segment_ids(_segments([[3, 5, 1], [9]]))
    assert docs.spans == (((0, 3), (3, 8), (8, 9)), ((0, 9),))
    assert docs.contiguous and attention_path(docs) == "short_rows_mask"
    long_rows = Documents.from_segment_ids(_segments([[100, SHORT_ROW_TOKENS + 1 - 100]]))
    assert attention_path(long_rows) == "sdpa_documents"
    back = Documents.from_segment_ids(torch.tensor([[0, 0, 1, 1, 0, 0]]))  # document 0 again after document 1
    assert not back.contiguous and attention_path(back) == "dense_mask"
    assert attention_path(None) == "sdpa_causal"
    assert job_attention_path(True, SHORT_ROW_TOKENS) == "short_rows_mask"
    assert job_attention_path(True, SHORT_ROW_TOKENS + 1) == "sdpa_documents"
    assert job_attention_path(False, 64) == "sdpa_causal"


@pytest.mark.parametrize(
    "rows",
    [
        [[5, 11, 3, 13]] * 2,  # the same boundaries in every row: one batched call per document
        [[5, 11, 3, 13], [32], [1, 30, 1]],  # different boundaries per row (rows grouped, order restored)
    ],
)
@pytest.mark.parametrize("short_row_tokens", [0, SHORT_ROW_TOKENS], ids=["sdpa_documents", "short_rows_mask"])
def test_packed_paths_equal_the_dense_mask_in_fp64(monkeypatch, rows, short_row_tokens):
    monkeypatch.setattr(attention, "SHORT_ROW_TOKENS", short_row_tokens)
    seg = _segments(rows)
    q, k, v = _qkv(seg.shape[0], seg.shape[1], grad=True)
    docs = Documents.from_segment_ids(seg)
    weight = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    outs, grads = [], []
    for fn in (attend, dense_reference):
        out = fn(q, k, v, docs)
        (g,) = [torch.autograd.grad((out * weight).sum(), (q, k, v))]
        outs.append(out.detach())
        grads.append(g)
    assert _rel(outs[0], outs[1]) <= FP64_REL
    for new, ref in zip(grads[0], grads[1], strict=True):
        assert _rel(new, ref) <= FP64_REL
    # the dense fallback (non-contiguous ids) is the same computation without repeated K/V
    dense = attend(q, k, v, dataclasses.replace(docs, contiguous=False)).detach()
    assert _rel(dense, outs[1]) <= FP64_REL
    # negative control: one document boundary ignored (the first two documents of row 0 merged)
    merged = seg.clone()
    merged[0][merged[0] == 1] = 0
    wrong = attend(q, k, v, Documents.from_segment_ids(merged)).detach()
    assert _rel(wrong, outs[1]) >= NEGATIVE_MIN


def test_unpacked_gqa_equals_repeated_kv_and_a_wrong_grouping_differs():
    q, k, v = _qkv(2, 24)
    ref = dense_reference(q, k, v)
    assert _rel(attend(q, k, v), ref) <= FP64_REL
    # negative control: K/V heads tiled (head h sees kv head h % kv) instead of grouped (h // groups)
    tiled = F.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), is_causal=True)
    assert _rel(tiled, ref) >= NEGATIVE_MIN


def _model_logits_and_grads(model, ids, segment_ids, positions):
    model.zero_grad()
    logits = model(ids, position_ids=positions, segment_ids=segment_ids)
    causal_lm_loss(logits, torch.roll(ids, -1, dims=1)).backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("short_row_tokens", [0, SHORT_ROW_TOKENS], ids=["sdpa_documents", "short_rows_mask"])
@pytest.mark.parametrize("packed", [True, False])
def test_the_model_equals_its_dense_mask_self_in_fp64(monkeypatch, packed, short_row_tokens):
    """The whole model (GQA: 4 query heads, 2 K/V heads), logits and every parameter's gradient."""
    monkeypatch.setattr(attention, "SHORT_ROW_TOKENS", short_row_tokens)
    model = LlamaForCausalLM(tiny_llama(hidden_size=32, intermediate_size=64, max_seq_len=64))
    model.init_weights(0)
    model.double()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    seg = _segments([[7, 20, 13], [25, 15]]) if packed else None
    pos = None
    if packed:
        starts = torch.cat([torch.zeros(2, 1, dtype=torch.bool), seg[:, 1:] != seg[:, :-1]], dim=1)
        pos = torch.arange(40).expand(2, 40) - torch.cummax(torch.where(starts, torch.arange(40), 0), dim=1).values
    new_logits, new_grads = _model_logits_and_grads(model, ids, seg, pos)
    monkeypatch.setattr(llama, "attend", dense_reference)
    ref_logits, ref_grads = _model_logits_and_grads(model, ids, seg, pos)
    assert _rel(new_logits, ref_logits) <= FP64_REL
    assert max(_rel(new_grads[n], ref_grads[n]) for n in ref_grads) <= FP64_REL
    if packed:  # negative control: the model run without the documents' segments
        monkeypatch.undo()
        blind, _ = _model_logits_and_grads(model, ids, None, pos)
        assert _rel(blind, ref_logits) >= NEGATIVE_MIN


def _attention_peak(fn, s: int, doc_len: int = 64) -> int:
    seg = _segments([[doc_len] * (s // doc_len)])
    q, k, v = _qkv(1, s, heads=2, kv_heads=1, d=8, grad=True)  # narrow heads: the O(s) tensors stay small
    docs = Documents.from_segment_ids(seg)

    def step():
        out = fn(q, k, v, docs)
        return torch.autograd.grad(out.sum(), (q, k, v))

    peak, _ = peak_tensor_bytes(step)
    return peak


def test_packed_attention_memory_grows_linearly_not_with_s_squared():
    """Forward and backward of packed documents of 64 tokens at s = 256 and 2048 (8x): the job's path's peak bytes
    (outputs, gradients and per-document kernel state: O(s)) grow < 12x, between linear (8x) and the geometric
    midpoint of linear and quadratic (22.6x); the dense mask's (O(s²) mask and scores) grow > 32x (s² alone: 64x)."""
    new = [_attention_peak(attend, s) for s in (256, 2048)]
    dense = [_attention_peak(dense_reference, s) for s in (256, 2048)]
    assert new[1] / new[0] < 12.0, new
    assert dense[1] / dense[0] > 32.0, dense  # negative control: the measurement sees s² where it exists
    assert new[1] < dense[1] / 8, (new, dense)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_packed_attention_exactly(mode):
    """``train.activation_checkpointing`` re-runs each layer with the same documents: gradients equal the
    un-checkpointed model's bitwise (the same kernels on the same inputs)."""
    model = LlamaForCausalLM(tiny_llama(hidden_size=32, intermediate_size=64, max_seq_len=64))
    model.init_weights(0)
    model.double()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    seg = _segments([[7, 20, 13], [25, 15]])
    _, plain = _model_logits_and_grads(model, ids, seg, None)
    model.activation_checkpointing = mode
    _, recomputed = _model_logits_and_grads(model, ids, seg, None)
    assert all(torch.equal(recomputed[n], plain[n]) for n in plain)


def test_a_worker_that_does_not_compile_never_imports_dynamo():
    """Importing dynamo costs every worker process seconds; only ``train.compile`` needs it (``compile_layers``
    makes the per-document loop eager then)."""
    import subprocess
    import sys

    probe = (
        "import sys, kuangchao_core.engine.worker, kuangchao_core.engine.trainer; print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
