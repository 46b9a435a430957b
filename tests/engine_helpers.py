"""Shared pieces for tests that run the real training engine in several Gloo processes."""

from __future__ import annotations

from typing import Any

from kuangchao_core.config import config_from_dict


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
    trainer = Trainer(cfg, rank, world_size, torch.device("cpu"), world, mesh)
    state = trainer.run(resume=resume, max_steps=max_steps)
    # numpy arrays travel back by value (torch tensors would be shared through fds that die with the process)
    params = {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters()}
    return {"losses": list(state.losses), "params": params}


def run_trainers(rank: int, world_size: int, jobs: list[dict[str, Any]]):
    """Run several engine jobs one after another in this process (all ranks run the same list).

    ``jobs``: dicts with ``cfg`` and optional ``resume`` (default ``never``) and ``max_steps``. Each job builds its
    own mesh and Trainer, so one set of processes serves several layouts of the same world size. Returns, per job,
    ``{"losses", "params", "regions", "first_step", "steps_run"}``: ``regions`` maps each parameter to the slice of
    the full tensor it holds (``Region.to_meta()``), ``first_step`` is the micro-batches (numpy) of the first step
    this process ran, ``steps_run`` how many steps it ran (a resumed job runs only the remaining ones).
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
        mesh = ParallelMesh.from_config(cfg.parallel, rank, world_size)
        trainer = Trainer(cfg, rank, world_size, torch.device("cpu"), world, mesh)
        seen: list[list[dict[str, Any]]] = []
        step_fn = trainer.train_step

        calls = [0]

        def recording_step(micro_batches, _seen=seen, _step=step_fn, _calls=calls):
            _calls[0] += 1
            if not _seen:
                _seen.append([{k: v.numpy().copy() for k, v in b.items()} for b in micro_batches])
            return _step(micro_batches)

        trainer.train_step = recording_step
        state = trainer.run(resume=job.get("resume", "never"), max_steps=job.get("max_steps"))
        out.append(
            {
                "losses": list(state.losses),
                "params": {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters()},
                "regions": {n: r.to_meta() for n, r in trainer.parts.regions.items()},
                "first_step": seen[0] if seen else None,
                "steps_run": calls[0],
            }
        )
        trainer.barrier()
    return out


def gather_full(results: list[dict[str, Any]]):
    """Reassemble full parameters from every rank's slices (one job's results, by rank).

    Returns ``{name: numpy array}``; raises AssertionError when a region is missing or when two ranks holding
    the same region (DP replicas, replicated kv heads) disagree beyond float32 rounding.
    """
    import numpy as np

    full: dict[str, np.ndarray] = {}
    filled: dict[str, np.ndarray] = {}
    for res in results:
        for name, meta in res["regions"].items():
            value = res["params"][name]
            if name not in full:
                full[name] = np.zeros(meta["full_shape"], dtype=value.dtype)
                filled[name] = np.zeros(meta["full_shape"], dtype=bool)
            index = tuple(slice(o, o + s) for o, s in zip(meta["offsets"], meta["shape"], strict=True))
            seen = filled[name][index]
            if seen.any():
                np.testing.assert_allclose(full[name][index][seen], value[seen], rtol=1e-5, atol=1e-7)
            full[name][index] = value.reshape(meta["shape"])
            filled[name][index] = True
    for name, mask in filled.items():
        assert mask.all(), f"{name}: {int((~mask).sum())} elements held by no rank"
    return full
