"""The orchestrator's side of a multi-node attempt: one node-agent flow run per node, watched to the end.

For each :class:`~kuangchao_core.sched.placement.NodeAssignment` a flow run of the pool's node-agent deployment is
started on the node's own work queue, with a :class:`~kuangchao_core.sched.node_share.NodeShare` as parameters
(a fresh rendezvous id and port on the first node per attempt). While the nodes run, their torchrun output is
tailed into ``log_sink`` (the live view: steps, events and MLflow metrics from rank 0 as on one node), and each
node's share files are watched (:class:`~kuangchao_core.sched.node_watch.AttemptWatch`): a lost node is marked
Crashed on its flow run and raised as ``WorkerFailed(node=...)``; a failed rank as ``WorkerFailed`` with its rank.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kuangchao_core.sched.node_share import Beat, NodeShare, node_dir, owner_beat_path
from kuangchao_core.sched.node_watch import AttemptWatch
from kuangchao_core.sched.placement import NodeAssignment
from kuangchao_core.sched.store_key import drop_attempt_key, write_attempt_key

#: rendezvous ports are drawn from this range (the orchestrator cannot probe a port on another machine)
RDZV_PORTS = (29500, 29999)
#: how long the agents wait for a silent orchestrator (it beats every 0.5 s) before they stop its ranks
OWNER_LOST_AFTER_S = 5.0
#: how long a static cluster's placement waits for a named node whose agent's heartbeat is late (a loaded machine)
LATE_AGENT_GRACE_S = 90.0


class LogTail(threading.Thread):
    """Feeds the lines appended to a node's ``launcher.log`` to ``sink`` until stopped."""

    def __init__(self, path: Path, sink: Callable[[str], None] | None):
        super().__init__(daemon=True, name=f"kc-tail-{path.parent.name}")
        self.path, self.sink = path, sink
        self.halt = threading.Event()

    def run(self) -> None:
        handle = None
        pending = ""
        while True:
            if handle is None and self.path.exists():
                handle = open(self.path, encoding="utf-8", errors="replace")  # noqa: SIM115 - closed below
            chunk = handle.read() if handle is not None else ""
            if chunk:
                pending += chunk
                *lines, pending = pending.split("\n")
                for line in lines:
                    if self.sink is not None:
                        try:
                            self.sink(line)
                        except Exception:  # noqa: BLE001 - a broken sink must not stop the tail
                            pass
            elif self.halt.is_set():
                break
            else:
                time.sleep(0.1)
        if handle is not None:
            handle.close()


def _start_flow_run(deployment: str, share: NodeShare):
    from prefect.deployments import run_deployment

    return run_deployment(
        deployment,
        parameters={"share": share.to_params()},
        work_queue_name=share.node,
        timeout=0,
        as_subflow=False,
        flow_run_name=f"{Path(share.run_dir).name}-a{share.attempt}-{share.node}",
        tags=["kuangchao", "node-share"],
    ).id


def _mark_crashed(flow_run_id: Any, message: str) -> None:
    if flow_run_id is None:
        return
    try:
        from prefect.client.orchestration import get_client
        from prefect.states import Crashed

        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
    except Exception:  # noqa: BLE001 - bookkeeping only; the failure itself is raised to the flow
        pass


def launch_on_nodes(
    assignments: list[NodeAssignment],
    *,
    run_dir: str | Path,
    attempt: int,
    module: str,
    args: list[str],
    env_for: Callable[[NodeAssignment], dict[str, str]],
    deployment: str,
    log_sink: Callable[[str], None] | None = None,
    heartbeat_timeout_s: float | None = None,
    heartbeat_interval_s: float = 1.0,
    start_timeout_s: float = 180.0,
    lost_after_s: float | None = None,
    poll_s: float = 0.2,
) -> None:
    """Run one attempt on ``assignments`` and return when every node succeeded; raises ``WorkerFailed``.

    ``lost_after_s`` (default: the heartbeat timeout, at least 3 s) is how long a node's agent may stay silent
    before the node counts as lost; ``start_timeout_s`` how long a node may take to start its share.
    """
    run_dir = Path(run_dir)
    lost_after = float(lost_after_s or max(3.0, heartbeat_timeout_s or 10.0))
    watch = AttemptWatch(
        run_dir,
        attempt,
        lost_after=lost_after,
        start_timeout=start_timeout_s,
        on_lost=lambda name, why, flow_run_id: _mark_crashed(flow_run_id, f"node {name} lost: {why}"),
    )
    watch.stop.parent.mkdir(parents=True, exist_ok=True)
    watch.stop.unlink(missing_ok=True)
    first = assignments[0]
    rdzv_port = random.randint(*RDZV_PORTS)
    rdzv_id = f"kc-{run_dir.name}-{attempt}-{uuid.uuid4().hex[:6]}"
    tails: list[LogTail] = []
    owner = Beat(owner_beat_path(run_dir, attempt), 0.5)  # the agents stop their ranks when this goes silent
    owner.start()
    key_env = write_attempt_key(run_dir, attempt) if len(assignments) > 1 else {}  # the store gate's key
    try:
        for a in assignments:
            share = NodeShare(
                run_dir=str(run_dir.resolve()),
                attempt=attempt,
                node=a.name,
                node_rank=a.node_rank,
                nnodes=len(assignments),
                nproc=a.nproc,
                rdzv_host=first.address,
                rdzv_port=rdzv_port,
                rdzv_id=rdzv_id,
                local_addr=a.address,
                ifname=a.ifname,
                module=module,
                args=list(args),
                env={**env_for(a), **key_env},
                heartbeat_timeout_s=heartbeat_timeout_s,
                heartbeat_interval_s=heartbeat_interval_s,
                owner_lost_after_s=OWNER_LOST_AFTER_S,
            )
            out = node_dir(run_dir, attempt, a.name)
            out.mkdir(parents=True, exist_ok=True)
            tail = LogTail(out / "launcher.log", log_sink)
            tail.start()
            tails.append(tail)
            watch.add(a.name, _start_flow_run(deployment, share))
        watch.watch(poll_s)
    finally:
        drop_attempt_key(run_dir, attempt)
        owner.halt.set()
        for tail in tails:
            tail.halt.set()
        for tail in tails:
            tail.join(timeout=5)


