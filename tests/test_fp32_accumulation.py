"""bf16 parameters accumulate the micro-batches' gradients in fp32 (``train.param_dtype: bf16`` at ZeRO-0/1/2,
Megatron-Core's ``main_grad``): the fp32 gradient the optimizer receives is the fp32 sum of the micro-batches'
individual bf16 gradients, averaged over the DP group.

Reference: every process holds the same bf16 model, so it computes the bf16 gradient of every micro-batch of every
DP rank by itself (``torch.autograd.grad`` on the engine's forward and loss: the same graph, so bitwise the
gradient the engine's backward hands its hooks) and sums those K gradients in float64, divided by the DP size N.
Under a pipeline (pp2, dp1) a micro-batch's gradient is the engine's own fp32 buffer after a step of that one
micro-batch beside one without labels (one bf16 gradient, widened exactly, plus exact zeros).

Bound: each bf16 gradient is exact in fp32, so the engine's only roundings are the fp32 additions of K terms (local
accumulation, then the DP sum, in whatever tree the collective uses: every tree of K leaves has depth ≤ K − 1) and
the division by N = 2 (exact). Per element |got − exact| ≤ γ_{K−1}·Σ_k |g_k|, γ_n = n·u/(1 − n·u), u = 2^-24.
Negative control: bf16 accumulation restored (``data.accumulate_grad`` rounding each partial sum to bf16, as
``param.grad += g`` in bf16 did): each addition then rounds by up to 2^-9 relative, ~10^4 times u, and the check
misses the bound by more than 10x.
"""

from __future__ import annotations

import contextlib

import torch

from tests.engine_helpers import tiny_job
from tests.mp import run_distributed

M = 8  # micro-batches per DP rank: enough for bf16's rounding to add up
U32 = 2.0**-24


def _bf16_accumulate(dst: torch.Tensor, grad: torch.Tensor) -> None:
    """The sabotage: every partial sum rounded to bf16, as autograd accumulates a bf16 ``param.grad``."""
    dst.copy_((dst + grad.reshape(dst.shape).float()).to(torch.bfloat16))


