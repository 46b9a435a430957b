"""The attention path before issue 29 (dense document mask, repeated K/V) as the tests' reference, and the engine
sabotages that swap it in or lose a document boundary (``engine_helpers.SABOTAGES``)."""

from __future__ import annotations


def dense_reference_attention(q, k, v, documents=None):
    """The attention core as it was before issue 29: K/V repeated with ``repeat_interleave`` for grouped-query
    attention and, for packed documents, the dense (batch, 1, s, s) document mask."""
    import torch.nn.functional as F

    from kuangchao_core.models.attention import document_mask

    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(documents.segment_ids))


def dense_attention(trainer):
    """Not a control: the model attends through :func:`dense_reference_attention` (the reference path)."""
    from kuangchao_core.models import llama

    real = llama.attend
    llama.attend = dense_reference_attention

    def undo():
        llama.attend = real

    return undo


def first_document_boundary_ignored(trainer):
    """Packed documents: the first two documents of every row attend to each other (their boundary is lost)."""
    from kuangchao_core.models import llama

    real = llama.Documents

    class Merged(real):
        @classmethod
        def from_segment_ids(cls, segment_ids):
            return real.from_segment_ids(segment_ids.clamp(min=1))  # document 0 joins document 1

    llama.Documents = Merged

    def undo():
        llama.Documents = real

    return undo


def per_document_attention(trainer):
    """Not a control: rows of any length take the per-document path (``sdpa_documents``), which the short rows of
    these tests' jobs (at most ``SHORT_ROW_TOKENS`` tokens) would not."""
    from kuangchao_core.models import attention

    real = attention.SHORT_ROW_TOKENS
    attention.SHORT_ROW_TOKENS = 0

    def undo():
        attention.SHORT_ROW_TOKENS = real

    return undo
