"""The Llama model split across a tensor-parallel group (SPEC L3.2), Hugging Face parameter names kept.

- Attention: query heads split (num_heads / tp per rank). Key/value heads split too when num_kv_heads >= tp
  (tp must divide them); when there are fewer than tp, each rank keeps the one key/value head its query heads use
  (tp must be a multiple of num_kv_heads) and the weight gradient is summed over the ranks sharing it, so the
  replicas stay identical. o_proj is row-parallel.
- MLP: gate/up column-parallel, down row-parallel.
- Embedding vocab-parallel; lm_head column-parallel with the logits left vocab-split for
  :func:`~kuangchao_core.parallel.vocab_parallel.vocab_parallel_cross_entropy`.
- RMSNorm weights replicated. Each norm that feeds a column-parallel block also carries the block's single
  copy-to-TP-region, so backward does one all-reduce per block (2 per layer forward, 2 backward).
- ``sequence_parallel`` (Megatron's sequence parallelism, :mod:`kuangchao_core.parallel.sequence`): between the
  blocks each rank holds s/tp positions. The embedding reduce-scatters along the sequence; each norm runs on its
  shard (its weight's gradient summed over TP) and all-gathers the sequence for the block's column-parallel
  projections; o_proj and down reduce-scatter. The final norm also runs on the shard and the sequence is gathered
  just before the head, since the vocabulary-parallel loss needs every position's logits on every rank (gathering
  after the norm rather than before keeps the norm's saved activations at s/tp; the bytes moved are the same).
  Rotary tables and packed documents' segments stay whole: attention runs on the gathered sequence. The gathered
  norm outputs the projections save are kept as shards and gathered again in the backward (:attr:`regather`).

The local parameters keep the Hugging Face names; :func:`tp_shard_slices` says which slice of which full tensor each
rank holds (for checkpoint resharding), :func:`gather_full_state_dict` rebuilds the full tensors.
"""

from __future__ import annotations

import functools

import torch

from kuangchao_core.errors import PlanError
from kuangchao_core.hal.dtypes import at_least_fp32
from kuangchao_core.models.llama import LlamaConfig, LlamaForCausalLM, RMSNorm
from kuangchao_core.models.llama import init_from_seed as _init_from_seed
from kuangchao_core.parallel import sequence as sequence_mod
from kuangchao_core.parallel.sequence import RegatherInBackward, gather_from_sequence_region, pad_to_multiple
from kuangchao_core.parallel.tensor import (
    ColumnParallelLinear,
    ReplicatedHeadsLinear,
    RowParallelLinear,
    copy_to_tp_region,
    gather_from_tp_region,
)
from kuangchao_core.parallel.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

_KEY = "parallel.tensor_parallel_size"

#: The TP plan, one table for both the layers built (:meth:`TPLlamaForCausalLM.make_linear`) and the slices recorded
#: for checkpoints (:func:`tp_shard_spec`): ``column`` splits output features (dim 0), ``row`` input features
#: (dim 1), ``vocab`` the vocabulary rows (dim 0); parameter kinds not named (the norms) are replicated.
TP_PLAN: dict[str, str] = {
    "q_proj": "column",
    "k_proj": "column",
    "v_proj": "column",
    "o_proj": "row",
    "gate_proj": "column",
    "up_proj": "column",
    "down_proj": "row",
    "lm_head": "column",
    "embed_tokens": "vocab",
}
_SPLIT_DIM = {"column": 0, "row": 1, "vocab": 0}


