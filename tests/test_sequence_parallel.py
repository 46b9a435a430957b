"""Sequence parallelism with tensor parallelism (issue 30 part 3): the TP model with ``sequence_parallel`` computes
what one process computes, in float64, and really holds s/tp positions between the blocks.

The model-level check (2 Gloo processes, each also running the one-process model on the same batches): one
optimizer step accumulated over two micro-batches — a plain causal one and one of packed documents (positions that
restart, segments across the shard boundary) — then a second step. Losses, every gradient after the accumulation
(each rank's slice of the full gradient) and the parameters after two AdamW steps must match within ``FP64_REL``
(tests/tolerances.py: the layouts compute the same sums in another order, ~1e-14 relative; 1e-10 leaves three
orders above that, and a wrong reduction moves a gradient by O(1) relative). Comparing gradients, not only AdamW's
nearly scale-free updates, is what catches a norm-weight gradient summed twice as well as one never summed.

Negative control: the same run with the norm weights' gradient sum over TP removed (``sum_weight_grad_over_tp``
made the identity) must fail the gradient comparison by ≥ ``NEGATIVE_MIN``.

The engine-level runs (tp2 and pp2×tp2 with ``parallel.sequence_parallel``, against the one-process job) are in
``tests/test_sequence_parallel_engine.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.mp import run_distributed
from tests.tolerances import FP64_REL, NEGATIVE_MIN

SEQ = 16
BATCH = 2
LR = 1e-2


def _cfg():
    from tests.fixtures import tiny_llama

    return tiny_llama(intermediate_size=128, num_kv_heads=2, max_seq_len=SEQ)


def _micro_batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    """A plain causal micro-batch and one of packed documents whose boundaries cross the shard boundary (s/2)."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for docs in (False, True):
        ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
        labels = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
        labels[0, :3] = -100
        batch = {"input_ids": ids, "labels": labels}
        if docs:
            lengths = ([5, 7, 4], [9, 7])
            batch["segment_ids"] = torch.stack(
                [torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths]
            )
            batch["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
        out.append(batch)
    return out


def _train(model, loss_fn, batches, steps: int = 2):
    """``steps`` AdamW steps, each accumulating ``batches``; returns (losses, gradients after the first step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    losses, first_grads = [], None
    for _ in range(steps):
        for b in batches:
            extras = {k: b[k] for k in ("position_ids", "segment_ids") if k in b}
            loss = loss_fn(model(b["input_ids"], **extras), b["labels"]) / len(batches)
            loss.backward()
            losses.append(loss.item())
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, first_grads


def _worst(got: dict, want: dict, slices: dict) -> tuple[str, float]:
    """The tensor whose rank slice differs most from the full tensor's slice (relative norm)."""
    worst = ("", 0.0)
    for name, full in want.items():
        spec = slices[name]
        ref = full if spec is None else full.narrow(*spec)
        rel = ((got[name] - ref).norm() / ref.norm()).item()
        worst = max(worst, (name, rel), key=lambda kv: kv[1])
    return worst


def _run(cfg, group, batches, ref_losses, ref_grads, ref_params, sp: bool = True, recompute: str = "none"):
    from kuangchao_core.models.tp_llama import TPLlamaForCausalLM, init_from_seed

    model = TPLlamaForCausalLM(cfg, group, sequence_parallel=sp)
    model.activation_checkpointing = recompute
    init_from_seed(model, 7)
    model = model.double()
    shapes: list[tuple[int, ...]] = []
    hook = model.model.layers[0].register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out.shape)))
    losses, grads = _train(model, model.loss, batches)
    hook.remove()
    slices = model.shard_slices()
    params = {n: p.detach() for n, p in model.named_parameters()}
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    return {
        "loss_diff": loss_diff,
        "grad": _worst(grads, ref_grads, slices),
        "param": _worst(params, ref_params, slices),
        "block_output_shape": shapes[0],
        "model": model,
    }


MEASURE_SEQ, MEASURE_BATCH, MEASURE_LAYERS = 512, 2, 2


