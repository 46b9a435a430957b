"""Shared pieces for tests that run the real training engine in several Gloo processes."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from kuangchao_core.config import config_from_dict
from kuangchao_core.config.settings import run_settings
from tests import attention_helpers, cp_sabotage, vision_sabotage
from tests.fixtures import hf_llama_config, tiny_llama


def only_lineage(task_dir) -> Path:
    """The single lineage directory of a task directory (a test that ran one run of the task)."""
    from kuangchao_core.ckpt.lineage import list_lineages

    found = list_lineages(task_dir)
    assert len(found) == 1, f"{task_dir}: expected one lineage, found {[lin.name for lin in found]}"
    return found[0].path


def save_random_hf_llama(path, num_layers: int, seed: int = 5):
    """A tiny random ``transformers.LlamaForCausalLM`` (vocab 256, hidden 64, grouped-query attention, fp32, eager
    attention) saved with ``save_pretrained`` at ``path``; norms away from 1 and weights scaled up, so a mixed-up
    slice changes the logits. Returns the model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = hf_llama_config(tiny_llama(num_layers=num_layers))
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.mul_(5.0)
    model.save_pretrained(path, safe_serialization=True)
    return model


def tiny_job(tmp_dir: str, **sections: Any):
    """A tiny job config (trusted mode, synthetic data) with ``sections`` merged over the defaults."""
    base: dict[str, Any] = {
        "task": {"name": "t", "seed": 7},
        "model": {"preset": "tiny", "num_layers": 2},
        "data": {
            "format": "synthetic",
            "seq_len": 32,
            "prefetch": 2,
            "synthetic": {"num_train": 512, "num_eval": 16, "seed": 3},
        },
        "parallel": {
            "data_parallel_size": 1,
            "micro_batch_size": 4,
            "gradient_accumulation_steps": 1,
            "backend": "gloo",
        },
        "optimizer": {"lr": 3e-3, "weight_decay": 0.01},
        "train": {"steps": 8, "warmup_steps": 2, "device": "cpu", "log_interval": 100},
        "permission": {"mode": "trusted"},
        "checkpoint": {"dir": f"{tmp_dir}/ckpt", "interval": 100, "keep_last": 3, "resume": "never"},
        "tracking": {"uri": f"sqlite:///{tmp_dir}/mlflow.db"},
    }
    for section, values in sections.items():
        base.setdefault(section, {})
        base[section] = {**base[section], **values}
    return config_from_dict(base)


def trainer_in_process(cfg, rank: int, world_size: int, timeout_ms: int = 120_000):
    """The engine's Trainer for this rank of a process group this process already belongs to (trusted mode)."""
    import torch

    from kuangchao_core.comm import init_distributed, world_group
    from kuangchao_core.engine.trainer import Trainer
    from kuangchao_core.parallel.mesh import ParallelMesh
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    init_distributed(backend="gloo", timeout_ms=timeout_ms)
    mesh = ParallelMesh.from_config(cfg.parallel, rank, world_size)
    return Trainer(run_settings(cfg), rank, world_size, torch.device("cpu"), world_group(), mesh)


def run_trainer(rank: int, world_size: int, cfg, resume: str = "never", max_steps: int | None = None, patch=None):
    """Build the engine's Trainer in this process (already in a Gloo group) and train; returns the loss list."""
    import torch

    from kuangchao_core.comm import init_distributed, world_group
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    if patch is not None:
        patch()
    from kuangchao_core.engine.trainer import Trainer
    from kuangchao_core.parallel.mesh import ParallelMesh

    init_distributed(backend="gloo", timeout_ms=120_000)
    world = world_group()
    mesh = ParallelMesh.from_config(cfg.parallel, rank, world_size)
    trainer = Trainer(run_settings(cfg), rank, world_size, torch.device("cpu"), world, mesh)
    state = trainer.run(resume=resume, max_steps=max_steps)
    # numpy arrays travel back by value (torch tensors would be shared through fds that die with the process)
    params = {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters()}
    return {"losses": list(state.losses), "params": params}


