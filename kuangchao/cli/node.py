"""``kc node start`` (this machine's node agent) and ``kc node list`` (the nodes of a pool and whether they live).

A node agent is a Prefect worker of a process work pool polling the work queue named after the node; its facts
(training address and interface, devices, versions, free memory) are published through the Prefect API. Both
commands need a Prefect server every node reaches (``PREFECT_API_URL``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import typer

node_app = typer.Typer(
    help="Node agents of multi-node clusters (Prefect workers, one per machine).", no_args_is_help=True
)

PROJECT_DIR = Path(__file__).resolve().parents[2]


def _need_server() -> None:
    if not os.environ.get("PREFECT_API_URL"):
        typer.echo(
            "kc node: PREFECT_API_URL is not set; node agents and the orchestrator must share one Prefect server "
            "(start it with `prefect server start --host <address the nodes reach>` and export "
            "PREFECT_API_URL=http://<address>:4200/api on every node)",
            err=True,
        )
        raise typer.Exit(2)


@node_app.command("start")
def start(
    pool: str = typer.Option(..., "--pool", help="Process work pool of the cluster (created if missing)."),
    name: str = typer.Option(None, "--name", help="Node name (default: the hostname); also its work queue."),
    address: str = typer.Option(None, "--address", help="Address other nodes reach this one at for training."),
    ifname: str = typer.Option(None, "--ifname", help="Network interface of that address (GLOO/NCCL_SOCKET_IFNAME)."),
    project_dir: str = typer.Option(
        str(PROJECT_DIR), "--project-dir", help="The Kuangchao checkout the agent runs flows from."
    ),
) -> None:
    """Publish this node's facts and run its agent (a Prefect worker) until interrupted."""
    from kuangchao_core.errors import ConfigError
    from kuangchao_core.sched import node_registry, nodes

    _need_server()
    try:
        node = nodes.check_node_name(name or nodes.default_node_name(), "--name")
    except ConfigError as exc:
        typer.echo(f"kc node start: {exc.errors[0][1]}", err=True)
        raise typer.Exit(2) from None
    node_registry.ensure_pool(pool)
    node_registry.ensure_queue(pool, node)
    node_registry.ensure_agent_deployment(pool, str(Path(project_dir).resolve()))
    facts = nodes.local_facts(node, address, ifname)
    node_registry.publish_facts(pool, facts)
    typer.echo(
        f"node {node}: {facts.address} ({facts.ifname or 'default interface'}), "
        f"{devices_text(facts)}, {facts.cpu_count} CPUs; pool {pool}"
    )
    os.environ["KC_PROJECT_DIR"] = str(Path(project_dir).resolve())  # the flow runs' working directory
    os.environ["KC_NODE"] = node
    if facts.ifname:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", facts.ifname)
    try:
        asyncio.run(_serve(pool, node))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def devices_text(facts) -> str:
    """What a node trains on, as ``kc node list`` shows it: ``2 cuda`` (its GPUs) or ``4 cpu slots`` (a CPU node
    hosts one rank per core, :attr:`NodeFacts.slots`) — never ``0 cpu``."""
    if facts.device_kind != "cpu" and facts.device_count:
        return f"{facts.device_count} {facts.device_kind}"
    return f"{facts.slots} cpu slot{'s' if facts.slots != 1 else ''}"


async def _serve(pool: str, node: str) -> None:
    """The node's Prefect worker, in this process: polls the node's queue, runs each flow run in a subprocess."""
    from prefect.workers.process import ProcessWorker

    from kuangchao_core.sched import nodes

    async with ProcessWorker(work_pool_name=pool, work_queues=[node], name=nodes.worker_name(node)) as worker:
        await worker.start()


@node_app.command("list")
def list_cmd(
    pool: str = typer.Option(..., "--pool", help="Work pool of the cluster."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """The nodes of POOL, their facts and whether their agent is live."""
    from kuangchao_core.sched import node_registry

    _need_server()
    found = node_registry.list_nodes(pool)
    if as_json:
        typer.echo(json.dumps([n.to_dict() for n in found], indent=2))
        return
    if not found:
        typer.echo(f"no nodes in pool {pool}; start one with `kc node start --pool {pool}`")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"nodes of pool {pool}")
    for col in ("node", "live", "address", "ifname", "devices", "cpus", "torch", "free memory", "last heartbeat"):
        table.add_column(col)
    for n in found:
        f = n.facts
        mem = f"{f.free_memory_bytes / 2**30:.1f} GiB" if f.free_memory_bytes else "-"
        table.add_row(
            n.name,
            "yes" if n.live else "NO",
            f.address,
            f.ifname or "-",
            devices_text(f),
            str(f.cpu_count),
            f.torch or "-",
            mem,
            n.last_heartbeat or "never",
        )
    Console(width=None if sys.stdout.isatty() else 160).print(table)  # scripts and logs: no wrapped cells


def register(app: typer.Typer) -> None:
    """Attach ``kc node``."""
    app.add_typer(node_app, name="node")
