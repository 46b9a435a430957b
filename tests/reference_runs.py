"""One-process reference runs that multi-rank jobs are compared with."""

from __future__ import annotations

from tests.engine_helpers import run_trainers


def one_process_reference(config: str, overrides: list[str], steps: int, accumulation: int) -> list[float]:
    """The losses of the first ``steps`` steps of ``config`` with ``overrides`` trained in one process (dp1×tp1,
    ``accumulation`` micro-batches per step, trusted mode): the reference of a multi-rank job with the same
    global batch."""
    from kuangchao_core.config import load_config
    from tests.mp import run_distributed

    cfg = load_config(
        config,
        list(overrides)
        + [
            "parallel.data_parallel_size=1",
            "parallel.tensor_parallel_size=1",
            f"parallel.gradient_accumulation_steps={accumulation}",
            "cluster.nproc_per_node=1",
            "permission.mode=trusted",
        ],
    )
    per_rank = run_distributed(run_trainers, 1, args=([{"cfg": cfg, "max_steps": steps}],), timeout=300)
    return list(per_rank[0][0]["losses"])
