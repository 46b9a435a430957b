"""The attention core: causal grouped-query attention over plain or packed-document sequences, without a dense mask.

Three paths (:data:`PATHS`), chosen by :func:`attend`:

- ``sdpa_causal``: no packed documents. One ``scaled_dot_product_attention`` call with ``is_causal=True`` and no
  mask tensor at all (a fused kernel on every device: FlashAttention/cuDNN on GPU, the tiled
  ``_scaled_dot_product_flash_attention_for_cpu`` on CPU, fp64 included).
- ``sdpa_documents``: packed documents (``data.packing: documents``) whose segments are contiguous runs, which is
  what the packer produces. The mask state is the documents' boundaries (:class:`Documents`: O(s) per row, read
  to the host once per forward and shared by every layer); each document is one causal SDPA call on its slice of
  the sequence, so no (s, s) tensor exists and the same fused kernels run per document. Rows with the same
  boundaries run batched; the outputs are concatenated back in place. Under ``train.compile`` this loop runs
  outside the compiled graph (traced, the boundaries would be graph constants: a recompilation per batch;
  :func:`keep_documents_out_of_graphs`).
- ``short_rows_mask``: packed documents in rows of at most :data:`SHORT_ROW_TOKENS` tokens. One SDPA call with the
  rows' (s, s) document mask: at most 16 KiB of mask per row, whatever the model's sequence length elsewhere, and
  1.9-5.5x faster there than one call per document (the demo's rows of 64 tokens hold ~6 problems each; measured
  below).
- ``dense_mask``: the (batch, 1, s, s) boolean mask of :func:`document_mask`, kept only for segment ids that are not
  contiguous runs (a document id that reappears after another document), which no fused causal call can express.

Grouped-query attention never repeats K/V: every path passes ``enable_gqa=True`` (supported on CPU, in fp64, by the
torch this project pins), so K/V keep their ``num_kv_heads`` heads.

Why per-document SDPA and not FlexAttention or ``varlen_attn`` (measured on this CPU, torch 2.13, b=2, 4 query and
2 K/V heads of 16, documents of 16..s/3 tokens, forward+backward, one thread; ``benchmarks/attention_packed.py``
measures the chosen path against the dense mask in the engine's layer):

- ``torch.nn.attention.flex_attention`` with a document causal block mask computes the right numbers in fp64
  (8.9e-16 from the dense path) but has no backward on CPU ("FlexAttention does not support backward on CPU"), and
  uncompiled it materialises the full score matrix and took 9.1 s (fp64) / 1.3 s (fp32) for a forward at s=512,
  block-mask construction included, against 71 ms / 28 ms for the dense mask. It needs ``torch.compile`` (Triton
  on GPU) to be fused, so it cannot be the path that trains here.
- ``torch.nn.attention.varlen.varlen_attn`` (cumulative sequence lengths) is FlashAttention only: CUDA, fp16/bf16;
  it cannot run in fp64 or on CPU, so it could not be checked against the dense path here.
- SDPA per document: 6.7e-16 from the dense path in fp64; forward+backward 51 ms vs 205 ms (s=512) and 404 ms vs
  4.1 s (s=2048) in fp64, 32 ms vs 57 ms and 249 ms vs 1.26 s in fp32; peak allocated bytes 2.5 MiB vs 8.0 MiB
  (s=512) and 10 MiB vs 80 MiB (s=2048) in fp64 — linear in s where the dense mask grows with s².
  Its cost is one kernel launch per document and row group, which matters for many very short documents: with
  documents of 8-14 tokens (the demo's rows of 64 tokens hold ~6 problems), b=8, fp32, forward+backward of the
  tiny preset's attention layer, one call per document took 5.5x the dense mask's time at s=64 (IQR 4.6-19),
  1.9x at s=128 and 1.6x at s=256 (``benchmarks/attention_packed.py --seqs 64 128 256 --batch 8 --doc-tokens 8 14
  --per-document``). Hence ``short_rows_mask`` up to 128 tokens, where the mask costs at most 16 KiB per row;
  beyond, the dense mask's bytes grow with s² and the per-document path is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: the attention paths, in the words the job reports (:func:`attention_path`)
PATHS = ("sdpa_causal", "sdpa_documents", "short_rows_mask", "dense_mask")
#: packed rows up to this many tokens take one masked call (``short_rows_mask``), longer ones one call per document
SHORT_ROW_TOKENS = 128


def document_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) boolean attention mask: causal, and only within the same segment (document)."""
    s = segment_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal).unsqueeze(1)


