"""Elastic re-planning after a lost node (SPEC L4.4, first step of L4.6): a smaller data-parallel size that fits.

When the nodes that remain cannot host the configured layout, a job with ``cluster.elastic: true`` resumes with
the largest data-parallel size ``dp'`` that divides ``dp`` and fits the remaining ranks, keeping cp×pp×tp and the
global batch (gradient accumulation × ``dp / dp'``), so the loss sequence continues the uninterrupted run. The
checkpoint it resumes from is read in the new layout (checkpoints are layout-independent).
"""

from __future__ import annotations

from typing import Any

from kuangchao_core.config import config_from_dict
from kuangchao_core.sched.placement import NodeUnavailable

#: what brings a lost node's ranks back, per cluster mode
_REPLACE = {
    "static": "start a node agent to replace it",
    "dynamic": "start a node agent to replace it",
    "slurm": "return a node to the partition (or free one)",
}


def smaller_data_parallel(dp: int, accum: int, per_replica: int, capacity: int) -> tuple[int, int] | None:
    """``(dp', accumulation')`` for ``capacity`` ranks (``per_replica`` = cp×pp×tp each), or None if none fits."""
    for new_dp in range(dp - 1, 0, -1):
        if dp % new_dp == 0 and new_dp * per_replica <= capacity:
            return new_dp, accum * dp // new_dp
    return None


def _smaller_fit(cfg: Any, lost: list[str], capacity: int, where: str) -> tuple[int, int]:
    """``(dp', accumulation')`` of ``cfg`` for ``capacity`` ranks; raises NodeUnavailable naming the ``lost`` nodes
    when elasticity is off or no smaller layout fits."""
    par = cfg.parallel
    needed = f"{par.world_size} ranks (dp {par.data_parallel_size} × tp {par.tensor_parallel_size} × pp {par.pipeline_parallel_size})"
    if not cfg.cluster.elastic:
        raise NodeUnavailable(
            f"lost {', '.join(lost)}: the {where} host {capacity} ranks, the job needs {needed}; "
            f"{_REPLACE[cfg.cluster.mode]}, or set cluster.elastic: true to resume with a smaller data-parallel size",
            lost,
        )
    per_replica = par.world_size // par.data_parallel_size  # one replica: cp × pp × tp ranks
    fit = smaller_data_parallel(par.data_parallel_size, par.gradient_accumulation_steps, per_replica, capacity)
    if fit is None:
        raise NodeUnavailable(
            f"lost {', '.join(lost)}: {capacity} ranks remain, fewer than one model replica (cp×pp×tp = {per_replica}) "
            f"or no data-parallel size dividing {par.data_parallel_size} fits; the job needs {needed}",
            lost,
        )
    return fit


def shrunk_config(cfg: Any, lost: list[str], live: list[Any]) -> Any:
    """``cfg`` re-planned for the ``live`` nodes (``NodeStatus``, lost ones already left out); raises
    NodeUnavailable naming the lost nodes when elasticity is off or no smaller layout fits."""
    par, cluster = cfg.parallel, cfg.cluster
    names = {n.name for n in live} | {n.facts.address for n in live}
    if cluster.mode == "static":
        kept = [node for node in cluster.worker_nodes if node.host in names]
    else:
        kept = []
    per_node = int(cluster.nproc_per_node or (kept[0].gpus if kept else 0) or (live[0].facts.slots if live else 0))
    hosts = len(kept) if cluster.mode == "static" else len(live)
    new_dp, new_accum = _smaller_fit(cfg, lost, per_node * hosts, "remaining live nodes")
    per_replica = par.world_size // par.data_parallel_size  # one replica: cp × pp × tp ranks
    data = cfg.to_dict()
    data["parallel"]["data_parallel_size"] = new_dp
    data["parallel"]["gradient_accumulation_steps"] = new_accum
    if cluster.mode == "static":
        ranks_needed = new_dp * per_replica
        data["cluster"]["nodes"] = [n.model_dump() for n in kept[: max(1, ranks_needed // per_node)]] + [
            n.model_dump() for n in cluster.nodes if n.role != "worker"
        ]
    return config_from_dict(data, source=f"elastic re-plan after losing {', '.join(lost)}")


def slurm_config_for_attempt(cfg: Any, lost: list[str]) -> Any:
    """``cfg`` while ``cluster.slurm.partition`` still has ``cluster.slurm.nodes`` usable nodes besides the ``lost``
    ones, else its elastic re-plan onto the usable nodes there are (fewer nodes, a smaller data-parallel size)."""
    from kuangchao_core.sched.slurm import commands

    slurm = cfg.cluster.slurm
    usable = [n for n in commands.usable_nodes(slurm.partition, commands.slurm_env(slurm)) if n not in lost]
    if len(usable) >= slurm.nodes:
        return cfg
    new_dp, new_accum = _smaller_fit(cfg, lost, len(usable) * slurm.tasks_per_node, "usable nodes of the partition")
    par = cfg.parallel
    ranks = new_dp * (par.world_size // par.data_parallel_size)
    data = cfg.to_dict()
    data["parallel"]["data_parallel_size"] = new_dp
    data["parallel"]["gradient_accumulation_steps"] = new_accum
    data["cluster"]["slurm"]["nodes"] = -(-ranks // slurm.tasks_per_node)
    return config_from_dict(data, source=f"elastic re-plan after losing {', '.join(lost)}")


def config_for_attempt(cfg: Any, lost: list[str]) -> Any:
    """``cfg`` itself while its cluster still fits without the ``lost`` nodes, else its elastic re-plan; raises
    NodeUnavailable (naming the lost nodes and what the job needs) when neither works."""
    if not lost or cfg.cluster.mode == "local":
        return cfg
    if cfg.cluster.mode == "slurm":
        return slurm_config_for_attempt(cfg, lost)
    from kuangchao_core.sched.node_registry import list_nodes
    from kuangchao_core.sched.placement import choose_nodes, cluster_pool

    registered = list_nodes(cluster_pool(cfg))
    try:
        choose_nodes(cfg, registered, set(lost))
        return cfg
    except NodeUnavailable:
        pass
    live = [n for n in registered if n.live and n.name not in lost]
    return shrunk_config(cfg, lost, live)
