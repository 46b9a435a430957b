"""Pipeline stages: which layers each (virtual) stage holds, and the forward function of each local chunk.

Layers are split evenly over ``p * v`` virtual stages; virtual stage ``s`` holds global layers
``[s * L / (p v), (s + 1) * L / (p v))``; chunk ``c`` of pipeline rank ``r`` is virtual stage ``c * p + r``.
The embedding runs on virtual stage 0 (rank 0, chunk 0); final norm, head and loss on the last virtual stage
(rank ``p - 1``, chunk ``v - 1``).

A chunk wraps an already built model (whose projections may be tensor-parallel layers); it never builds layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kuangchao_core.errors import PlanError
from kuangchao_core.parallel.pp_schedules import stage_of


@dataclass(frozen=True)
class ChunkSpec:
    """Where one model chunk sits: pipeline rank, chunk index, virtual stage, global layer range, ends."""

    pp_rank: int
    chunk: int
    stage: int
    start: int
    end: int
    has_embedding: bool
    has_head: bool


def partition_layers(num_layers: int, pp: int, virtual: int = 1) -> list[list[ChunkSpec]]:
    """The chunks of every pipeline rank: ``result[r][c]`` is chunk ``c`` of rank ``r``.

    Raises ``PlanError`` with the numbers when ``num_layers`` is not divisible by ``pp * virtual``.
    """
    errs = []
    if pp < 1:
        errs.append(("parallel.pipeline_parallel_size", f"must be >= 1, got {pp}"))
    if virtual < 1:
        errs.append(("parallel.virtual_pipeline_size", f"must be >= 1, got {virtual}"))
    if errs:
        raise PlanError(errs)
    stages = pp * virtual
    if num_layers < stages or num_layers % stages:
        raise PlanError(
            [
                (
                    "model.num_layers",
                    f"{num_layers} layers cannot be split evenly into pipeline_parallel_size x virtual_pipeline_size"
                    f" = {pp} x {virtual} = {stages} stages (remainder {num_layers % stages}); use a layer count that"
                    f" is a multiple of {stages}, or change pp/virtual",
                )
            ]
        )
    per = num_layers // stages
    return [
        [
            ChunkSpec(
                pp_rank=r,
                chunk=c,
                stage=stage_of(pp, r, c),
                start=stage_of(pp, r, c) * per,
                end=(stage_of(pp, r, c) + 1) * per,
                has_embedding=stage_of(pp, r, c) == 0,
                has_head=stage_of(pp, r, c) == stages - 1,
            )
            for c in range(virtual)
        ]
        for r in range(pp)
    ]


class StageChunk(nn.Module):
    """One model chunk of a built causal LM (``embed``, ``run_layers``, ``head``, ``layers`` building blocks).

    ``forward(x, position_ids=None, segment_ids=None)``: token ids -> hidden states on the first stage, hidden ->
    hidden in the middle, and hidden -> logits on the last (a single-stage chunk maps ids -> logits); packed documents'
    positions and segments (every stage reads them from its copy of the micro-batch) reach each layer's attention.
    """

    def __init__(self, model: nn.Module, spec: ChunkSpec):
        super().__init__()
        self.spec = spec
        self._model = [model]  # not a submodule: the chunk does not own the other chunks' parameters

    @property
    def model(self) -> nn.Module:
        """The wrapped model."""
        return self._model[0]

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run this chunk's part of the model on ``x``; ``pixel_values`` (a vision-language model's images) reach the
        first stage's embedding, which merges their features (``kuangchao_core.engine.vlm_model``)."""
        m = self.model
        if self.spec.has_embedding:
            h = m.embed(x) if pixel_values is None else m.embed(x, pixel_values)
        else:
            h = x
        h = m.run_layers(h, self.spec.start, self.spec.end, position_ids=position_ids, segment_ids=segment_ids)
        return m.head(h) if self.spec.has_head else h

    def parameter_names(self) -> list[str]:
        """Names (in the wrapped model's naming) of the parameters this chunk uses."""
        s = self.spec
        prefixes = [f"model.layers.{i}." for i in range(s.start, s.end)]
        if s.has_embedding:
            prefixes.append("model.embed_tokens.")
        if s.has_head:
            prefixes += ["model.norm.", "lm_head."]
        return [n for n, _ in self.model.named_parameters() if any(n.startswith(pre) for pre in prefixes)]


def build_stage_chunks(model: nn.Module, pp: int, pp_rank: int, virtual: int = 1) -> list[StageChunk]:
    """The ``virtual`` chunks of ``pp_rank`` over an already built ``model`` (layers may be TP layers)."""
    num_layers = len(model.layers)
    cfg = getattr(model, "config", None)
    if pp > 1 and getattr(cfg, "tie_embeddings", False):
        raise PlanError(
            [
                (
                    "model.tie_embeddings",
                    f"tied embeddings put one weight on pipeline stage 0 and stage {pp * virtual - 1}; "
                    "pipeline parallel does not support that yet: set tie_embeddings false or pipeline_parallel_size 1",
                )
            ]
        )
    if not 0 <= pp_rank < pp:
        raise PlanError([("parallel.pipeline_parallel_size", f"pp_rank {pp_rank} out of range for pp={pp}")])
    return [StageChunk(model, spec) for spec in partition_layers(num_layers, pp, virtual)[pp_rank]]


def stage_parameters(chunks: list[StageChunk]) -> dict[str, nn.Parameter]:
    """The parameters used by this rank's chunks, by name (for the optimizer and checkpoint shards)."""
    names = {n for c in chunks for n in c.parameter_names()}
    return {n: p for n, p in chunks[0].model.named_parameters() if n in names} if chunks else {}
