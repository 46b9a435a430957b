"""What a MoE model's experts add to ``kc plan`` and ``kc recommend`` (issue 40 item 5): their memory sharded over
the ``ep`` axis and the tokens' all-to-all traffic.

- **Memory**: the routed experts' weights (``…experts.w_gate/w_up/w_down``, E × hidden × width each) are split
  over ``parallel.expert_parallel_size`` (ep): a rank holds E/ep of them, and their gradients and AdamW state
  with them; ZeRO shards what it shards over their replica group, the d/ep ranks holding the same experts
  (``dp_mod_ep``), while the rest of the model shards over all d·c (:func:`split_elements`; ep with cp > 1 is
  refused by the config for now). The router and the
  shared experts are replicated like any dense weight.
- **Traffic** (:func:`expert_traffic`): per MoE layer and micro-batch each ep rank sends the rows of its
  b·s/c tokens' top-k assignments bound for experts on the other ep ranks — (ep−1)/ep of them when the routing is
  balanced (what the estimate assumes; a skewed layer sends more from some ranks, fewer from others) — and gets
  their outputs back: two all-to-alls of b·(s/c)·k·h·e·(ep−1)/ep bytes forward, two in the backward, plus the
  forward's all-to-all of the E per-expert counts (8-byte integers) that tells each rank what it receives:
  ``m · L_moe · (4 · b·(s/c)·k·h·e + 8·E) · (ep−1)/ep``. With capacity limits the dropped rows are not sent
  (this counts them: an upper bound). The experts' gradients are summed over ``dp_mod_ep``: 2(r−1)/r of their
  E/ep share's bytes, r = d/ep, where without ep they ride in the dp all-reduce.
"""

from __future__ import annotations

from typing import Any

#: the parameter names of the routed experts (what ep shards)
EXPERT_WEIGHTS = (".experts.w_gate", ".experts.w_up", ".experts.w_down")


def expert_parallel_size(par: Any) -> int:
    """``parallel.expert_parallel_size`` (1 when the section has none)."""
    return int(getattr(par, "expert_parallel_size", 1) or 1)


def expert_elements(slices: dict[str, Any]) -> int:
    """Elements of the routed experts among ``slices`` (parameter name -> region), all of them (before ep)."""
    return sum(r.numel for n, r in slices.items() if n.endswith(EXPERT_WEIGHTS))


def split_elements(slices: dict[str, Any], ep: int) -> tuple[int, int]:
    """``(dense, experts)``: the elements of ``slices`` other than the routed experts, and the routed experts'
    elements one rank holds at expert-parallel size ``ep`` (E/ep of them)."""
    experts = expert_elements(slices)
    return sum(r.numel for r in slices.values()) - experts, experts // ep  # ep divides E (the config checks)


def moe_layers_on_stage(mcfg: Any, pp: int) -> int:
    """MoE layers of the busiest pipeline stage (those of the whole model spread evenly: ⌈L_moe / p⌉)."""
    if getattr(mcfg, "moe", None) is None:
        return 0
    return -(-len(mcfg.moe.moe_layers(mcfg.num_layers)) // pp)


def expert_traffic(mcfg: Any, par: Any, seq: int, slices: dict[str, Any], e: float = 4.0) -> dict[str, float]:
    """Bytes one member of the ``ep`` group and of the ``dp_mod_ep`` group sends per optimizer step (module
    docstring); empty without expert parallelism."""
    ep = expert_parallel_size(par)
    if ep <= 1 or getattr(mcfg, "moe", None) is None:
        return {}
    cp = getattr(par, "context_parallel_size", 1)
    m, b, k = par.gradient_accumulation_steps, par.micro_batch_size, mcfg.moe.top_k
    rows = 4 * b * (seq / cp) * k * mcfg.hidden_size * e + 8 * mcfg.moe.num_experts
    out = {"ep": m * moe_layers_on_stage(mcfg, par.pipeline_parallel_size) * rows * (ep - 1) / ep}
    replicas = par.data_parallel_size // ep
    _, experts = split_elements(slices, ep)
    out["dp_mod_ep"] = 2 * (replicas - 1) / replicas * experts * 4 if replicas > 1 else 0.0
    return out
