"""The communicators each rank of a job creates, and an estimate of the device memory NCCL reserves for them
(``kc plan``; issue 41 item 5).

The groups come from the code that builds them, not from a second list: the world and host groups
(:mod:`kuangchao_core.comm.group`), :func:`~kuangchao_core.parallel.mesh.mesh_group_lists` (tp, pp, dp, cp, dp_cp
and the hierarchical all-reduce's ``dpn``/``dpx``, what :class:`~kuangchao_core.parallel.mesh.ParallelMesh`
builds) and :func:`~kuangchao_core.engine.vlm_layout.encoder_group_plan` (a vision tower's ``vtp``/``vshare``).
A rank has a communicator for each group it is a member of, except that a group over every rank reuses the world's
process group (``CommGroup`` does so when backend and timeout match, as they do in the worker), a one-rank group
has no peers to reserve buffers for, and the host group is Gloo (host memory).

**The memory is an estimate**, not a measurement: per communicator of two or more ranks,
``channels × connections per channel × (SIMPLE + LL + LL128 buffer)``. The buffer sizes are NCCL's defaults
(``src/init.cc``: ``DEFAULT_BUFFSIZE`` 4 MiB for SIMPLE, the ``NCCL_BUFFSIZE`` of NCCL's environment-variable
documentation; ``DEFAULT_LL_BUFFSIZE`` = 8 lines × 512 threads × 8 steps × 16 B = 512 KiB;
``DEFAULT_LL128_BUFFSIZE`` = 120 elements × 640 threads × 8 steps × 8 B = 4.6875 MiB), read from
``NCCL_BUFFSIZE`` / ``NCCL_LL_BUFFSIZE`` / ``NCCL_LL128_BUFFSIZE`` when set. Channels: 16 unless
``NCCL_MIN_NCHANNELS`` / ``NCCL_MAX_NCHANNELS`` say otherwise — NCCL picks them from the topology (2–4 on PCIe
pairs, up to 32 on NVSwitch H100/H200 nodes in ``NCCL_DEBUG=INFO`` logs). Connections: 2 per channel (the ring's
receive from its predecessor, whose FIFOs sit on the receiving rank, and the tree's link to its parent). Not
counted: NVLS/CollNet buffers, the proxy's host memory, NCCL's own structures, and the 2-rank communicator torch's
NCCL process group creates per peer pair for a send or receive issued outside a batch (``batch_isend_irecv`` uses
the group's own). NCCL also connects lazily (at a communicator's first operation of each algorithm), so a group
never used reserves nothing. These bytes are outside the CUDA caching allocator: ``max_memory_allocated`` never
shows them, so they are listed beside the plan's total, not added to it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kuangchao_core.axes import MeshAxes, group_name
from kuangchao_core.config.access import setting

MIB = 2**20
#: NCCL's default per-connection FIFO sizes (``src/init.cc``), by protocol
NCCL_DEFAULT_BUFFERS = {"simple": 4 * MIB, "ll": 8 * 512 * 8 * 16, "ll128": 120 * 640 * 8 * 8}
_BUFFER_ENV = {"simple": "NCCL_BUFFSIZE", "ll": "NCCL_LL_BUFFSIZE", "ll128": "NCCL_LL128_BUFFSIZE"}
DEFAULT_CHANNELS = 16
CONNECTIONS_PER_CHANNEL = 2


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key, "").strip()
    return int(raw, 0) if raw else None


def nccl_estimate(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The per-communicator estimate and the numbers it rests on (see the module docstring)."""
    env = os.environ if env is None else env
    buffers = {k: _env_int(env, _BUFFER_ENV[k]) or v for k, v in NCCL_DEFAULT_BUFFERS.items()}
    channels = DEFAULT_CHANNELS
    lo, hi = _env_int(env, "NCCL_MIN_NCHANNELS"), _env_int(env, "NCCL_MAX_NCHANNELS")
    channels = max(channels, lo) if lo else channels
    channels = min(channels, hi) if hi else channels
    per = channels * CONNECTIONS_PER_CHANNEL * sum(buffers.values())
    return {
        "kind": "estimate",
        "per_communicator_bytes": per,
        "formula": "channels x connections_per_channel x (simple + ll + ll128)",
        "channels": channels,
        "connections_per_channel": CONNECTIONS_PER_CHANNEL,
        "buffer_bytes": buffers,
        "source": "NCCL src/init.cc DEFAULT_BUFFSIZE / DEFAULT_LL_BUFFSIZE / DEFAULT_LL128_BUFFSIZE; NCCL_BUFFSIZE",
    }


def device_backend(cfg: Any) -> str:
    """The backend of the job's device groups: ``parallel.backend``, with ``auto`` read as NCCL unless the job
    trains on the CPU (the worker picks NCCL wherever it computes on a CUDA device)."""
    backend = str(setting(cfg, "parallel.backend", "auto"))
    if backend != "auto":
        return backend
    return "gloo" if str(setting(cfg, "train.device", "auto")) == "cpu" else "nccl"


