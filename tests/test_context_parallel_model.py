"""The tiny Llama under context parallelism equals one process (issue 30, item 2: the pieces the trainer uses;
the trainer itself is tests/test_engine_cp.py).

Real Gloo processes at cp2 and cp4, float64. Each rank builds the same tiny model (``tests.fixtures.tiny_llama``:
hidden 64, 2 layers, 4 query and 2 K/V heads) and the same batch (2 rows of 32 tokens), keeps its shard of the
batch (``parallel.context.shard_inputs``: ids, labels, rotary positions, document ids), runs the model with its
attention set to ring attention (``models.ring_attention.use_attention`` with ``cp_attention``, the trainer's
hook), and takes the loss over the global batch's trained tokens: its local sum divided by the global count.
Gradients of the (replicated) parameters are summed over the CP group, as the trainer reduces them over dp×cp. The gathered logits and the reduced
gradients equal one process's within ``FP64_REL`` (tests/tolerances.py: the same sums blocked differently, see
tests/test_ring_attention.py for the attention's share), with plain sequences and with packed documents (the
packer's per-document rotary positions, boundaries across shards).

Negative control: rotary positions 0..n-1 on every rank (the shard's local positions, not the tokens' global
ones) moves logits and gradients by far more than ``NEGATIVE_MIN``.
"""

from __future__ import annotations

import pytest

from tests.mp import run_distributed
from tests.tolerances import FP64_REL, NEGATIVE_MIN, rel_norm, worst_rel

B, S = 2, 32


def _batch(packed: bool):
    import torch

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 256, (B, S + 1), generator=g)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:].clone()}
    batch["labels"][0, :3] = -100  # untrained tokens: the global count, not the local one, divides
    if packed:
        seg = torch.zeros(B, S, dtype=torch.long)
        for row, cuts in enumerate(([5, 13, 14, 27], [9, 17, 30])):
            for cut in cuts:
                seg[row, cut:] += 1
        starts = [[int((seg[r] == i).nonzero()[0]) for i in range(int(seg[r].max()) + 1)] for r in range(B)]
        pos = torch.stack([torch.arange(S) - torch.tensor(starts[r])[seg[r]] for r in range(B)])
        batch.update(segment_ids=seg, position_ids=pos)
    return batch


def _loss(model, batch, count):
    import torch.nn.functional as F

    logits = model(batch["input_ids"], batch.get("position_ids"), batch.get("segment_ids"))
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")
    return logits, loss / count


def _model():
    import torch

    from kuangchao_core.models.llama import LlamaForCausalLM
    from tests.fixtures import tiny_llama

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama(max_seq_len=S)).double()
    model.init_weights(0)
    return model


def _run(rank: int, world_size: int, packed: bool, sabotage: bool) -> dict:
    import torch

    from kuangchao_core.comm import primitives as P
    from kuangchao_core.comm.group import CommGroup, init_distributed
    from kuangchao_core.models.ring_attention import cp_attention, use_attention
    from kuangchao_core.parallel.context import gather_sequence, local_positions, shard_inputs
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    init_distributed(backend="gloo", timeout_ms=60_000)
    group = CommGroup(list(range(world_size)), backend="gloo", timeout_ms=60_000, name="cp")
    batch = _batch(packed)
    count = int((batch["labels"] != -100).sum())  # the global batch's trained tokens

    ref = _model()
    ref_logits, ref_loss = _loss(ref, batch, count)
    ref_loss.backward()

    model = _model()
    local = shard_inputs(batch, world_size, rank)
    if sabotage:
        local["position_ids"] = torch.arange(S // world_size).expand(B, -1)
    use_attention(model, cp_attention(group, local_positions(S, world_size, rank)))  # the trainer's hook
    logits, loss = _loss(model, local, count)
    loss.backward()
    for p in model.parameters():
        P.all_reduce(p.grad, group=group)
    loss_sum = P.all_reduce(loss.detach().clone(), group=group)
    grads = {n: p.grad for n, p in model.named_parameters()}
    name, grad_rel = worst_rel(grads, {n: p.grad for n, p in ref.named_parameters()})
    return {
        "logits": rel_norm(gather_sequence(logits.detach(), group, dim=1), ref_logits.detach()),
        "loss": abs(float(loss_sum) - float(ref_loss.detach())) / abs(float(ref_loss.detach())),
        "grad": grad_rel,
        "worst_grad": name,
    }


@pytest.mark.parametrize("cp", [2, 4])
def test_tiny_llama_under_context_parallelism_equals_one_process(cp):
    for packed in (False, True):
        for rank, r in enumerate(run_distributed(_run, cp, args=(packed, False))):
            assert max(r["logits"], r["loss"], r["grad"]) <= FP64_REL, (cp, packed, rank, r)
    if cp == 2:  # control: the shard's local rotary positions instead of the tokens' global ones
        for r in run_distributed(_run, cp, args=(False, True)):
            assert min(r["logits"], r["grad"]) >= NEGATIVE_MIN, r
