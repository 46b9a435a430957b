"""The ``kuangchao-node-agent`` flow: one node's share of a multi-node attempt, run by that node's agent.

``kc node start`` serves this flow's deployment (one per work pool) with a Prefect worker that polls the work
queue named after the node; the orchestrator's ``launch`` task starts one flow run per node on its queue
(:mod:`kuangchao_core.sched.multinode`). The flow runs ``torch.distributed.run`` for the node's ranks
(:func:`kuangchao_core.sched.node_share.run_node_share`); a worker failure fails the flow run with its cause.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from kuangchao_core.sched.node_share import NodeShare, run_node_share


@flow(name="kuangchao-node-agent", log_prints=True, retries=0)
def node_agent(share: dict[str, Any]) -> dict[str, Any]:
    """Run this node's ranks of one attempt (``share``: :class:`NodeShare` fields) and report how it ended."""
    return run_node_share(NodeShare(**share))
