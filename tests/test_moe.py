"""The MoE feed-forward block (issue 40, ``kuangchao_core.models.moe``) against a per-token reference, in float64.

The reference below loops over tokens and over each token's chosen experts, one expert MLP at a time, keeping a
per-expert counter for capacity: what the block computes grouped (argsort, batched matmuls, ``index_add``). Every
comparison has a negative control: the reference with one thing changed (a wrong expert, weights not renormalised,
drops in the wrong order, a loss formula off) must disagree with the block.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kuangchao_core.models.llama import LlamaConfig, LlamaForCausalLM, LlamaMLP
from kuangchao_core.models.moe import MoeBlock, MoeConfig, MoeStep

H, WIDTH, E = 16, 12, 4
TOL = 1e-12  # float64: the grouped and per-token paths sum the same products in different orders


def _block(seed: int = 0, skew: float = 0.0, **moe) -> MoeBlock:
    """A float64 block with N(0, 0.3) weights; ``skew`` adds to expert 0's router row along the all-ones direction."""
    cfg = MoeConfig(num_experts=E, expert_intermediate_size=WIDTH, **moe)
    block = MoeBlock(H, 99, cfg).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
        block.router.weight[0] += skew
    return block


def _tokens(n: int = 24, seed: int = 1, shift: float = 0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, generator=gen, dtype=torch.float64) + shift


def _expert(block: MoeBlock, e: int, x: torch.Tensor) -> torch.Tensor:
    w = block.experts
    return (F.silu(x @ w.w_gate[e]) * (x @ w.w_up[e])) @ w.w_down[e]


def reference(block: MoeBlock, x: torch.Tensor, sabotage: str | None = None) -> torch.Tensor:
    """Token by token: scores, top-k (with the bias), gate weights, capacity in token order, expert MLPs."""
    cfg = block.cfg
    cap = cfg.capacity(x.shape[0]) if sabotage != "no_capacity" else None
    taken = [0] * cfg.num_experts
    rows = range(x.shape[0] - 1, -1, -1) if sabotage == "drop_first_tokens" else range(x.shape[0])
    out = [None] * x.shape[0]
    for t in rows:
        logits = block.router.weight @ x[t]
        scores = logits.softmax(-1) if cfg.router == "softmax" else logits.sigmoid()
        choose = scores + block.router.expert_bias.double() if cfg.balance == "bias" else scores
        order = sorted(range(cfg.num_experts), key=lambda e: -float(choose[e].detach()))
        chosen = order[: cfg.top_k]
        if sabotage == "wrong_expert":
            chosen = [(e + 1) % cfg.num_experts for e in chosen]
        weights = torch.stack([scores[e] for e in chosen])
        if sabotage == "bias_in_weights":
            weights = torch.stack([choose[e] for e in chosen])
        if cfg.top_k > 1 and sabotage != "no_renormalise":
            weights = weights / weights.sum()
        y = torch.zeros(H, dtype=x.dtype)
        for e, w in zip(chosen, weights, strict=True):
            if cap is not None and taken[e] >= cap:
                continue  # dropped: this expert is full
            taken[e] += 1
            y = y + w * _expert(block, e, x[t])
        if block.shared_experts is not None:
            y = y + block.shared_experts(x[t])
        out[t] = y
    return torch.stack(out)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("shared", [0, 2])
def test_grouped_output_equals_the_per_token_reference(router, top_k, shared):
    block = _block(router=router, top_k=top_k, num_shared_experts=shared)
    x = _tokens()
    out = block(x)
    assert torch.allclose(out, reference(block, x), rtol=TOL, atol=TOL)
    assert not torch.allclose(out, reference(block, x, "wrong_expert"), rtol=1e-3, atol=1e-3)
    if top_k > 1:
        assert not torch.allclose(out, reference(block, x, "no_renormalise"), rtol=1e-3, atol=1e-3)