def run_trainers(rank: int, world_size: int, jobs: list[dict[str, Any]]):
    """Run several engine jobs one after another in this process (all ranks run the same list).

    ``jobs``: dicts with ``cfg`` and optional ``resume`` (default ``never``), ``max_steps``, ``lineage`` (pins
    the checkpoint lineage, as a flow run does), ``node_of_rank`` (the node of every rank, for hierarchical
    reductions) and ``sabotage`` (the name of a function in :data:`SABOTAGE`, applied to the built Trainer: a
    negative control). Each job builds its own mesh and Trainer (one set of processes serves several layouts of the
    same world size). Returns, per job, ``{"losses", "eval_loss", "samples", "params", "regions", "first_step",
    "first_grads", "steps_run"}``: ``eval_loss`` is the held-out loss of the final model (None where the layout has none), ``samples`` its greedy
    answers to the held-out prompts ``(exact match, text)``, ``regions`` maps each parameter to the slice of the
    full tensor it holds (``Region.to_meta()``), ``first_step`` is the micro-batches (numpy) of the first step this
    process ran, ``first_grads`` the gradients after that step's reduction and clipping (parameters whose ``.grad``
    the engine keeps: every layout without ZeRO), ``steps_run`` how many steps it ran (a resumed job runs only the
    remaining ones), ``attention_path`` the path the job reported (``kuangchao_core.models.attention.PATHS``).
    """
    import torch

    from kuangchao_core.comm import init_distributed, world_group
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    from kuangchao_core.engine.trainer import Trainer
    from kuangchao_core.parallel.mesh import ParallelMesh

    init_distributed(backend="gloo", timeout_ms=120_000)
    world = world_group()
    out = []
    for job in jobs:
        cfg = job["cfg"]
        mesh = ParallelMesh.from_config(cfg.parallel, rank, world_size, node_of_rank=job.get("node_of_rank"))
        trainer = Trainer(run_settings(cfg), rank, world_size, torch.device("cpu"), world, mesh)
        undo = SABOTAGE[job["sabotage"]](trainer) if job.get("sabotage") else None
        seen: list[list[dict[str, Any]]] = []
        grads: dict[str, Any] = {}
        step_fn = trainer.train_step

        calls = [0]

        def recording_step(micro_batches, _seen=seen, _step=step_fn, _calls=calls, _grads=grads, _t=trainer):
            _calls[0] += 1
            first = not _seen
            if first:
                _seen.append([{k: v.numpy().copy() for k, v in b.items()} for b in micro_batches])
            result = _step(micro_batches)
            if first:  # train_step leaves the reduced, clipped gradients in place until the next step
                for n, p in _t.model.named_parameters():
                    if p.grad is not None:
                        _grads[n] = p.grad.detach().numpy().copy()
            return result

        trainer.train_step = recording_step
        if job.get("trace") and hasattr(trainer.sync, "optimizer"):
            trainer.sync.optimizer.trace = []  # ZeRO-3 records its gathers and forward ends
        try:
            state = trainer.run(
                resume=job.get("resume", "never"), max_steps=job.get("max_steps"), lineage=job.get("lineage")
            )
        finally:
            if undo is not None:
                undo()
        held_out = trainer.evaluator() if trainer.evaluator is not None else None  # collective
        samples = trainer.samples() if trainer.samples is not None else None  # collective
        full = getattr(trainer.sync, "full_parameters", None)
        with full() if full is not None else contextlib.nullcontext():  # collective under ZeRO-3
            params = {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters()}
        report = getattr(trainer.sync, "memory_report", None)
        out.append(
            {
                "losses": list(state.losses),
                "eval_loss": held_out,
                "samples": samples,
                "params": params,
                "memory": report() if report is not None else None,
                "zero3_trace": list(getattr(trainer.sync.optimizer, "trace", None) or []),
                "regions": {n: r.to_meta() for n, r in trainer.parts.regions.items()},
                "first_step": seen[0] if seen else None,
                "first_grads": grads,
                "steps_run": calls[0],
                "attention_path": trainer.attention_path,
            }
        )
        trainer.barrier()
    return out


