"""The node registry's Prefect side (SPEC L4.3): the node-agent launch backend's work pool, queues and deployment,
and each node's facts as a Prefect variable joined with its worker's heartbeats (:func:`list_nodes`).

Of the engine's core only this module and :mod:`kuangchao_core.sched.multinode` speak to Prefect (issue 43 item 6):
the registry *is* the Prefect API. The names, the facts and the probing of this machine are
:mod:`kuangchao_core.sched.nodes`, which imports no Prefect.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime, timezone

from kuangchao_core.sched.nodes import (
    AGENT_ENTRYPOINT,
    AGENT_FLOW,
    LIVE_FACTOR,
    NodeFacts,
    NodeStatus,
    deployment_name,
    facts_variable,
    worker_name,
)


def _client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def ensure_pool(pool: str) -> None:
    """Create the process work pool ``pool`` when it does not exist."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with _client() as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            try:
                client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
            except ObjectAlreadyExists:
                pass


def ensure_queue(pool: str, node: str) -> None:
    """Create the work queue of ``node`` in ``pool`` when it does not exist."""
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with _client() as client:
        try:
            client.read_work_queue_by_name(node, work_pool_name=pool)
        except ObjectNotFound:
            try:
                client.create_work_queue(name=node, work_pool_name=pool)
            except ObjectAlreadyExists:
                pass


def ensure_agent_deployment(pool: str, project_dir: str) -> None:
    """Create (or update) the node-agent deployment of ``pool``: the flow runs from ``project_dir`` on the node."""
    with _client() as client:
        flow_id = client.create_flow_from_name(AGENT_FLOW)
        client.create_deployment(
            flow_id=flow_id,
            name=pool,
            work_pool_name=pool,
            entrypoint=AGENT_ENTRYPOINT,
            path=project_dir,
            pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": project_dir}}],
            description="Runs one node's share of a Kuangchao job (torch.distributed.run with a c10d rendezvous)",
            tags=["kuangchao", "node-agent"],
            enforce_parameter_schema=False,
        )


def publish_facts(pool: str, facts: NodeFacts) -> None:
    """Store ``facts`` in the registry (overwrites the node's earlier facts)."""
    from prefect.variables import Variable

    Variable.set(facts_variable(pool, facts.name), asdict(facts), tags=["kuangchao", "node"], overwrite=True)


def _age_s(when: datetime | None) -> float | None:
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return (datetime.now(timezone.utc) - when).total_seconds()


def list_nodes(pool: str) -> list[NodeStatus]:
    """Every node that published facts for ``pool``, with liveness from its worker's heartbeat, by name."""
    prefix = facts_variable(pool, "")
    with _client() as client:
        variables = [v for v in client.read_variables() if v.name.startswith(prefix)]
        try:
            workers = {w.name: w for w in client.read_workers_for_work_pool(pool)}
        except Exception:  # noqa: BLE001 - no pool yet: no live workers
            workers = {}
    out = []
    for var in variables:
        if not isinstance(var.value, dict):
            continue
        facts = NodeFacts.from_dict(var.value)
        w = workers.get(worker_name(facts.name))
        age = _age_s(w.last_heartbeat_time) if w else None
        interval = float(getattr(w, "heartbeat_interval_seconds", None) or 30) if w else 30.0
        status = str(getattr(w.status, "value", w.status)) if w else None
        live = bool(w) and status == "ONLINE" and age is not None and age < LIVE_FACTOR * interval
        out.append(
            NodeStatus(facts, live, w.last_heartbeat_time.isoformat() if w and w.last_heartbeat_time else None, status)
        )
    return sorted(out, key=lambda n: n.name)


def running_shares(pool: str) -> dict[str, int]:
    """Node shares (node-agent flow runs) running or about to run on each node of ``pool``: the node's load."""
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    flow_name, _, dep_name = deployment_name(pool).partition("/")
    busy = FlowRunFilter(
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING]))
    )
    try:
        with _client() as client:
            runs = client.read_flow_runs(
                flow_run_filter=busy, deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[dep_name]))
            )
    except Exception:  # noqa: BLE001 - no deployment yet: nothing runs
        return {}
    out: dict[str, int] = {}
    for run in runs:
        if run.work_queue_name:
            out[run.work_queue_name] = out.get(run.work_queue_name, 0) + 1
    return out