def test_batched_shapes_and_gradients_match_the_reference():
    block = _block(top_k=2, num_shared_experts=1)
    x = _tokens(24).reshape(2, 12, H).requires_grad_(True)
    out = block(x)
    assert out.shape == x.shape
    (out * torch.linspace(-1, 1, H, dtype=torch.float64)).sum().backward()
    grads = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x2 = x.detach().reshape(-1, H).requires_grad_(True)
    (reference(block, x2) * torch.linspace(-1, 1, H, dtype=torch.float64)).sum().backward()
    ref = [p.grad for p in block.parameters()] + [x2.grad.reshape(x.shape)]
    for got, want in zip(grads, ref, strict=True):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_capacity_drops_exactly_the_assignments_the_reference_drops(factor):
    # a skewed router: most tokens want expert 0, so it fills up and drops the later tokens
    block = _block(skew=1.5, top_k=2, capacity_factor=factor)
    x = _tokens(24, shift=0.5)
    out = block(x)
    cap = math.ceil(factor * 24 * 2 / E)
    assert block.cfg.capacity(24) == cap and int(block.load.max()) > cap  # some assignments are dropped
    assert torch.allclose(out, reference(block, x), rtol=TOL, atol=TOL)
    assert not torch.allclose(out, reference(block, x, "no_capacity"), rtol=1e-3, atol=1e-3)
    assert not torch.allclose(out, reference(block, x, "drop_first_tokens"), rtol=1e-3, atol=1e-3)


def test_top1_full_expert_gives_nothing_to_the_tokens_past_its_capacity():
    block = _block(skew=4.0, top_k=1, capacity_factor=1.0)
    x = _tokens(16, shift=1.0)
    out = block(x)
    index = block.router(x).index[:, 0]
    to_zero = (index == 0).nonzero().flatten()
    cap = block.cfg.capacity(16)
    assert len(to_zero) > cap
    assert out[to_zero[:cap]].abs().sum(-1).min() > 0  # the first `cap` tokens in token order were computed
    assert out[to_zero[cap:]].abs().max() == 0  # the later ones were dropped (no shared expert: output 0)