# ---------------------------------------------------------------------- negative controls
# Each breaks one reduction of a built Trainer the way a real bug would and returns how to undo it (module-level
# patches must not leak into the next job of the same process). A comparison with one process must catch each.


def _missing_row_parallel_all_reduce(trainer):
    """TP: layer 1's MLP down projection keeps its partial sum (the all-reduce of a row-parallel layer is lost)."""
    import torch.nn.functional as F

    layer = trainer.model.model.layers[1].mlp.down_proj
    layer.forward = lambda x, _w=layer.weight: F.linear(x, _w)
    return None


def _skipped_micro_batch(trainer):
    """PP: the schedule runs the first micro-batch twice and the last one never."""
    executor = trainer.parts.executor
    run = executor.run
    executor.run = lambda batches, _run=run, **kw: _run([*batches[:-1], batches[0]], **kw)
    return None


class _NoCommFirstBucket:
    """A stand-in for the comm module: the first bucket of each step is not reduced across ranks."""

    def __init__(self, real, first_buffer):
        self.real = real
        self.first_buffer = first_buffer

    def __getattr__(self, name):
        return getattr(self.real, name)

    def all_reduce(self, tensor, *args, **kwargs):
        if tensor.data_ptr() == self.first_buffer().data_ptr():
            return _Done()
        return self.real.all_reduce(tensor, *args, **kwargs)

    def reduce_scatter(self, out, buf, *args, group=None, **kwargs):
        if buf.data_ptr() == self.first_buffer().data_ptr():
            out.copy_(buf.view(group.size, -1)[group.rank])  # only this rank's own gradient, never summed
            return None
        return self.real.reduce_scatter(out, buf, *args, group=group, **kwargs)


class _Done:
    def wait(self):
        return None


def _unreduced_dp_bucket(trainer):
    """DP: the all-reduce of the first gradient bucket is skipped (each replica keeps its own gradient / dp)."""
    from kuangchao_core.parallel import bucket_reduce

    real = bucket_reduce.comm
    bucket_reduce.comm = _NoCommFirstBucket(real, lambda: trainer.sync.dp._buckets[0].buffer)

    def undo():
        bucket_reduce.comm = real

    return undo


def _unreduced_zero_bucket(trainer):
    """ZeRO: the reduce-scatter of the first bucket keeps this rank's own gradient chunk instead of the sum."""
    from kuangchao_core.parallel import zero

    opt = trainer.sync.optimizer
    real = zero.comm

    def first_buffer():
        if opt.stage == 1:
            bk = opt.buckets[0]
            return opt.flat_grads[bk.start : bk.start + bk.size]
        return opt._bucket_bufs[0] if opt._bucket_bufs[0] is not None else opt.flat_params[:0]

    zero.comm = _NoCommFirstBucket(real, first_buffer)

    def undo():
        zero.comm = real

    return undo


def _unreduced_zero3_unit(trainer):
    """ZeRO-3's first unit with trainable parameters (the embedding; with LoRA the first layer's adapters) keeps
    this rank's own gradient chunk: no reduce-scatter over DP."""
    import torch

    opt = trainer.sync.optimizer
    honest = opt._reduce_unit
    first = next(i for i, bk in enumerate(opt.buckets) if bk.slots)

    def local_only(i, grads):
        if i != first:
            return honest(i, grads)
        bk = opt.buckets[i]
        flat = torch.zeros(bk.size, dtype=opt.dtype)
        for s, g in zip(bk.slots, grads, strict=True):
            if g is not None:
                flat[s.offset : s.offset + s.numel].copy_(g.reshape(-1))
        return flat[opt.rank * bk.chunk : (opt.rank + 1) * bk.chunk].clone()

    opt._reduce_unit = local_only
    return None


