"""The mixture-of-experts feed-forward block of the Llama decoder (issue 40), one process.

A block replaces a decoder layer's SwiGLU MLP (``model.moe``; which layers: :meth:`MoeConfig.moe_layers`):

- the **router** scores every token against the ``num_experts`` experts (``router.weight``, experts × hidden,
  computed in at least fp32): ``softmax`` of the logits or their ``sigmoid`` (DeepSeek-V3). Each token picks the
  ``top_k`` highest scores — plus the per-expert ``expert_bias`` under ``balance: bias``, which decides the choice
  only and never weighs an output — and its gate weights are the chosen scores, renormalised to sum 1 when
  ``top_k > 1`` (Mixtral, DeepSeek-V3; with ``top_k`` 1 the raw score stays, as in Switch, so the router learns from
  the language-model loss);
- the **experts** are SwiGLU MLPs held as batched weights (``experts.w_gate``/``w_up``: experts × hidden × width,
  ``experts.w_down``: experts × width × hidden). The token–expert assignments are sorted by expert (a stable
  argsort, so each expert sees its tokens in token order), scattered into an experts × slots × hidden buffer and run
  as three batched matmuls; the outputs, times their gate weights, are summed back per token with ``index_add``.
  No Python loop runs over tokens or experts;
- **capacity**: with ``capacity_factor`` c an expert takes at most ``ceil(c · tokens · top_k / experts)``
  assignments, the first in token order; the rest are dropped (that expert adds nothing to the token, whose other
  experts and the residual remain; weights are not renormalised after a drop). ``capacity_factor`` null is dropless:
  the buffer has as many slots as the busiest expert has assignments (one host read of that count);
- ``num_shared_experts`` experts every token passes through, unweighted (DeepSeek), held as one SwiGLU MLP of
  ``num_shared_experts`` × the expert width (the sum of separate experts, exactly).

Losses, read by the training step after each forward (:class:`MoeStep`): the load-balancing loss
``aux_loss_coef · E · Σ_i f_i · P_i`` (Switch, DeepSeek) with ``f_i`` the share of the micro-batch's ``tokens ·
top_k`` assignments the router chose for expert i (before capacity) and ``P_i`` the mean over tokens of the router's
probability of i (the sigmoid scores normalised per token), and the router z-loss ``z_loss_coef ·
mean_t(logsumexp_i logit_ti)²`` (ST-MoE). ``balance: bias`` also moves ``expert_bias`` once per applied optimizer
step by ``bias_update_rate · sign(mean load − load_i)``, the loads counted over the step's micro-batches
(DeepSeek-V3's auxiliary-loss-free balancing; no gradient flows through the bias).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kuangchao_core.hal.dtypes import at_least_fp32
from kuangchao_core.models.moe_dispatch import ExpertShard, dispatch_experts

log = logging.getLogger("kuangchao.models")


@dataclass(frozen=True)
class MoeConfig:
    """The MoE settings a model is built with (``model.moe``; checked by ``config.moe_schema.moe_errors``)."""

    num_experts: int = 8
    top_k: int = 2
    num_shared_experts: int = 0
    expert_intermediate_size: int | None = None  # None: the model's intermediate_size
    router: str = "softmax"  # softmax | sigmoid
    capacity_factor: float | None = None  # None: dropless
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    balance: str = "aux_loss"  # aux_loss | bias
    bias_update_rate: float = 0.001
    layer_interval: int = 1
    layers: tuple[int, ...] | None = None

    @classmethod
    def from_section(cls, section: Any) -> MoeConfig | None:
        """From the job config's ``model.moe`` (a pydantic section, a dict, a MoeConfig or None)."""
        if section is None or isinstance(section, MoeConfig):
            return section
        raw = dict(section) if isinstance(section, dict) else section.model_dump()
        if raw.get("layers") is not None:
            raw["layers"] = tuple(int(i) for i in raw["layers"])
        return cls(**raw)

    def moe_layers(self, num_layers: int) -> list[int]:
        """Indices of the decoder layers whose MLP is a MoE block: ``layers`` when given, else every
        ``layer_interval``-th layer from the first (0, k, 2k, …; Megatron's ``moe_layer_freq``)."""
        if self.layers is not None:
            return sorted(set(self.layers))
        return list(range(0, num_layers, self.layer_interval))

    def width(self, intermediate_size: int) -> int:
        """One expert's SwiGLU width."""
        return int(self.expert_intermediate_size or intermediate_size)

    def capacity(self, tokens: int) -> int | None:
        """Assignments one expert takes from ``tokens`` tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def num_params(self, hidden: int, intermediate_size: int) -> int:
        """Parameters of one MoE block (router, routed and shared experts)."""
        width = self.width(intermediate_size)
        return hidden * self.num_experts + 3 * hidden * width * (self.num_experts + self.num_shared_experts)


@dataclass
class Routing:
    """One forward's routing: ``logits`` and ``scores`` (tokens × experts, at least fp32), the chosen experts
    ``index`` and their gate ``weights`` (tokens × top_k), and each expert's chosen ``load`` (before capacity)."""

    logits: torch.Tensor
    scores: torch.Tensor
    index: torch.Tensor
    weights: torch.Tensor
    load: torch.Tensor


