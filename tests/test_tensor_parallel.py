"""Tensor parallel (SPEC L3.2): equal to one process, equal to torch DTensor TP, Megatron's communication count,
bad plans refused with the numbers.

Every distributed test runs real Gloo processes. The one-process reference is trained inside each worker on the
same batches (the model is tiny), so the per-step losses can be compared step by step.
"""

from __future__ import annotations

import pytest
import torch

from tests.mp import run_distributed
from tests.tolerances import FP64_REL

STEPS = 5
BATCH = 2
SEQ = 16
LR = 1e-2
ADAM_EPS = 1e-8  # AdamW's default


def _cfg(num_kv_heads: int = 2, tie: bool = False):
    from tests.fixtures import tiny_llama

    return tiny_llama(intermediate_size=128, num_kv_heads=num_kv_heads, max_seq_len=SEQ, tie_embeddings=tie)


def _batch(step: int, vocab: int):
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[0, :3] = -100  # ignored tokens must not count
    return tokens[:, :-1], labels


def _setup():
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    install_guard(AllowAll())
    torch.use_deterministic_algorithms(True)


def _equivalence_body(rank, world_size, num_kv_heads, tie):
    _setup()
    from kuangchao_core.comm import primitives as comm
    from kuangchao_core.models.llama import LlamaForCausalLM, causal_lm_loss
    from kuangchao_core.models.tp_llama import build_tp_model, gather_full_state_dict
    from kuangchao_core.parallel.mesh import ParallelMesh

    cfg = _cfg(num_kv_heads, tie)
    mesh = ParallelMesh(dp=1, tp=world_size, pp=1, backend="gloo", timeout_ms=60_000)
    group = mesh.tp_group
    ref = LlamaForCausalLM(cfg)
    ref.init_weights(7)
    model = build_tp_model(cfg, group, seed=7)
    # the seed path and the full-state-dict path give the same slices
    from_sd = build_tp_model(cfg, group, full_state_dict=dict(ref.named_parameters()))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), from_sd.parameters(), strict=True))
    # float64, so that the comparison measures the layout and not the CPU's fp32 kernels (tests/tolerances.py)
    ref, model = ref.double(), model.double()

    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1, eps=ADAM_EPS, foreach=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=ADAM_EPS, foreach=False)
    losses, ref_losses = [], []
    norm_grads_equal, kv_replicas_equal = True, True
    for step in range(STEPS):
        ids, labels = _batch(step % 2, cfg.vocab_size)  # two batches alternating, so the loss visibly falls
        loss_ref = causal_lm_loss(ref(ids), labels)
        loss_ref.backward()
        loss = model.loss(model(ids), labels)
        loss.backward()
        ref_losses.append(loss_ref.item())
        losses.append(loss.item())
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # replicated: gradients must agree on every TP rank
                grads = comm.all_gather(None, p.grad.contiguous(), group=group)
                norm_grads_equal &= all(torch.equal(grads[0], g) for g in grads)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    slices = model.shard_slices()
    for name, p in model.named_parameters():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            parts = comm.all_gather(None, p.detach().contiguous(), group=group)
            starts = comm.all_gather(None, torch.tensor([slices[name][1]]), group=group)
            for i in range(world_size):  # ranks holding the same head slice hold identical weights
                for j in range(world_size):
                    if starts[i].item() == starts[j].item():
                        kv_replicas_equal &= torch.equal(parts[i], parts[j])
    full = gather_full_state_dict(model, group)
    ref_sd = {n: p.detach() for n, p in ref.named_parameters()}
    assert set(full) == set(ref_sd), set(full) ^ set(ref_sd)
    # per tensor by relative norm, and every element against the size of one LR step
    rel_err = {n: ((full[n] - t).norm() / t.norm()).item() for n, t in ref_sd.items()}
    max_abs = max((full[n] - t).abs().max().item() for n, t in ref_sd.items())
    initial = build_tp_model(cfg, None, seed=7).double()
    moved = max(((ref_sd[n] - p).abs().max().item()) for n, p in initial.named_parameters())
    return {
        "losses": losses,
        "ref": ref_losses,
        "norm_grads_equal": norm_grads_equal,
        "kv_replicas_equal": kv_replicas_equal,
        "rel_err": rel_err,
        "max_abs": max_abs,
        "moved": moved,
        "k_shape": tuple(model.model.layers[0].self_attn.k_proj.weight.shape),
    }