def _kind(name: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``q_proj``; ``lm_head.weight`` -> ``lm_head``."""
    return name.split(".")[-2]


def validate_tp(cfg: LlamaConfig, tp: int) -> None:
    """Raise PlanError listing every size of ``cfg`` that a TP group of ``tp`` ranks cannot split."""
    errors: list[tuple[str, str]] = []
    if tp < 1:
        errors.append((_KEY, f"must be >= 1, got {tp}"))
    else:
        for field in ("num_heads", "vocab_size", "intermediate_size"):
            value = getattr(cfg, field)
            if value % tp:
                errors.append((_KEY, f"model.{field} {value} is not divisible by tensor_parallel_size {tp}"))
        kv = cfg.num_kv_heads
        if kv >= tp and kv % tp:
            errors.append((_KEY, f"model.num_kv_heads {kv} is not divisible by tensor_parallel_size {tp}"))
        if kv < tp and tp % kv:
            errors.append(
                (_KEY, f"tensor_parallel_size {tp} is not a multiple of model.num_kv_heads {kv} (needed to replicate)")
            )
    if errors:
        raise PlanError(errors)


def _kv_slot(cfg: LlamaConfig, tp: int, tp_rank: int) -> int:
    """Index of the key/value head that rank ``tp_rank``'s query heads use (when kv heads are replicated)."""
    q_per_rank = cfg.num_heads // tp
    return (tp_rank * q_per_rank) // (cfg.num_heads // cfg.num_kv_heads)


def tp_shard_spec(cfg: LlamaConfig) -> dict[str, int | None]:
    """Hugging Face parameter name -> dimension split across TP ranks (None: replicated), from :data:`TP_PLAN`."""
    return {name: _SPLIT_DIM.get(TP_PLAN.get(_kind(name), ""), None) for name in full_shapes(cfg)}


def tp_shard_slices(cfg: LlamaConfig, tp: int, tp_rank: int) -> dict[str, tuple[int, int, int] | None]:
    """Hugging Face name -> (dim, start, length) of the slice TP rank ``tp_rank`` of ``tp`` holds (None: the full
    tensor). With replicated key/value heads several ranks hold the same k/v slice."""
    validate_tp(cfg, tp)
    full = full_shapes(cfg)
    out: dict[str, tuple[int, int, int] | None] = {}
    d = cfg.head_dim
    for name, dim in tp_shard_spec(cfg).items():
        if dim is None or tp == 1:
            out[name] = None
            continue
        if cfg.num_kv_heads < tp and name.endswith(("k_proj.weight", "v_proj.weight")):
            out[name] = (0, _kv_slot(cfg, tp, tp_rank) * d, d)
            continue
        local = full[name][dim] // tp
        out[name] = (dim, tp_rank * local, local)
    return out


def full_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> full shape, in parameter registration order (built on the meta device, no memory).

    Remembered per distinct config (building an 8B model on the meta device takes ~0.1 s, and ``kc plan`` asks
    once per rank); a fresh dict comes back each time."""
    return dict(_full_shapes(tuple(sorted(vars(cfg).items()))))


@functools.lru_cache(maxsize=32)
def _full_shapes(fields: tuple[tuple[str, object], ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**dict(fields)))
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


class TPRMSNorm(RMSNorm):
    """RMSNorm (replicated weight) whose output enters a column-parallel block: one copy-to-TP-region for all the
    projections that read it; with ``sequence_parallel`` it normalises this rank's s/tp positions (the weight's
    gradient summed over TP) and all-gathers the sequence instead."""

    def __init__(self, dim: int, eps: float, group, sequence_parallel: bool = False, regather=None) -> None:
        super().__init__(dim, eps)
        self.group = group
        self.sequence_parallel = sequence_parallel
        self._regather = [regather]  # shared by the model's norms; a list keeps it out of the module tree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return copy_to_tp_region(super().forward(x), self.group)
        h = at_least_fp32(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = sequence_mod.sum_weight_grad_over_tp(self.weight, self.group)
        shard = weight * h.to(x.dtype)
        full = gather_from_sequence_region(shard, self.group)
        if self._regather[0] is not None:
            self._regather[0].register(shard, full)
        return full


class TPLlamaForCausalLM(LlamaForCausalLM):
    """:class:`LlamaForCausalLM` whose projections, embedding and head are split across ``tp_group``.

    ``forward(input_ids)`` returns this rank's vocabulary slice of the logits; use :meth:`loss` (vocab-parallel
    cross-entropy) or :meth:`gather_logits`. Weights are uninitialised until :func:`load_full_state_dict` or
    :func:`init_from_seed` (as :func:`build_tp_model` does).
    """

    def __init__(self, cfg: LlamaConfig, tp_group, sequence_parallel: bool = False) -> None:
        tp = 1 if tp_group is None else tp_group.size
        validate_tp(cfg, tp)
        sp = bool(sequence_parallel) and tp > 1
        object.__setattr__(self, "tp_group", tp_group)  # the factories below run inside super().__init__
        object.__setattr__(self, "tp_size", tp)
        object.__setattr__(self, "tp_rank", 0 if tp_group is None else tp_group.rank)
        object.__setattr__(self, "sequence_parallel", sp)
        super().__init__(cfg)
        #: the decoder layers' gathered norm outputs are saved as shards and gathered again in the backward
        self.regather = RegatherInBackward(tp_group) if sp else None
        for layer in self.model.layers:
            for name in ("input_layernorm", "post_attention_layernorm"):
                setattr(layer, name, TPRMSNorm(cfg.hidden_size, cfg.norm_eps, tp_group, sp, self.regather))
        self.model.norm = TPRMSNorm(cfg.hidden_size, cfg.norm_eps, tp_group, sp)

    def make_linear(self, in_features: int, out_features: int, role: str):
        """The layer :data:`TP_PLAN` names for ``role`` (row- or column-parallel), replicated-head k/v when there are
        fewer key/value heads than TP ranks."""
        cfg, group = self.config, self.tp_group
        if TP_PLAN[role] == "row":
            return RowParallelLinear(in_features, out_features, group, sequence_parallel=self.sequence_parallel)
        if role in ("k_proj", "v_proj") and cfg.num_kv_heads < self.tp_size:
            slot = _kv_slot(cfg, self.tp_size, self.tp_rank)
            return ReplicatedHeadsLinear(in_features, out_features, group, cfg.head_dim, slot, copy_input=False)
        return ColumnParallelLinear(in_features, out_features, group, copy_input=False)

    def make_embedding(self, num_embeddings: int, dim: int):
        """Vocabulary-parallel embedding (reduce-scattered along the sequence with sequence parallelism)."""
        return VocabParallelEmbedding(num_embeddings, dim, self.tp_group, sequence_parallel=self.sequence_parallel)

    def run_layers(
        self,
        h: torch.Tensor,
        start: int = 0,
        end: int | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As :meth:`LlamaForCausalLM.run_layers`; with sequence parallelism ``h`` holds this rank's s/tp positions
        while ``position_ids``/``segment_ids`` cover the whole sequence (attention runs on the gathered sequence,
        so the rotary positions are the tokens' real ones: 0..s-1 by default)."""
        if self.sequence_parallel and position_ids is None:
            position_ids = torch.arange(h.shape[1] * self.tp_size, device=h.device)
        if self.regather is None or not self.regather.enabled or not torch.is_grad_enabled():
            return super().run_layers(h, start, end, position_ids=position_ids, segment_ids=segment_ids)
        with self.regather.hooks():
            return super().run_layers(h, start, end, position_ids=position_ids, segment_ids=segment_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As :meth:`LlamaForCausalLM.forward`; with sequence parallelism a length that tensor_parallel_size does
        not divide (greedy decoding) is right-padded and the padded positions' logits dropped (causal attention:
        the real positions never see them)."""
        if not self.sequence_parallel:
            return super().forward(input_ids, position_ids=position_ids, segment_ids=segment_ids)
        extras = {k: v for k, v in (("position_ids", position_ids), ("segment_ids", segment_ids)) if v is not None}
        if input_ids.shape[-1] > self.config.max_seq_len:
            return super().forward(input_ids, **extras)  # raises, naming the setting
        ids, extras, s = pad_to_multiple(input_ids, extras, self.tp_size)
        return self.head(self.run_layers(self.embed(ids), **extras))[:, :s]

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy of vocab-split ``logits`` against ``labels`` (ignore -100); same value as
        :func:`~kuangchao_core.models.llama.causal_lm_loss` on the full logits."""
        return vocab_parallel_cross_entropy(logits, labels, self.tp_group, reduction=reduction)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits from this rank's slice (all-gather; gradient flows back to the slice)."""
        return gather_from_tp_region(logits, self.tp_group)

    def shard_slices(self) -> dict[str, tuple[int, int, int] | None]:
        """Local parameter name -> (dim, start, length) of the full tensor it holds (None: full tensor)."""
        return tp_shard_slices(self.config, self.tp_size, self.tp_rank)


