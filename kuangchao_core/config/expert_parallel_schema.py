"""The config rules of the ``ep`` axis (``parallel.expert_parallel_size``, issue 40), which ``axes.TABLE`` names as
its ``Axis.checks`` and the job config's cross-checks run. That it divides ``data_parallel_size`` is the table's own
rule (``axes.within_problems``)."""

from __future__ import annotations

from typing import Any

PATH = "parallel.expert_parallel_size"


def expert_parallel_errors(model: Any, parallel: Any, train: Any) -> list[tuple[str, str]]:
    """What an ``expert_parallel_size`` above 1 needs: a ``model.moe`` whose ``num_experts`` it divides,
    replicated AdamW (ZeRO 0) and parameters in their training dtype (no bf16 masters) for now; one
    ``(path, message)`` for each setting that breaks one."""
    ep = getattr(parallel, "expert_parallel_size", 1)
    if not isinstance(ep, int) or ep <= 1:  # a size below 1 is the table's error (axes.size_problems)
        return []
    moe = model.moe
    if moe is None:
        return [(PATH, f"{ep} shards the experts of model.moe, which this model has none of (set it to 1)")]
    refused = [
        (moe.num_experts % ep != 0, PATH, f"{ep} must divide model.moe.num_experts {moe.num_experts}"),
        (parallel.zero_stage != 0, "parallel.zero_stage", f"must be 0 with expert_parallel_size {ep} (for now)"),
        (train.param_dtype == "bf16", "train.param_dtype", "bf16 masters are not kept for experts sharded over ep"),
    ]
    return [(path, message) for bad, path, message in refused if bad]