@dataclass(frozen=True, eq=False)
class Documents:
    """Packed documents of a batch: ``segment_ids`` (batch, seq) and, per row, the ``(start, end)`` token span of
    each document (O(seq) host state). ``contiguous``: every document is one run of tokens (no id reappears after
    another), so :func:`attend` can run each span on its own."""

    segment_ids: torch.Tensor
    spans: tuple[tuple[tuple[int, int], ...], ...]
    contiguous: bool

    @classmethod
    def from_segment_ids(cls, segment_ids: torch.Tensor) -> Documents:
        """Find each row's document boundaries (one device-to-host copy of the change points and run ids)."""
        if segment_ids.dim() != 2:
            raise ValueError(f"segment_ids must be (batch, seq), got shape {tuple(segment_ids.shape)}")
        b, s = segment_ids.shape
        change = torch.ones(b, s, dtype=torch.bool, device=segment_ids.device)
        change[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
        rows, starts = change.nonzero(as_tuple=True)
        run_ids = segment_ids[rows, starts]
        rows_l, starts_l, ids_l = rows.tolist(), starts.tolist(), run_ids.tolist()
        per_row: list[list[int]] = [[] for _ in range(b)]
        ids_per_row: list[list[int]] = [[] for _ in range(b)]
        for r, st, i in zip(rows_l, starts_l, ids_l, strict=True):
            per_row[r].append(st)
            ids_per_row[r].append(i)
        spans = tuple(tuple(zip(st, [*st[1:], s], strict=True)) for st in per_row)
        contiguous = all(len(set(ids)) == len(ids) for ids in ids_per_row)
        return cls(segment_ids, spans, contiguous)


def attention_path(documents: Documents | None) -> str:
    """Which of :data:`PATHS` :func:`attend` takes for ``documents`` (None: no packed documents)."""
    if documents is None:
        return "sdpa_causal"
    if not documents.contiguous:
        return "dense_mask"
    return "short_rows_mask" if documents.segment_ids.shape[-1] <= SHORT_ROW_TOKENS else "sdpa_documents"


def _per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents) -> torch.Tensor:
    groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for row, spans in enumerate(documents.spans):
        groups.setdefault(spans, []).append(row)
    outs, order = [], []
    for spans, rows in groups.items():
        if len(groups) == 1:
            qr, kr, vr = q, k, v
        else:
            index = torch.tensor(rows, device=q.device)
            qr, kr, vr = q.index_select(0, index), k.index_select(0, index), v.index_select(0, index)
        parts = [
            F.scaled_dot_product_attention(
                qr[:, :, lo:hi], kr[:, :, lo:hi], vr[:, :, lo:hi], is_causal=True, enable_gqa=True
            )
            for lo, hi in spans
        ]
        outs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
        order.extend(rows)
    if len(outs) == 1:
        return outs[0]
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return torch.cat(outs, dim=0).index_select(0, inverse.to(q.device))


#: what :func:`attend` calls for ``sdpa_documents`` (:func:`keep_documents_out_of_graphs` swaps in the eager one)
_per_document_call = _per_document


def keep_documents_out_of_graphs() -> None:
    """Make the per-document loop run eagerly inside compiled code (:func:`torch.compiler.disable`): traced, the
    spans would be constants of the graph, a recompilation for every new set of document boundaries. Call it before
    ``torch.compile`` of the layers (``models.compile.compile_layers`` does); kept out of import time because
    ``torch.compiler.disable`` imports dynamo (seconds in every worker process that never compiles)."""
    global _per_document_call
    if _per_document_call is _per_document:
        _per_document_call = torch.compiler.disable(_per_document)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """Causal attention within documents through the dense :func:`document_mask` (the ``dense_mask`` path)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(segment_ids), enable_gqa=True)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
    """Causal grouped-query attention: ``q`` (batch, heads, seq, head_dim), ``k``/``v`` (batch, kv_heads, seq,
    head_dim) with ``heads`` a multiple of ``kv_heads``; ``documents`` None for one sequence per row, else the packed
    documents (attention stays inside each). Returns (batch, heads, seq, head_dim) by the path
    :func:`attention_path` names."""
    path = attention_path(documents)
    if path == "sdpa_causal":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if path == "sdpa_documents":
        return _per_document_call(q, k, v, documents)
    return dense_attention(q, k, v, documents.segment_ids)  # short_rows_mask and dense_mask


def job_attention_path(packed_documents: bool, seq_len: int) -> str:
    """The path a job's batches of ``seq_len`` tokens take: with ``data.packing: documents`` (the packer's segments
    are contiguous runs) ``short_rows_mask`` up to :data:`SHORT_ROW_TOKENS` tokens, else ``sdpa_documents``;
    ``sdpa_causal`` without packed documents."""
    if not packed_documents:
        return "sdpa_causal"
    return "short_rows_mask" if seq_len <= SHORT_ROW_TOKENS else "sdpa_documents"