@torch.no_grad()
def load_full_state_dict(model: TPLlamaForCausalLM, full_state_dict: dict[str, torch.Tensor]) -> None:
    """Copy this rank's slice of every full (Hugging Face named) tensor into ``model``."""
    slices = model.shard_slices()
    missing = [name for name, _ in model.named_parameters() if name not in full_state_dict]
    if missing:
        raise KeyError(f"full state dict lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for name, param in model.named_parameters():
        full = full_state_dict[name]
        spec = slices[name]
        part = full if spec is None else full.narrow(spec[0], spec[1], spec[2])
        param.copy_(part)


def init_from_seed(model: TPLlamaForCausalLM, seed: int) -> None:
    """Initialise exactly as ``LlamaForCausalLM.init_weights(seed)`` would the full model, keeping this rank's
    slices (:func:`~kuangchao_core.models.llama.init_from_seed`)."""
    _init_from_seed(model, seed, model.shard_slices())


def build_tp_model(
    llama_cfg: LlamaConfig, tp_group, full_state_dict: dict[str, torch.Tensor] | None = None, seed: int = 1234
) -> TPLlamaForCausalLM:
    """The Llama model split over ``tp_group``, initialised from ``full_state_dict`` (Hugging Face names) or, if
    None, exactly as the one-process model initialised with ``seed``. Raises PlanError if the sizes do not split."""
    model = TPLlamaForCausalLM(llama_cfg, tp_group)
    if full_state_dict is not None:
        load_full_state_dict(model, full_state_dict)
    else:
        init_from_seed(model, seed)
    return model


@torch.no_grad()
def gather_full_state_dict(model: TPLlamaForCausalLM, tp_group=None) -> dict[str, torch.Tensor]:
    """Full tensors (Hugging Face names) rebuilt from every TP rank's slices; collective over the TP group, every
    rank gets the whole dict."""
    from kuangchao_core.comm import primitives as comm

    group = model.tp_group if tp_group is None else tp_group
    tp = 1 if group is None else group.size
    cfg = model.config
    shapes = full_shapes(cfg)
    per_rank = [tp_shard_slices(cfg, tp, r) for r in range(tp)]
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        local = param.detach()
        if per_rank[0][name] is None:
            out[name] = local.clone()
            continue
        parts = comm.all_gather(None, local.contiguous(), group=group)
        full = local.new_empty(shapes[name])
        for r, part in enumerate(parts):
            dim, start, length = per_rank[r][name]
            full.narrow(dim, start, length).copy_(part)
        out[name] = full
    return out