def _saved_bytes(group) -> dict:
    """What the decoder layers' forward leaves for the backward (fp32, s=512), counted from the autograd graph itself
    (the C heap and the allocator's records also hold Gloo's in-flight buffers, which its worker threads release
    at times of their own): for plain TP and SP without the re-gather, the bytes of every distinct storage the
    forward saves (a pass-through saved-tensor hook sees each); for SP, which gathered norm outputs the re-gather
    let go of (each weakly referenced when registered) and the bytes that freed, full minus the shard kept."""
    import gc
    import weakref

    from kuangchao_core.models.tp_llama import TPLlamaForCausalLM, init_from_seed
    from tests.fixtures import tiny_llama

    cfg = tiny_llama(intermediate_size=128, max_seq_len=MEASURE_SEQ, num_layers=MEASURE_LAYERS)
    ids = torch.randint(0, cfg.vocab_size, (MEASURE_BATCH, MEASURE_SEQ), generator=torch.Generator().manual_seed(3))
    out: dict = {}
    for name in ("tp", "sp_without_regather", "sp"):
        model = TPLlamaForCausalLM(cfg, group, sequence_parallel=name != "tp")
        init_from_seed(model, 7)
        storages: dict[int, int] = {}
        registered = []
        if name == "sp_without_regather":
            model.regather.enabled = False
        if model.regather is not None:
            register = model.regather.register

            def observe(shard, full, register=register, registered=registered):
                registered.append((weakref.ref(full), full.nbytes - shard.nbytes))
                register(shard, full)

            model.regather.register = observe

        def pack(t, storages=storages):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        h = model.embed(ids).detach().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = model.run_layers(h)
        gc.collect()
        storages.pop(h.untyped_storage().data_ptr(), None)
        released = [freed for full, freed in registered if full() is None]
        out[name] = {"saved": sum(storages.values()), "gathered": len(registered), "released": released}
        y.sum().backward()  # collective: every rank runs it
        del y
    return out


def _body(rank, world_size):
    from kuangchao_core.comm.group import CommGroup
    from kuangchao_core.models.llama import LlamaForCausalLM, causal_lm_loss
    from kuangchao_core.parallel import sequence
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    install_guard(AllowAll())
    torch.use_deterministic_algorithms(True)
    cfg = _cfg()
    group = CommGroup(list(range(world_size)), backend="gloo", name="tp0")
    batches = _micro_batches(cfg.vocab_size)
    ref = LlamaForCausalLM(cfg)
    ref.init_weights(7)
    ref = ref.double()
    ref_losses, ref_grads = _train(ref, causal_lm_loss, batches)
    ref_params = {n: p.detach() for n, p in ref.named_parameters()}
    honest = _run(cfg, group, batches, ref_losses, ref_grads, ref_params)
    # greedy decoding asks for lengths tensor_parallel_size does not divide: padded, the real logits unchanged
    model = honest.pop("model")
    ids = batches[0]["input_ids"][:, :7]
    with torch.no_grad():
        odd = model.gather_logits(model(ids))
        want = ref(ids)
    odd_diff = ((odd - want).norm() / want.norm()).item()
    real = sequence.sum_weight_grad_over_tp
    sequence.sum_weight_grad_over_tp = lambda weight, _group: weight  # the sabotage: norm gradients left unsummed
    try:
        broken = _run(cfg, group, batches, ref_losses, ref_grads, ref_params)
        broken.pop("model")
    finally:
        sequence.sum_weight_grad_over_tp = real
    recomputed = {
        mode: _run(cfg, group, batches, ref_losses, ref_grads, ref_params, recompute=mode)["grad"]
        for mode in ("full", "selective")
    }
    plain_tp = _run(cfg, group, batches, ref_losses, ref_grads, ref_params, sp=False)["block_output_shape"]
    return {
        "saved": _saved_bytes(group),
        "honest": honest,
        "recomputed": recomputed,
        "broken": broken,
        "odd_diff": odd_diff,
        "odd_shape": tuple(odd.shape),
        "plain_tp_block_output_shape": plain_tp,
    }


@pytest.fixture(scope="module")
def results():
    return run_distributed(_body, 2, timeout=180)


def test_tp2_with_sequence_parallel_equals_one_process_in_fp64(results):
    for rank, res in enumerate(results):
        honest = res["honest"]
        assert honest["loss_diff"] <= FP64_REL, (rank, honest["loss_diff"])
        assert honest["grad"][1] <= FP64_REL, (rank, honest["grad"])
        assert honest["param"][1] <= FP64_REL, (rank, honest["param"])
        print(f"rank {rank}: losses {honest['loss_diff']:.1e}, worst gradient {honest['grad']}, "
              f"worst parameter {honest['param']}")  # fmt: skip


def test_recomputation_repeats_the_sequence_collectives_and_keeps_the_gradients(results):
    """Full and selective activation checkpointing rerun each layer's gathers in the backward: same gradients."""
    for res in results:
        for mode, (name, diff) in res["recomputed"].items():
            assert diff <= FP64_REL, (mode, name, diff)