def plan_nodes(cfg: Any, world: int) -> list[int]:
    """The node of every rank as the launcher places them by default (consecutive ranks per node): one node in
    ``cluster.mode: local``; ``cluster.slurm.tasks_per_node`` or ``cluster.nproc_per_node`` ranks per node, else each
    worker node's ``gpus``."""
    cluster = getattr(cfg, "cluster", None)
    if cluster is None or getattr(cluster, "mode", "local") == "local":
        return [0] * world
    nproc = setting(cfg, "cluster.nproc_per_node") or (
        setting(cfg, "cluster.slurm.tasks_per_node") if cluster.mode == "slurm" else None
    )
    sizes = [int(nproc)] * world if nproc else [int(n.gpus) for n in cluster.worker_nodes]
    nodes = [n for n, size in enumerate(sizes) for _ in range(size)]
    return (nodes + [nodes[-1] if nodes else 0] * world)[:world]


def built_groups(cfg: Any, node_of_rank: list[int] | None = None) -> list[tuple[str, list[int]]]:
    """Every group the job's workers build, ``(kind, ranks)`` in construction order: ``world``, ``host``, the
    mesh's (:func:`~kuangchao_core.parallel.mesh.mesh_group_lists`) and a vision tower's."""
    from kuangchao_core.engine.vlm_layout import encoder_group_plan
    from kuangchao_core.parallel.mesh import MeshLayout, mesh_group_lists

    layout = MeshLayout(MeshAxes.from_parallel(cfg.parallel).sizes)
    every = list(range(layout.world_size))
    nodes = plan_nodes(cfg, layout.world_size) if node_of_rank is None else list(node_of_rank)
    hierarchical = str(setting(cfg, "parallel.hierarchical_allreduce", "off"))
    groups = [("world", every), ("host", list(every)), *mesh_group_lists(layout, nodes, hierarchical)]
    vision = getattr(getattr(cfg, "model", None), "vision", None)
    if vision is not None:
        groups += encoder_group_plan(vision, layout.groups("tp"))
    return groups


def _entry(kind: str, ranks: list[int], world: list[int], backend: str, per: int) -> dict[str, Any]:
    name = kind if kind in ("world", "host") else group_name(kind, ranks)
    out: dict[str, Any] = {"name": name, "kind": kind, "ranks": ranks}
    if kind == "host":
        shared = backend == "gloo"
        return out | {"backend": "gloo", "communicator": "world's" if shared else "own (gloo)", "nccl_bytes": 0}
    if kind != "world" and sorted(ranks) == world:
        return out | {"backend": backend, "communicator": "world's", "nccl_bytes": 0}
    if len(ranks) == 1:
        return out | {"backend": backend, "communicator": "none (one rank)", "nccl_bytes": 0}
    return out | {"backend": backend, "communicator": "own", "nccl_bytes": per if backend == "nccl" else 0}


def communicators(cfg: Any, node_of_rank: list[int] | None = None, env: Mapping[str, str] | None = None) -> dict:
    """Per rank, the groups it belongs to with the communicator each gives it and NCCL's estimated reservation
    (``nccl_bytes``; 0 on Gloo, where buffers are host memory), and the estimate's numbers."""
    backend = device_backend(cfg)
    estimate = nccl_estimate(env)
    per = estimate["per_communicator_bytes"]
    groups = built_groups(cfg, node_of_rank)
    world = groups[0][1]
    ranks = []
    for r in world:
        mine = [_entry(kind, g, world, backend, per) for kind, g in groups if r in g]
        ranks.append({"rank": r, "communicators": mine, "nccl_bytes": sum(c["nccl_bytes"] for c in mine)})
    return {"backend": backend, "estimate": estimate, "ranks": ranks}


def format_communicators(comms: dict | None) -> list[str]:
    """``kc plan``'s lines: rank 0's communicators and the largest per-rank NCCL estimate."""
    if not comms:
        return []
    est = comms["estimate"]
    first = comms["ranks"][0]
    own = [c for c in first["communicators"] if c["nccl_bytes"]]
    worst = max(comms["ranks"], key=lambda r: r["nccl_bytes"])
    lines = [
        f"communicators of rank 0 ({comms['backend']} device groups): "
        + ", ".join(f"{c['name']} ({c['communicator']})" for c in first["communicators"])
    ]
    if comms["backend"] == "nccl":
        lines.append(
            f"NCCL buffers (estimate: {est['channels']} channels x {est['connections_per_channel']} connections x "
            f"{sum(est['buffer_bytes'].values()) / MIB:.2f} MiB = {est['per_communicator_bytes'] / MIB:.0f} MiB per "
            f"communicator): rank 0 {len(own)} -> {first['nccl_bytes'] / MIB:.0f} MiB; largest rank "
            f"{worst['rank']} {worst['nccl_bytes'] / MIB:.0f} MiB (outside the plan's total: not allocator memory)"
        )
    return lines