def _batches(vocab: int, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        ids = torch.randint(vocab, (2, 16), generator=g)
        out.append({"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)})
    return out


def _received(sync) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{name: (flat element indices, fp32 gradient there)}`` of what this rank's optimizer receives."""
    if hasattr(sync, "masters"):  # zero_stage 0: the masters' gradients (views of the fp32 buckets)
        return {n: (torch.arange(m.numel()), m.grad.reshape(-1).clone()) for n, m in sync.masters.items()}
    opt = sync.optimizer
    shards = opt.grad_shards()
    got: dict[str, list] = {}
    for slot, lo, hi, off in opt.owned_pieces():
        idx, vals = got.setdefault(slot.name, [[], []])
        idx.append(torch.arange(lo, hi))
        vals.append(shards[slot.bucket][off : off + hi - lo].clone())
    return {n: (torch.cat(i), torch.cat(v)) for n, (i, v) in got.items()}


def _reference(trainer, batches, weight) -> list[dict[str, torch.Tensor]]:
    """Each micro-batch's bf16 gradient, computed alone on this process's bf16 model."""
    from kuangchao_core.parallel.forward_backward import model_inputs
    from kuangchao_core.parallel.step_loss import weighted_loss

    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    autocast = trainer.precision.autocast if trainer.precision.enabled else contextlib.nullcontext
    out = []
    for b in batches:
        with autocast():
            loss = weighted_loss(
                trainer.parts.loss_fn, trainer.model(b["input_ids"], **model_inputs(b)), b, len(batches), weight
            )
        grads = torch.autograd.grad(loss, [p for _, p in named])
        assert all(g.dtype == torch.bfloat16 for g in grads)
        out.append({n: g.detach().clone() for (n, _), g in zip(named, grads, strict=True)})
    return out


def _pipeline_reference(trainer, batches, weight) -> list[dict[str, torch.Tensor]]:
    """Each micro-batch's gradient from a pipelined step of that micro-batch (dp1: nothing reduced) and one whose
    labels are all ignored (1F1B needs as many micro-batches as stages; its gradient is exactly zero)."""
    out = []
    for b in batches:
        blank = {"input_ids": b["input_ids"], "labels": torch.full_like(b["labels"], -100)}
        trainer.sync.zero_grad()
        trainer.forward_backward(trainer.sync, [b, blank], weight)
        got = _received(trainer.sync)
        out.append({n: v for n, (_, v) in got.items()})
    return out


def _check(rank: int, world_size: int, jobs: list) -> list[dict[str, float]]:
    """Per job, the largest |got − exact| / bound over this rank's gradient elements."""
    from kuangchao_core.parallel import data
    from tests.engine_helpers import trainer_in_process

    real = data.accumulate_grad
    out = []
    for cfg, sabotage in jobs:
        trainer = trainer_in_process(cfg, rank, world_size)
        trainer.sync.prepare()
        mesh = trainer.mesh
        everyone = _batches(trainer.model_config.vocab_size, M * mesh.dp)
        mine = everyone[mesh.dp_rank * M : (mesh.dp_rank + 1) * M]
        weight = torch.tensor(1.0 / (M * mesh.dp * 32), dtype=torch.float64)
        if mesh.pp > 1:
            refs = _pipeline_reference(trainer, everyone, weight)
        else:
            refs = _reference(trainer, everyone, weight)
        data.accumulate_grad = _bf16_accumulate if sabotage else real
        try:
            trainer.sync.zero_grad()
            trainer.forward_backward(trainer.sync, mine, weight)
        finally:
            data.accumulate_grad = real
        k = len(everyone)
        gamma = (k - 1) * U32 / (1 - (k - 1) * U32)
        worst = 0.0
        for name, (idx, got) in _received(trainer.sync).items():
            parts = torch.stack([r[name].reshape(-1)[idx].double() for r in refs]) if mesh.pp == 1 else None
            if parts is None:  # the pipeline reference is already this rank's elements, in fp32
                parts = torch.stack([r[name].double() for r in refs])
            exact = parts.sum(0) / mesh.dp
            bound = gamma * parts.abs().sum(0) / mesh.dp
            err = (got.double() - exact).abs()
            worst = max(worst, float((err / bound.clamp(min=1e-300)).max()))
        out.append(worst)
        trainer.barrier()
    return out


def _job(tmp, name, **parallel):
    return tiny_job(
        str(tmp / name),
        task={"name": name, "seed": 7},
        parallel={"micro_batch_size": 2, "gradient_accumulation_steps": M, **parallel},
        train={"dtype": "bf16", "param_dtype": "bf16", "steps": 1},
    )


def test_dp1_accumulates_in_fp32(tmp_path):
    jobs = [(_job(tmp_path, "dp1"), False), (_job(tmp_path, "dp1-bf16"), True)]
    ok, sabotaged = run_distributed(_check, 1, args=(jobs,), timeout=120)[0]
    assert ok <= 1.0, ok
    assert sabotaged > 10.0, sabotaged


LAYOUTS = {
    "dp2_zero0": {"data_parallel_size": 2},
    "dp2_zero1": {"data_parallel_size": 2, "zero_stage": 1},
    "dp2_zero2": {"data_parallel_size": 2, "zero_stage": 2},
    "pp2_zero0": {"pipeline_parallel_size": 2},
    "pp2_zero2": {"pipeline_parallel_size": 2, "zero_stage": 2},  # buckets reduced inside the schedule's backwards
}


def test_dp2_zero0_1_2_and_pp2_accumulate_in_fp32(tmp_path):
    names = list(LAYOUTS)
    jobs = [(_job(tmp_path, f"{n}-{s}", **LAYOUTS[n]), s) for n in names for s in (False, True)]
    per_rank = run_distributed(_check, 2, args=(jobs,), timeout=240)
    for rank, worst in enumerate(per_rank):
        for i, name in enumerate(names):
            ok, sabotaged = worst[2 * i], worst[2 * i + 1]
            assert ok <= 1.0, (name, rank, ok)
            assert sabotaged > 10.0, (name, rank, sabotaged)
