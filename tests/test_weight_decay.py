"""Weight decay skips norms and the embedding (``optimizer.weight_decay_exclude``), in every optimizer.

ZeRO keeps one AdamW param group over flat shards and applies the decoupled decay to the decayed ranges itself;
the result must equal a plain ``torch.optim.AdamW`` with two param groups (float64, two Gloo processes, each
training its half of the batch while the reference trains the whole). Negative control: the same sharded optimizer
without exclusions moves the norm scales away from the reference.
"""

from __future__ import annotations

import numpy as np
import torch

from kuangchao_core.models.llama import LlamaForCausalLM, causal_lm_loss
from kuangchao_core.parallel.weight_decay import decays, param_groups
from tests.fixtures import tiny_llama
from tests.mp import run_distributed
from tests.tolerances import FP64_REL, NEGATIVE_MIN, rel_norm

LR, WD, STEPS, SEQ = 1e-2, 0.1, 3, 8


def _model() -> LlamaForCausalLM:
    cfg = tiny_llama(vocab_size=64, hidden_size=32, intermediate_size=64, max_seq_len=SEQ)
    m = LlamaForCausalLM(cfg)
    m.init_weights(3)
    return m.double()


def _batch(step: int):
    tokens = torch.randint(0, 64, (4, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def test_norms_and_embedding_are_the_excluded_kinds():
    named = list(_model().named_parameters())
    plain = {n for n, p in named if not decays(n, p.shape, ["norm", "embedding"])}
    assert plain == {n for n in dict(named) if n.endswith("norm.weight")} | {"model.embed_tokens.weight"}
    assert "lm_head.weight" not in plain and "model.layers.0.mlp.up_proj.weight" not in plain
    groups = param_groups(named, WD, ["norm"])
    assert [g["weight_decay"] for g in groups] == [WD, 0.0]
    assert sum(len(g["params"]) for g in groups) == len(named) and len(groups[1]["params"]) == 5  # 2 × 2 + final
    assert len(param_groups(named, WD, [])) == 1  # nothing excluded: one decayed group


def _case(rank: int, stage: int, exclude: list[str]):
    from kuangchao_core.comm import world_group
    from kuangchao_core.parallel.zero import ZeroOptimizer
    from kuangchao_core.parallel.zero3 import Zero3Optimizer, block_units

    ref, model = _model(), _model()
    ref_opt = torch.optim.AdamW(param_groups(ref.named_parameters(), WD, ["norm", "embedding"]), lr=LR, foreach=False)
    no_decay = [n for n, p in model.named_parameters() if not decays(n, p.shape, exclude)]
    kw = {"lr": LR, "weight_decay": WD, "no_decay": no_decay, "betas": (0.9, 0.999)}
    if stage == 3:
        opt = Zero3Optimizer(model, block_units(model), world_group(), **kw)
    else:
        opt = ZeroOptimizer(list(model.named_parameters()), world_group(), stage=stage, bucket_cap_mb=0.01, **kw)
    for step in range(STEPS):
        x, y = _batch(step)
        ref_opt.zero_grad()
        causal_lm_loss(ref(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        half = slice(rank * 2, rank * 2 + 2)
        causal_lm_loss(model(x[half]), y[half]).backward()
        opt.step()
    full = opt.full_parameters() if stage == 3 else torch.no_grad()
    with full:
        got = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    return got, {n: p.detach().numpy().copy() for n, p in ref.named_parameters()}


def _body(rank: int, world_size: int, cases: list[tuple[int, list[str]]]):
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    return [_case(rank, stage, exclude) for stage, exclude in cases]


def _worst(got, want) -> float:
    return max(rel_norm(got[n], w) for n, w in want.items())


def test_sharded_optimizers_decay_like_adamw_with_two_param_groups():
    both = ["norm", "embedding"]
    cases = [(1, both), (3, both), (2, [])]  # the last: negative control, norms and embedding decayed too
    results = run_distributed(_body, 2, args=(cases,), timeout=120)[0]
    for (stage, _), (got, want) in zip(cases[:2], results, strict=False):
        assert _worst(got, want) <= FP64_REL, f"ZeRO-{stage}"
    got, want = results[2]
    norm = "model.norm.weight"
    assert rel_norm(got[norm], want[norm]) >= NEGATIVE_MIN
    assert np.all(got[norm] < want[norm])  # decayed towards zero