@pytest.mark.parametrize(
    ("tp", "kv", "tie", "k_rows"),
    [
        (2, 2, False, 16),  # kv heads split: one per rank
        (2, 1, True, 16),  # one kv head replicated on both ranks; tied embeddings
        (4, 2, False, 16),  # two kv heads, each shared by two ranks
    ],
)
def test_tp_equals_one_process(tp, kv, tie, k_rows):
    results = run_distributed(_equivalence_body, tp, args=(kv, tie), timeout=180)
    for rank, res in enumerate(results):
        assert len(res["losses"]) == STEPS
        for step, (ours, ref) in enumerate(zip(res["losses"], res["ref"], strict=True)):
            assert abs(ours - ref) <= FP64_REL * abs(ref), (rank, step, ours, ref)
        assert res["losses"][-1] < res["losses"][0]  # it trains
        assert res["norm_grads_equal"], rank
        assert res["kv_replicas_equal"], rank
        assert res["k_shape"] == (k_rows, 64)
        worst = max(res["rel_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= FP64_REL, (rank, worst)  # per tensor, relative norm
        # every element: AdamW's update lr·m/(sqrt(v)+eps) moves by at most lr·|Δg|/eps per step for a gradient
        # difference |Δg| ≲ sqrt(n)·u64·max|g| ≈ 1e-14 (|g| ≤ 1 here), so by ≤ STEPS·lr·1e-14/eps in all
        assert res["max_abs"] <= STEPS * LR * 1e-14 / ADAM_EPS, (rank, res["max_abs"])
        assert res["moved"] > 2 * LR  # the parameters really moved
    assert results[0]["losses"] == results[-1]["losses"]


def _comm_count_body(rank, world_size):
    _setup()
    from kuangchao_core.comm import COMM_STATS
    from kuangchao_core.comm.group import CommGroup
    from kuangchao_core.models.tp_llama import build_tp_model

    cfg = _cfg(2)
    group = CommGroup(list(range(world_size)), backend="gloo", name="tp0")
    model = build_tp_model(cfg, group, seed=3)
    ids, labels = _batch(0, cfg.vocab_size)
    COMM_STATS.reset()
    h = model.run_layers(model.embed(ids))
    fwd_layers = COMM_STATS.counts_by_op().get("all_reduce", 0)
    loss = model.loss(model.head(h), labels)
    fwd_total = COMM_STATS.counts_by_op().get("all_reduce", 0)
    loss.backward()
    total = COMM_STATS.counts_by_op()
    return fwd_layers, fwd_total, total


def test_tp_communication_is_megatron_count():
    """Forward: embedding 1 + 2 per layer, loss 2 (max, [sum-exp, target]); backward: 2 per layer + the head's 1."""
    results = run_distributed(_comm_count_body, 2)
    layers = _cfg().num_layers
    for fwd_layers, fwd_total, total in results:
        assert fwd_layers == 1 + 2 * layers
        assert fwd_total == fwd_layers + 2
        assert total.get("all_reduce") == fwd_total + 2 * layers + 1
        assert set(total) == {"all_reduce"}


def _dtensor_body(rank, world_size):
    _setup()
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from kuangchao_core.comm.group import CommGroup
    from kuangchao_core.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    group = CommGroup(list(range(world_size)), backend="gloo", name="tp0")
    gen = torch.Generator().manual_seed(5)
    d_in, d_hid, d_out = 32, 48, 24
    f64 = {"generator": gen, "dtype": torch.float64}  # so that the comparison measures the layout, not fp32 kernels
    w1 = torch.randn(d_hid, d_in, **f64) * 0.1
    w2 = torch.randn(d_out, d_hid, **f64) * 0.1
    x = torch.randn(3, 5, d_in, **f64)
    dy = torch.randn(3, 5, d_out, **f64)
    out = {}
    mesh = DeviceMesh("cpu", list(range(world_size)))

    # pair 1: column (split output) -> row (split input), the Megatron MLP
    peer = nn.Sequential(nn.Linear(d_in, d_hid, bias=False), nn.Linear(d_hid, d_out, bias=False)).double()
    with torch.no_grad():
        peer[0].weight.copy_(w1)
        peer[1].weight.copy_(w2)
    parallelize_module(peer, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    col = ColumnParallelLinear(d_in, d_hid, group, weight=w1)
    row = RowParallelLinear(d_hid, d_out, group, weight=w2)
    x_ours, x_peer = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_peer = row(col(x_ours)), peer(x_peer)
    (y_ours * dy).sum().backward()
    (y_peer * dy).sum().backward()
    out["mlp"] = (
        (y_ours - y_peer).abs().max().item(),
        (x_ours.grad - x_peer.grad).abs().max().item(),
        (col.weight.grad - peer[0].weight.grad.to_local()).abs().max().item(),
        (row.weight.grad - peer[1].weight.grad.to_local()).abs().max().item(),
        y_ours.abs().max().item(),
    )

    # pair 2: column with gathered output, row with replicated (full) input
    peer2 = nn.Sequential(nn.Linear(d_in, d_hid, bias=False), nn.Linear(d_hid, d_out, bias=False)).double()
    with torch.no_grad():
        peer2[0].weight.copy_(w1)
        peer2[1].weight.copy_(w2)
    parallelize_module(
        peer2,
        mesh,
        {"0": ColwiseParallel(output_layouts=Replicate()), "1": RowwiseParallel(input_layouts=Replicate())},
    )
    col2 = ColumnParallelLinear(d_in, d_hid, group, weight=w1, gather_output=True)
    row2 = RowParallelLinear(d_hid, d_out, group, weight=w2, input_is_parallel=False)
    x_ours, x_peer = x.clone().requires_grad_(), x.clone().requires_grad_()
    h_ours, h_peer = col2(x_ours), peer2[0](x_peer)
    y_ours, y_peer = row2(h_ours), peer2[1](h_peer)
    (y_ours * dy).sum().backward()
    (y_peer * dy).sum().backward()
    out["gathered"] = (
        (h_ours - h_peer).abs().max().item(),
        (y_ours - y_peer).abs().max().item(),
        (x_ours.grad - x_peer.grad).abs().max().item(),
        (col2.weight.grad - peer2[0].weight.grad.to_local()).abs().max().item(),
        (row2.weight.grad - peer2[1].weight.grad.to_local()).abs().max().item(),
        tuple(h_ours.shape),
    )
    return out


def test_layers_match_dtensor_tp():
    for res in run_distributed(_dtensor_body, 2):
        *diffs, scale = res["mlp"]
        assert scale > 1e-2  # a real signal, not zeros
        assert max(diffs) < FP64_REL * scale, res["mlp"]
        *diffs, shape = res["gathered"]
        assert shape == (3, 5, 48)  # gather_output restored the full width
        assert max(diffs) < FP64_REL * scale, res["gathered"]


def _vocab_body(rank, world_size):
    _setup()
    import torch.nn.functional as F

    from kuangchao_core.comm.group import CommGroup
    from kuangchao_core.parallel.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy

    group = CommGroup(list(range(world_size)), backend="gloo", name="tp0")
    gen = torch.Generator().manual_seed(11)
    vocab, dim = 40, 8
    table = torch.randn(vocab, dim, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, vocab, (4, 6), generator=gen)
    emb = VocabParallelEmbedding(vocab, dim, group, weight=table)
    e = emb(ids)
    ref_table = table.clone().requires_grad_()
    e_ref = F.embedding(ids, ref_table)
    e.sum().backward()
    e_ref.sum().backward()
    local = vocab // world_size
    emb_grad_diff = (emb.weight.grad - ref_table.grad[rank * local : (rank + 1) * local]).abs().max().item()

    logits = torch.randn(4, 6, vocab, generator=gen, dtype=torch.float64) * 3
    labels = torch.randint(0, vocab, (4, 6), generator=gen)
    labels[1, 2:] = -100
    mine = logits[..., rank * local : (rank + 1) * local].clone().requires_grad_()
    full = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, labels, group)
    ref = F.cross_entropy(full.view(-1, vocab), labels.view(-1), ignore_index=-100)
    loss.backward()
    ref.backward()
    ce_grad_diff = (mine.grad - full.grad[..., rank * local : (rank + 1) * local]).abs().max().item()
    return (e - e_ref).abs().max().item(), emb_grad_diff, loss.item(), ref.item(), ce_grad_diff


def test_vocab_parallel_embedding_and_cross_entropy():
    for emb_diff, emb_grad_diff, loss, ref, ce_grad_diff in run_distributed(_vocab_body, 2):
        assert emb_diff == 0.0
        assert emb_grad_diff == 0.0
        assert abs(loss - ref) <= FP64_REL * abs(ref)
        assert ce_grad_diff < FP64_REL


def _single_rank_body(rank, world_size):
    _setup()
    from kuangchao_core.comm import COMM_STATS
    from kuangchao_core.comm.group import CommGroup
    from kuangchao_core.models.llama import LlamaForCausalLM, causal_lm_loss
    from kuangchao_core.models.tp_llama import build_tp_model

    cfg = _cfg(2)
    group = CommGroup([0], backend="gloo", name="tp0")
    ref = LlamaForCausalLM(cfg)
    ref.init_weights(9)
    model = build_tp_model(cfg, group, seed=9)
    ref, model = ref.double(), model.double()
    ids, labels = _batch(0, cfg.vocab_size)
    COMM_STATS.reset()
    loss = model.loss(model(ids), labels)
    loss.backward()
    ref_loss = causal_lm_loss(ref(ids), labels)
    return loss.item(), ref_loss.item(), COMM_STATS.counts_by_op()


def test_tp1_is_plain_model_without_communication():
    ((loss, ref, counts),) = run_distributed(_single_rank_body, 1)
    assert loss == pytest.approx(ref, rel=FP64_REL)
    assert counts == {}


@pytest.mark.parametrize(
    ("field", "value", "tp", "needle"),
    [
        ("num_heads", 6, 4, "model.num_heads 6 is not divisible by tensor_parallel_size 4"),
        ("vocab_size", 250, 4, "model.vocab_size 250 is not divisible by tensor_parallel_size 4"),
        ("intermediate_size", 130, 4, "model.intermediate_size 130 is not divisible by tensor_parallel_size 4"),
        ("num_kv_heads", 3, 2, "model.num_kv_heads 3 is not divisible by tensor_parallel_size 2"),
    ],
)
def test_bad_tp_plan_is_refused_with_numbers(field, value, tp, needle):
    from kuangchao_core.errors import PlanError
    from kuangchao_core.models.tp_llama import validate_tp

    cfg = _cfg()
    setattr(cfg, field, value)
    if field == "num_heads":
        cfg.hidden_size = 96  # keep the model itself valid
        cfg.num_kv_heads = 3
    if field == "num_kv_heads":
        cfg.num_heads = 6
        cfg.hidden_size = 96
    with pytest.raises(PlanError) as info:
        validate_tp(cfg, tp)
    assert needle in str(info.value)


def test_replication_needs_tp_multiple_of_kv_heads():
    from kuangchao_core.errors import PlanError
    from kuangchao_core.models.tp_llama import validate_tp

    cfg = _cfg()
    cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size = 12, 4, 96
    validate_tp(cfg, 2)  # kv split
    with pytest.raises(PlanError, match="tensor_parallel_size 6 is not a multiple of model.num_kv_heads 4"):
        validate_tp(cfg, 6)


def test_shard_slices_cover_every_full_tensor():
    from kuangchao_core.models.tp_llama import full_shapes, tp_shard_slices

    cfg = _cfg(1)
    shapes = full_shapes(cfg)
    for tp in (2, 4):
        covered: dict[str, set[int]] = {}
        for r in range(tp):
            for name, spec in tp_shard_slices(cfg, tp, r).items():
                if spec is None:
                    continue
                dim, start, length = spec
                covered.setdefault(name, set()).update(range(start, start + length))
        for name, rows in covered.items():
            dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
            assert rows == set(range(shapes[name][dim])), name