def _unsummed_lora_a(trainer):
    """LoRA under TP: the replicated ``A`` of a column-parallel projection keeps this rank's partial gradient."""
    from kuangchao_core.models import lora

    real = lora.sum_grad_over_tp
    lora.sum_grad_over_tp = lambda weight, group: weight

    def undo():
        lora.sum_grad_over_tp = real

    return undo


def _unsummed_sp_norm_grads(trainer):
    """Sequence parallelism: the norm weights keep their sequence shard's gradient (no sum over TP)."""
    from kuangchao_core.parallel import sequence

    real = sequence.sum_weight_grad_over_tp
    sequence.sum_weight_grad_over_tp = lambda weight, group: weight

    def undo():
        sequence.sum_weight_grad_over_tp = real

    return undo


def _mean_of_micro_batch_means(trainer):
    """Every micro-batch's mean loss weighs the same (the step ignores the global labelled-token count)."""
    step = trainer.forward_backward
    trainer.forward_backward = lambda sync, batches, weight=None, _step=step: _step(sync, batches, None)
    return None


def _stages_without_documents(trainer):
    """PP: every stage's layers run without the packed documents' positions and segments."""
    from kuangchao_core.parallel import pp_executor

    real = pp_executor.stage_inputs
    pp_executor.stage_inputs = lambda batch, device: {}

    def undo():
        pp_executor.stage_inputs = real

    return undo


def _drop_comm_state(trainer):
    """Resume without the gradient-compression residuals the checkpoint holds (they start from zero)."""
    trainer.checkpoints._load_comm_state = lambda step_dir: None


#: Negative controls by name (a job's ``sabotage`` field).
SABOTAGE = {
    "missing_row_parallel_all_reduce": _missing_row_parallel_all_reduce,
    "skipped_micro_batch": _skipped_micro_batch,
    "unreduced_dp_bucket": _unreduced_dp_bucket,
    "unreduced_zero_bucket": _unreduced_zero_bucket,
    "unreduced_zero3_unit": _unreduced_zero3_unit,
    "drop_comm_state": _drop_comm_state,
    "unsummed_lora_a": _unsummed_lora_a,
    "unsummed_sp_norm_grads": _unsummed_sp_norm_grads,
    "mean_of_micro_batch_means": _mean_of_micro_batch_means,
    "stages_without_documents": _stages_without_documents,
    "dense_attention": attention_helpers.dense_attention,
    "per_document_attention": attention_helpers.per_document_attention,
    "first_document_boundary_ignored": attention_helpers.first_document_boundary_ignored,
    **cp_sabotage.SABOTAGE,  # context parallelism's controls (tests/test_engine_cp.py)
    **vision_sabotage.SABOTAGE,  # the vision encoder's (tests/test_vlm_engine.py)
}


def gather_full(results: list[dict[str, Any]], key: str = "params", check_replicas: bool = True):
    """Reassemble full tensors (``key``: ``params`` or ``first_grads``) from every rank's slices of one job.

    Returns ``{name: numpy array}``; raises AssertionError when a region is missing or, with ``check_replicas``,
    when two ranks holding the same region (DP replicas, replicated kv heads) differ at all: replicas receive the
    same reduced values, so they are bitwise equal.
    """
    import numpy as np

    full: dict[str, np.ndarray] = {}
    filled: dict[str, np.ndarray] = {}
    for res in results:
        for name, meta in res["regions"].items():
            if name not in res[key]:
                continue
            value = res[key][name]
            if name not in full:
                full[name] = np.zeros(meta["full_shape"], dtype=value.dtype)
                filled[name] = np.zeros(meta["full_shape"], dtype=bool)
            index = tuple(slice(o, o + s) for o, s in zip(meta["offsets"], meta["shape"], strict=True))
            seen = filled[name][index]
            if seen.any() and check_replicas:
                np.testing.assert_array_equal(full[name][index][seen], value[seen], err_msg=f"replicas of {name}")
            full[name][index] = value.reshape(meta["shape"])
            filled[name][index] = True
    for name, mask in filled.items():
        assert mask.all(), f"{name}: {int((~mask).sum())} elements held by no rank"
    return full