def test_dropless_computes_every_assignment_however_skewed():
    block = _block(skew=4.0, top_k=2)
    x = _tokens(32, shift=1.0)
    assert int(block(x).abs().sum(-1).min() > 0) and int(block.load.max()) > 2 * 32 // E
    assert torch.allclose(block(x), reference(block, x), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_loss_is_e_times_sum_of_load_share_times_mean_probability(router, top_k):
    block = _block(skew=0.7, router=router, top_k=top_k, aux_loss_coef=0.03, capacity_factor=0.5)
    x = _tokens(20)
    block(x)
    logits = x @ block.router.weight.detach().T
    scores = logits.softmax(-1) if router == "softmax" else logits.sigmoid()
    probs = scores / scores.sum(-1, keepdim=True)  # softmax rows already sum to 1
    counts = [0] * E
    for t in range(20):  # chosen before capacity: the router's decision, not what fit
        for e in scores[t].topk(top_k).indices.tolist():
            counts[e] += 1
    f = torch.tensor(counts, dtype=torch.float64) / (20 * top_k)
    want = E * float((f * probs.mean(0)).sum())
    assert block.balance_loss.item() == pytest.approx(want, rel=1e-12)
    assert block.aux_loss.item() == pytest.approx(0.03 * want, rel=1e-12)  # z_loss_coef 0: no z term
    assert block.balance_loss.item() != pytest.approx(float((f * probs.mean(0)).sum()), rel=1e-3)  # without E
    kept = block.load.clamp(max=block.cfg.capacity(20)).double() / (20 * top_k)  # counted after the drops
    assert block.balance_loss.item() != pytest.approx(E * float((kept * probs.mean(0)).sum()), rel=1e-3)


def test_aux_loss_gradient_reaches_the_router():
    block = _block(top_k=2, aux_loss_coef=1.0)
    block(_tokens())
    block.aux_loss.backward()
    assert block.router.weight.grad.abs().sum() > 0


def test_z_loss_is_mean_squared_logsumexp_times_its_weight():
    block = _block(top_k=2, aux_loss_coef=0.01, z_loss_coef=0.002)
    x = _tokens(20)
    block(x)
    lse = torch.logsumexp(x @ block.router.weight.detach().T, -1)
    want = float(lse.square().mean())
    assert block.z_loss.item() == pytest.approx(want, rel=1e-12)
    assert block.aux_loss.item() == pytest.approx(0.002 * want + 0.01 * block.balance_loss.item(), rel=1e-12)
    assert block.z_loss.item() != pytest.approx(float(lse.mean().square()), rel=1e-3)  # square of the mean: not it


def _imbalance(load: torch.Tensor) -> float:
    return float(load.max() - load.min()) / float(load.sum())


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_bias_update_moves_the_load_toward_balance_and_only_after_applied_steps(router):
    def run(rate: float, steps: int) -> list[float]:
        block = _block(skew=0.2, top_k=2, router=router, balance="bias", bias_update_rate=rate, aux_loss_coef=0.0)
        step, seen = MoeStep(block), []
        for _ in range(steps):
            with torch.no_grad():
                block(x)
            seen.append(_imbalance(block.load))
            assert step.micro_batch_loss() is None  # no auxiliary loss under bias balancing with aux_loss_coef 0
            step.after_step(applied=True)
        assert not block.router.expert_bias.requires_grad
        return seen

    x = _tokens(64, seed=3, shift=0.5)  # skewed: expert 0 takes 46 of the 128 assignments, expert 1 only 20
    block = _block(skew=0.2, top_k=2, router=router, balance="bias", bias_update_rate=0.003, aux_loss_coef=0.0)
    step = MoeStep(block)
    with torch.no_grad():
        block(x)
    step.micro_batch_loss()
    step.after_step(applied=False)  # a skipped step: no update, loads forgotten
    assert not block.router.expert_bias.any() and step.loads == [None]
    seen = run(0.003, 100)
    assert seen[0] > 0.2 and max(seen[-10:]) < seen[0] / 3
    control = run(-0.003, 30)  # negative control: the sign flipped pushes the busy experts up, the skew grows
    assert min(control[-10:]) > seen[0]


def test_bias_counts_loads_over_the_step_and_updates_once_by_sign_times_rate():
    block = _block(top_k=2, balance="bias", bias_update_rate=0.125, aux_loss_coef=0.0)
    step = MoeStep(block)
    loads = []
    for seed in (1, 2):  # two micro-batches of one step
        with torch.no_grad():
            block(_tokens(24, seed=seed))
        loads.append(block.load.double())
        step.micro_batch_loss()
    step.after_step(applied=True)
    load = loads[0] + loads[1]
    assert torch.equal(block.router.expert_bias.double(), 0.125 * torch.sign(load.mean() - load))
    assert not torch.equal(block.router.expert_bias.double(), 0.125 * torch.sign(loads[1].mean() - loads[1]))


def test_bias_chooses_experts_but_never_weighs_them_nor_gets_a_gradient():
    block = _block(top_k=2, balance="bias", num_shared_experts=1)
    with torch.no_grad():
        block.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    x = _tokens().requires_grad_(True)
    out = block(x)
    assert torch.allclose(out, reference(block, x), rtol=TOL, atol=TOL)
    assert not torch.allclose(out, reference(block, x, "bias_in_weights"), rtol=1e-3, atol=1e-3)
    without = _block(top_k=2, balance="aux_loss", num_shared_experts=1)
    assert not torch.equal(block.router(x.detach()).index, without.router(x.detach()).index)  # it changes choices
    out.sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    x2 = x.detach().requires_grad_(True)
    reference(block, x2).sum().backward()
    for n, p in block.named_parameters():  # the same gradients as the reference, whose bias is a plain constant
        assert torch.allclose(grads[n], p.grad, rtol=1e-10, atol=1e-12), n


def test_expert_bias_stays_float32_when_the_model_changes_dtype():
    block = MoeBlock(H, WIDTH, MoeConfig(num_experts=E, balance="bias")).to(torch.bfloat16)
    assert block.router.expert_bias.dtype == torch.float32 and block.router.weight.dtype == torch.bfloat16
    block.router.update_bias(torch.tensor([5.0, 1.0, 1.0, 1.0]))
    assert (
        block.router.expert_bias.tolist()
        == [-0.0010000000474974513, 0.0010000000474974513] + [0.0010000000474974513] * 2
    )


def _kinds(model: LlamaForCausalLM) -> list[str]:
    return ["moe" if isinstance(layer.mlp, MoeBlock) else "dense" for layer in model.layers]


def test_dense_and_moe_layers_alternate_as_asked():
    def build(**moe):
        with torch.device("meta"):
            return LlamaForCausalLM(LlamaConfig(num_layers=4, moe=MoeConfig(num_experts=4, top_k=1, **moe)))

    assert _kinds(build()) == ["moe"] * 4
    assert _kinds(build(layer_interval=2)) == ["moe", "dense", "moe", "dense"]
    assert _kinds(build(layer_interval=3)) == ["moe", "dense", "dense", "moe"]
    assert _kinds(build(layers=(1, 3))) == ["dense", "moe", "dense", "moe"]
    assert all(isinstance(layer.mlp, LlamaMLP) for layer in build(layers=(1, 3)).layers[::2])  # the control
    with torch.device("meta"):
        dense = LlamaForCausalLM(LlamaConfig(num_layers=4))
    assert _kinds(dense) == ["dense"] * 4


def test_num_params_counts_the_experts():
    cfg = LlamaConfig(num_layers=3, moe=MoeConfig(num_experts=4, top_k=2, num_shared_experts=1, layer_interval=2))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    assert cfg.num_params() != LlamaConfig(num_layers=3).num_params()


def test_moe_model_forward_backward_and_its_aux_loss():
    cfg = LlamaConfig(num_layers=2, moe=MoeConfig(num_experts=4, top_k=2, z_loss_coef=1e-3))
    model = LlamaForCausalLM(cfg).double()
    model.init_weights(3)
    step = MoeStep(model)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    aux = step.micro_batch_loss()
    blocks = step.blocks
    assert len(blocks) == 2 and aux is not None
    assert aux.item() == pytest.approx(sum(b.aux_loss.item() for b in blocks), rel=1e-14)
    assert all(int(b.load.sum()) == 2 * 16 * 2 for b in blocks)
    (logits.logsumexp(-1).mean() + aux).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_activation_checkpointing_gives_the_same_gradients_and_counts_each_load_once():
    cfg = LlamaConfig(
        num_layers=2,
        moe=MoeConfig(num_experts=4, top_k=2, aux_loss_coef=0.1, z_loss_coef=0.01, capacity_factor=1.0, balance="bias"),
    )
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(mode: str, with_aux: bool = True):
        model = LlamaForCausalLM(cfg)
        model.init_weights(1)
        model = model.double()
        model.activation_checkpointing = mode
        moe = MoeStep(model)
        loss = model(ids).logsumexp(-1).mean()
        aux = moe.micro_batch_loss()
        (loss + aux if with_aux else loss).backward()  # a recomputed forward runs inside this backward
        return {n: p.grad for n, p in model.named_parameters()}, moe.loads

    grads, loads = step("none")
    for mode in ("full", "selective"):
        got, got_loads = step(mode)
        assert all(torch.allclose(got[n], g, rtol=1e-12, atol=1e-15) for n, g in grads.items()), mode
        assert all(torch.equal(a, b) for a, b in zip(got_loads, loads, strict=True))
    without, _ = step("full", with_aux=False)  # the control: the auxiliary losses left out change the router's
    assert not torch.allclose(without["model.layers.0.mlp.router.weight"], grads["model.layers.0.mlp.router.weight"])


def test_kv_cache_decoding_of_a_dropless_moe_model_equals_full_forwards():
    from kuangchao_core.engine.samples import greedy_decode
    from kuangchao_core.models.kv_cache import KVCacheDecoder

    cfg = LlamaConfig(num_layers=2, moe=MoeConfig(num_experts=4, top_k=2, num_shared_experts=1, layer_interval=2))
    model = LlamaForCausalLM(cfg)
    model.init_weights(5)
    model = model.double().eval()
    with torch.no_grad():  # experts that matter: N(0, 0.02) weights would leave the argmax to the embedding
        for p in model.layers[0].mlp.experts.parameters():
            p.mul_(100.0)
    prompts = [[3, 7, 11, 13], [5, 9, 2, 8]]
    with torch.no_grad():
        plain = greedy_decode(model, prompts, max_new=6, stop_id=-1)
        cached = greedy_decode(None, prompts, max_new=6, stop_id=-1, decoder=KVCacheDecoder(model))
        assert cached == plain and len(plain[0]) == 6
        model.layers[0].mlp.experts.w_down.neg_()  # the control: other experts, other tokens
        assert greedy_decode(None, prompts, max_new=6, stop_id=-1, decoder=KVCacheDecoder(model)) != plain


def test_the_router_computes_in_fp32_under_bf16_autocast():
    block = _block(top_k=2).float()
    x = _tokens().float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = block.router(x)
        out = block(x)
        control = F.linear(x, block.router.weight)  # what autocast does to a plain linear
    assert routing.logits.dtype == torch.float32 and control.dtype == torch.bfloat16
    assert torch.allclose(routing.logits, x @ block.router.weight.detach().T, rtol=1e-6, atol=1e-6)
    assert out.shape == x.shape and torch.isfinite(out).all()