def choose_cluster_nodes(
    cfg: Any, exclude: list[str] | tuple[str, ...] = (), topology: Any = None, late_grace_s: float = LATE_AGENT_GRACE_S
) -> list[NodeAssignment]:
    """The nodes of the next attempt of ``cfg``'s cluster, read from its pool (see :mod:`.placement`), with the
    node probe's ``topology`` and the pool's current load. A static cluster's node whose agent is registered but
    late with its heartbeat is waited for up to ``late_grace_s`` before the placement fails."""
    from kuangchao_core.sched.node_registry import list_nodes, running_shares
    from kuangchao_core.sched.placement import NodeUnavailable, choose_nodes, cluster_pool

    pool = cluster_pool(cfg)
    deadline = time.monotonic() + late_grace_s
    while True:
        registered = list_nodes(pool)
        try:
            return choose_nodes(cfg, registered, set(exclude), topology, running_shares(pool))
        except NodeUnavailable as exc:
            late = [n for n in registered if n.name in exc.nodes and not n.live and n.name not in exclude]
            if cfg.cluster.mode != "static" or not late or time.monotonic() > deadline:
                raise
            time.sleep(5.0)


def probe_candidates(cfg: Any) -> list[Any]:
    """The live nodes a job could run on (a static cluster's nodes; a dynamic pool's live nodes), for the probe."""
    from kuangchao_core.sched.node_registry import list_nodes
    from kuangchao_core.sched.placement import cluster_pool

    live = [n for n in list_nodes(cluster_pool(cfg)) if n.live]
    if cfg.cluster.mode == "static":
        wanted = {spec.host for spec in cfg.cluster.worker_nodes}
        live = [n for n in live if n.name in wanted or n.facts.address in wanted]
    return live


def place_cluster_attempt(
    cfg: Any,
    exclude: list[str] | tuple[str, ...] = (),
    topology: Any = None,
    traffic: dict[str, float] | None = None,
):
    """(node assignments, :class:`~kuangchao_core.sched.rank_placement.RankPlacement`) of the next attempt: the
    nodes (cluster level) and which mesh rank each slot plays (node level), from the probe's matrix when given and
    the bytes per step of each group kind (``traffic``, ``engine.traffic.group_traffic``)."""
    from kuangchao_core.sched.rank_placement import place_from_report, placement_sizes

    assignments = choose_cluster_nodes(cfg, exclude, topology)
    placement = place_from_report(
        placement_sizes(cfg.parallel),
        [a.name for a in assignments],
        assignments[0].nproc,
        traffic=traffic,
        mode=cfg.cluster.placement,
        topology=topology,
    )
    return assignments, placement


def launch_cluster_attempt(
    cfg: Any,
    assignments: list[NodeAssignment],
    run_dir: str | Path,
    attempt: int,
    args: list[str],
    env_for: Callable[[NodeAssignment], dict[str, str]],
    log_sink: Callable[[str], None] | None = None,
) -> None:
    """:func:`launch_on_nodes` of the engine's worker with the job's heartbeat settings."""
    from kuangchao_core.sched.nodes import deployment_name
    from kuangchao_core.sched.placement import cluster_pool

    launch_on_nodes(
        assignments,
        run_dir=run_dir,
        attempt=attempt,
        module="kuangchao_core.engine.worker",
        args=args,
        env_for=env_for,
        deployment=deployment_name(cluster_pool(cfg)),
        log_sink=log_sink,
        heartbeat_timeout_s=cfg.cluster.heartbeat_timeout_s,
        heartbeat_interval_s=cfg.cluster.heartbeat_interval_s,
    )
