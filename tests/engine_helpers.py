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