def test_activations_between_blocks_hold_s_over_tp_positions(results):
    """Each TP rank's residual stream between blocks holds s/tp positions with sequence parallelism (control: the same
    TP model without it holds all s)."""
    for res in results:
        assert res["honest"]["block_output_shape"] == (BATCH, SEQ // 2, 64)
        assert res["plain_tp_block_output_shape"] == (BATCH, SEQ, 64)


def test_sequence_parallel_holds_fewer_activation_bytes(results):
    """What a layer keeps for its backward (Megatron's count, Korthikanti et al. 2022): SP divides the norms' inputs
    and outputs, 4h elements per token, by tp. The norms' inputs are the residual stream, saved by the norms
    themselves: SP without the re-gather already saves at least 2h(1 - 1/tp) elements per token per layer fewer
    than TP. The norms' outputs are what q/k/v and gate/up save; the re-gather keeps each as its shard, so each
    layer's two gathered outputs are let go of in the forward, h(1 - 1/tp) elements per token each. Without the
    re-gather none is (the negative control). fp32: 4 bytes an element."""
    h, tp = 64, 2
    per_element = MEASURE_SEQ * MEASURE_BATCH * MEASURE_LAYERS * 4
    for res in results:
        got = res["saved"]
        tp_run, without, sp = got["tp"], got["sp_without_regather"], got["sp"]
        assert tp_run["saved"] - without["saved"] >= 2 * h * (1 - 1 / tp) * per_element, got
        assert sp["gathered"] == without["gathered"] == 2 * MEASURE_LAYERS, got
        assert sum(sp["released"]) == 2 * h * (1 - 1 / tp) * per_element, got
        assert without["released"] == [], got
        released = sum(sp["released"])
        print(f"saved bytes: tp {tp_run['saved']}, sp without the re-gather {without['saved']}; released {released}")


def test_a_length_tp_does_not_divide_is_padded_and_gives_the_real_logits(results):
    for res in results:
        assert res["odd_shape"] == (BATCH, 7, 256)
        assert res["odd_diff"] <= FP64_REL, res["odd_diff"]


def test_negative_control_unsummed_norm_weight_gradients_fail(results):
    for rank, res in enumerate(results):
        name, diff = res["broken"]["grad"]
        assert "norm" in name and diff >= NEGATIVE_MIN, (rank, name, diff)
        print(f"rank {rank}: without the TP sum {name} differs by {diff:.2e} (tolerance {FP64_REL:.0e})")


def _comm_count_body(rank, world_size):
    from kuangchao_core.comm import COMM_STATS
    from kuangchao_core.comm.group import CommGroup
    from kuangchao_core.models.tp_llama import TPLlamaForCausalLM, init_from_seed
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    install_guard(AllowAll())
    cfg = _cfg()
    model = TPLlamaForCausalLM(cfg, CommGroup(list(range(world_size)), backend="gloo", name="tp0"), True)
    init_from_seed(model, 3)
    batch = _micro_batches(cfg.vocab_size)[0]
    COMM_STATS.reset()
    h = model.run_layers(model.embed(batch["input_ids"]))
    layers = dict(COMM_STATS.counts_by_op())
    loss = model.loss(model.head(h), batch["labels"])
    forward = dict(COMM_STATS.counts_by_op())
    loss.backward()
    return layers, forward, dict(COMM_STATS.counts_by_op())


def test_sequence_parallel_communication_is_megatrons():
    """Forward: the embedding's reduce-scatter, per layer two all-gathers (before q/k/v and gate/up) and two
    reduce-scatters (after o_proj and down), the head's all-gather, the loss's two all-reduces. Backward: each
    conjugate (an all-gather for each reduce-scatter and back), the re-gather of the two saved norm outputs per layer,
    and one all-reduce per norm weight (2L + 1)."""
    n = _cfg().num_layers
    for layers, forward, total in run_distributed(_comm_count_body, 2):
        assert layers == {"all_gather": 2 * n, "reduce_scatter": 1 + 2 * n}
        assert forward == {"all_gather": 2 * n + 1, "reduce_scatter": 1 + 2 * n, "all_reduce": 2}
        assert total == {"all_gather": (2 * n + 1) + (2 * n + 1) + 2 * n, "reduce_scatter": 2 * (2 * n + 1),
                         "all_reduce": 2 + 2 * n + 1}  # fmt: skip