class Router(nn.Module):
    """Scores tokens against experts and picks each token's ``top_k`` (see the module docstring)."""

    def __init__(self, hidden: int, cfg: MoeConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden))
        # float32 whatever the model's dtype (bf16 would round the small steps away); no gradient; checkpoints keep
        # it in state.json (MoeStep.state_dict)
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32), persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> Router:
        bias = self.expert_bias
        super()._apply(fn, recurse)
        self.expert_bias = bias.to(device=self.expert_bias.device)  # moved, never cast
        return self

    def forward(self, x: torch.Tensor) -> Routing:
        """Route ``x`` (tokens × hidden)."""
        h = at_least_fp32(x)
        with torch.autocast(x.device.type, enabled=False):  # autocast would run the linear in half precision
            logits = F.linear(h, self.weight.to(h.dtype))
        scores = logits.softmax(-1) if self.cfg.router == "softmax" else logits.sigmoid()
        choose = scores
        if self.cfg.balance == "bias":
            choose = scores.detach() + self.expert_bias.to(scores.dtype)
        index = choose.topk(self.cfg.top_k, dim=-1).indices
        weights = scores.gather(1, index)
        if self.cfg.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        load = torch.bincount(index.reshape(-1), minlength=self.cfg.num_experts)
        return Routing(logits, scores, index, weights, load)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's step: ``bias += rate · sign(mean(load) − load)`` (``load``: assignments per expert)."""
        load = load.to(device=self.expert_bias.device, dtype=torch.float64)
        self.expert_bias += (self.cfg.bias_update_rate * torch.sign(load.mean() - load)).to(self.expert_bias.dtype)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs as batched weights, run on tokens grouped by expert (three batched matmuls);
    ``shard``: this rank's share under expert parallelism (``models.moe_dispatch``; None: every expert here)."""

    def __init__(self, hidden: int, width: int, num_experts: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.w_down = nn.Parameter(torch.empty(num_experts, width, hidden))
        self.shard: ExpertShard | None = None

    def forward(self, x: torch.Tensor, routing: Routing, capacity: int | None) -> torch.Tensor:
        """Sum over each token of ``x`` (tokens × hidden) of its kept experts' outputs times their gate weights."""
        if self.shard is not None:
            return dispatch_experts(self, x, routing, capacity, self.shard)
        tokens, k = routing.index.shape
        experts = self.w_gate.shape[0]
        expert_of = routing.index.reshape(-1)  # assignment a = t·k + j, in token order
        order = torch.argsort(expert_of, stable=True)  # grouped by expert, token order kept inside each group
        counts = torch.bincount(expert_of, minlength=experts)
        starts = counts.cumsum(0) - counts
        expert = expert_of[order]
        slot = torch.arange(order.numel(), device=x.device) - starts[expert]  # position in the expert's queue
        if capacity is not None:
            kept = slot < capacity
            order, expert, slot = order[kept], expert[kept], slot[kept]
            slots = capacity
        else:
            slots = int(counts.max()) if order.numel() else 0
        token = torch.div(order, k, rounding_mode="floor")
        buffer = x.new_zeros(experts, slots, x.shape[-1])
        buffer = buffer.index_put((expert, slot), x[token])
        hidden = F.silu(torch.bmm(buffer, self.w_gate)) * torch.bmm(buffer, self.w_up)
        out = torch.bmm(hidden, self.w_down)[expert, slot]
        gate = routing.weights.reshape(-1)[order].to(x.dtype)
        return x.new_zeros(tokens, x.shape[-1]).index_add(0, token, out * gate[:, None])


class SharedExperts(nn.Module):
    """The shared experts as one SwiGLU MLP of their summed width (Llama's names: gate/up/down_proj)."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoeBlock(nn.Module):
    """A decoder layer's MoE feed-forward: router, grouped experts, shared experts. After each forward it holds
    ``aux_loss`` (the weighted balancing loss plus z-loss, or None when both weights are 0), ``balance_loss`` and
    ``z_loss`` (unweighted) and ``load`` (assignments per expert) for :class:`MoeStep`."""

    def __init__(self, hidden: int, intermediate_size: int, cfg: MoeConfig):
        super().__init__()
        self.cfg = cfg
        width = cfg.width(intermediate_size)
        self.router = Router(hidden, cfg)
        self.experts = GroupedExperts(hidden, width, cfg.num_experts)
        self.shared_experts = SharedExperts(hidden, width * cfg.num_shared_experts) if cfg.num_shared_experts else None
        self.aux_loss: torch.Tensor | None = None
        self.load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (…, hidden) -> the same shape."""
        flat = x.reshape(-1, x.shape[-1])
        routing = self.router(flat)
        out = self.experts(flat, routing, self.cfg.capacity(flat.shape[0]))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        self._losses(routing)
        return out.reshape(x.shape)

    def _losses(self, routing: Routing) -> None:
        cfg = self.cfg
        self.load = routing.load.detach()
        probs = routing.scores if cfg.router == "softmax" else routing.scores / routing.scores.sum(-1, keepdim=True)
        share = routing.load.to(probs.dtype) / max(1, routing.index.numel())
        self.balance_loss = cfg.num_experts * (share * probs.mean(0)).sum()
        self.z_loss = torch.logsumexp(routing.logits, -1).square().mean()
        terms = [c * t for c, t in ((cfg.aux_loss_coef, self.balance_loss), (cfg.z_loss_coef, self.z_loss)) if c]
        self.aux_loss = sum(terms[1:], terms[0]) if terms else None


def moe_blocks(model: nn.Module) -> list[MoeBlock]:
    """The model's MoE blocks, in module order."""
    return [m for m in model.modules() if isinstance(m, MoeBlock)]


def decoder_layers(model: nn.Module) -> list[int]:
    """The decoder-layer index of each of :func:`moe_blocks` (``…layers.<i>.mlp`` in the parameter names every
    layout keeps; a block outside a decoder counts as layer 0)."""
    found = [
        re.search(r"(?:^|\.)layers\.(\d+)\.", f"{n}.") for n, m in model.named_modules() if isinstance(m, MoeBlock)
    ]
    return [int(f[1]) if f else 0 for f in found]


class MoeStep:
    """What the training step does for the model's MoE blocks: after each micro-batch's forward,
    :meth:`micro_batch_loss` gives the sum of the blocks' auxiliary losses (to add to the loss the step
    backpropagates) and counts the blocks' loads; :meth:`step_loads` gives the step's loads, one row per MoE layer of
    the whole model (``layers``: their decoder-layer indices; default those of this model's blocks), which the
    trainer sums over the ranks that saw other tokens; :meth:`after_step` applies the bias update of ``balance:
    bias`` blocks once per optimizer step that was applied, from those summed loads, then forgets them.
    The loads are read right after the forward, so a recomputed forward (activation checkpointing) never counts."""

    def __init__(self, model: nn.Module, layers: list[int] | None = None, num_experts: int | None = None):
        self.blocks = moe_blocks(model)
        held = decoder_layers(model)
        self.layers = sorted(set(held)) if layers is None else list(layers)
        self.rows = [self.layers.index(i) for i in held]  # each block's row of step_loads
        self.num_experts = num_experts or self.blocks[0].cfg.num_experts
        self.loads: list[torch.Tensor | None] = [None] * len(self.blocks)

    def micro_batch_loss(self) -> torch.Tensor | None:
        """Sum of the blocks' auxiliary losses of the last forward (None when none has a weight)."""
        total = None
        for i, block in enumerate(self.blocks):
            self.loads[i] = block.load if self.loads[i] is None else self.loads[i] + block.load
            if block.aux_loss is not None:
                total = block.aux_loss if total is None else total + block.aux_loss
        return total

    def step_loads(self, device: Any = None) -> torch.Tensor:
        """This process's loads of the step so far, float64 (MoE layers × experts): row ``layers.index(l)`` holds
        the assignments the block of decoder layer ``l`` routed to each expert over the step's micro-batches
        (before capacity); rows of layers this process does not hold (other pipeline stages) are zeros, so a sum
        over the ranks is the whole model's."""
        out = torch.zeros(len(self.layers), self.num_experts, dtype=torch.float64, device=device)
        for row, load in zip(self.rows, self.loads, strict=True):
            if load is not None:
                out[row] += load.to(out)
        return out

    def after_step(self, applied: bool, loads: torch.Tensor | None = None) -> None:
        """Update the biases when the optimizer step was ``applied`` (the same decision on every rank) from the
        step's ``loads`` (:meth:`step_loads` summed over every rank that saw other tokens, so every replica moves
        its biases alike, as one process would from the whole global batch; None: this process's own); reset the
        loads."""
        if applied and any(b.cfg.balance == "bias" for b in self.blocks):
            loads = self.step_loads() if loads is None else loads
            for block, row in zip(self.blocks, self.rows, strict=True):
                if block.cfg.balance == "bias":
                    block.router.update_bias(loads[row])
        self.loads = [None] * len(self.blocks)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint's ``state.json`` keeps besides the parameters: each ``balance: bias`` block's routing
        bias (``moe_expert_bias``, one list per block in module order; the same on every DP replica)."""
        if not any(b.cfg.balance == "bias" for b in self.blocks):
            return {}
        return {"moe_expert_bias": [b.router.expert_bias.tolist() for b in self.blocks]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the biases :meth:`state_dict` wrote (a checkpoint without them, or of another shape, starts them
        at zero, with a warning)."""
        saved = state.get("moe_expert_bias")
        if not self.state_dict():
            return
        if saved is None or [len(s) for s in saved] != [b.cfg.num_experts for b in self.blocks]:
            log.warning("the checkpoint holds no MoE routing biases for this model; they start from zero")
            return
        with torch.no_grad():
            for block, values in zip(self.blocks, saved, strict=True):
                block.router.expert_bias.copy_(torch.tensor(values, dtype=torch.float32))


def moe_step(model: nn.Module, cfg: MoeConfig | None = None, num_layers: int = 0) -> MoeStep | None:
    """A :class:`MoeStep` for ``model``, a part of a decoder of ``num_layers`` layers built with ``cfg`` (a pipeline
    stage's part may hold none of the MoE blocks: its step still has a row, of zeros, for each MoE layer), or, with
    ``cfg`` None, for the blocks ``model`` holds; None when there are none."""
    if cfg is not None:
        return MoeStep(model, cfg.moe_layers(num_layers), cfg.num_experts)
    return MoeStep(model) if moe_blocks(model) else None
