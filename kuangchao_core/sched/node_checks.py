"""The doctor's node checks: the registry's node agents of a static or dynamic cluster (the placement the launch
would make), else each configured node's TCP doctor agent (``version_agent.py``) and the versions they report."""

from __future__ import annotations

from typing import Any

from kuangchao_core.config.access import setting
from kuangchao_core.sched.doctor_report import Check
from kuangchao_core.sched.version_agent import (
    CONNECT_TIMEOUT_S,
    is_local,
    local_versions,
    query_agent,
    split_host,
    tcp_connect,
)


def configured_nodes(cfg: Any) -> list[str]:
    """Hosts of ``cluster.nodes`` (empty for a local cluster)."""
    nodes = setting(cfg, "cluster.nodes", []) or []
    hosts = []
    for n in nodes:
        host = n.get("host") if isinstance(n, dict) else getattr(n, "host", None)
        if host:
            hosts.append(str(host))
    return hosts


def check_nodes(
    cfg: Any, timeout: float = CONNECT_TIMEOUT_S, gpu_out: dict[str, Any] | None = None
) -> tuple[list[Check], Check]:
    """Reachability of every configured node, and agreement of their versions with ours; ``gpu_out`` (when
    given) gets each answering node's GPU versions (``gpu`` of its report) by node under ``per_node``, and
    ``local``: whether no configured node is another machine."""
    mine = local_versions()
    keys = ("python", "torch", "cuda", "nccl")
    reports: dict[str, dict] = {}
    checks: list[Check] = []
    unreachable: list[str] = []
    remote = [h for h in configured_nodes(cfg) if not is_local(split_host(h)[0])]
    for spec in configured_nodes(cfg):
        host, port = split_host(spec)
        if is_local(host):
            reports[spec] = mine
            checks.append(Check(f"node:{spec}", True, "this machine"))
            continue
        err = tcp_connect(host, port, timeout)
        if err is not None:
            unreachable.append(spec)
            checks.append(
                Check(
                    f"node:{spec}",
                    False,
                    f"no TCP connection to {host}:{port} within {timeout:g} s ({err})",
                    f"check that {host} is up and resolvable, start `kc doctor --serve --port {port}` there, "
                    f"and open TCP port {port} (and the rendezvous port) in its firewall",
                    transient=not err.startswith("gaierror"),  # refused, timed out, unreachable; not a bad name
                )
            )
            continue
        try:
            reports[spec] = query_agent(host, port, timeout)
            checks.append(Check(f"node:{spec}", True, f"{host}:{port} reachable ({reports[spec].get('hostname')})"))
        except (OSError, ValueError) as exc:
            unreachable.append(spec)
            checks.append(
                Check(
                    f"node:{spec}",
                    False,
                    f"{host}:{port} accepts connections but is not a kc doctor agent ({exc})",
                    f"start `kc doctor --serve --port {port}` on {host}, or name its agent port as {host}:PORT",
                )
            )
    if gpu_out is not None:  # only the nodes that run ranks: a launching machine outside them needs no GPU
        gpu_out["per_node"] = {spec: r.get("gpu") for spec, r in reports.items()} or {"(this machine)": mine["gpu"]}
        gpu_out["local"] = not remote
    if not remote:
        return checks, Check("version_agreement", True, "local cluster: nothing to compare")
    if not any(is_local(split_host(h)[0]) for h in reports):  # the launching machine counts too
        reports["(this machine)"] = mine
    differ = {}
    for k in keys:
        vals = {spec: r.get(k) for spec, r in reports.items()}
        if len(set(map(str, vals.values()))) > 1:
            differ[k] = vals
    skipped = f"; not compared (unreachable): {', '.join(unreachable)}" if unreachable else ""
    if differ:
        detail = "; ".join(f"{k}: " + ", ".join(f"{h}={v}" for h, v in vals.items()) for k, vals in differ.items())
        return checks, Check(
            "version_agreement",
            False,
            f"versions differ across nodes: {detail}{skipped}",
            "install the same Python, torch, CUDA and NCCL on every node (same container image or lock file)",
        )
    agreed = ", ".join(f"{k} {mine.get(k)}" for k in keys)
    return checks, Check("version_agreement", True, f"{len(reports)} nodes agree: {agreed}{skipped}")


def check_node_agents(cfg: Any, gpu_out: dict[str, Any] | None = None) -> list[Check] | None:
    """A static or dynamic cluster whose pool has node agents (``kc node start``): the placement the launch would
    make (every static node live, enough live nodes for a dynamic one) and the agents' versions against ours.
    None when the pool has no agents or no Prefect API answers (then the TCP doctor agents are asked).
    ``gpu_out`` (when given) gets the placed nodes' GPU versions by name under ``per_node``, their
    ``NodeStatus`` under ``nodes`` and the pool's agent deployment under ``deployment`` (the NCCL smoke's)."""
    from kuangchao_core.sched.node_registry import list_nodes
    from kuangchao_core.sched.placement import NodeUnavailable, choose_nodes, cluster_pool

    if setting(cfg, "cluster.mode", "local") == "local":
        return None
    try:
        pool = cluster_pool(cfg)
        registered = list_nodes(pool)
    except Exception:  # noqa: BLE001 - no registry reachable: fall back to the TCP agents
        return None
    if not registered:
        return None
    try:
        placed = choose_nodes(cfg, registered)
    except NodeUnavailable as exc:
        if gpu_out is not None:
            gpu_out["per_node"] = {}  # no placement: nothing to compare or smoke
        fix = f"start `kc node start --pool {pool}` on the named machines (or fix cluster.nodes / nproc_per_node)"
        return [Check("node_agents", False, str(exc), fix)]
    by_name = {n.name: n for n in registered}
    if gpu_out is not None:
        from kuangchao_core.sched.nodes import deployment_name

        gpu_out["per_node"] = {a.name: by_name[a.name].facts.gpu for a in placed}
        gpu_out["nodes"] = [by_name[a.name] for a in placed]
        gpu_out["deployment"] = deployment_name(pool)
    checks = [
        Check(f"node:{a.name}", True, f"agent live at {a.address} ({a.ifname or 'default interface'}), ranks {a.ranks}")
        for a in placed
    ]
    mine = local_versions()
    differ = [
        f"{a.name}: torch {by_name[a.name].facts.torch}"
        for a in placed
        if by_name[a.name].facts.torch not in (None, mine.get("torch"))
    ]
    if differ:
        checks.append(
            Check(
                "version_agreement",
                False,
                f"torch differs from this machine's {mine.get('torch')}: {', '.join(differ)}",
                "install the same Python, torch, CUDA and NCCL on every node (same container image or lock file)",
            )
        )
    else:
        checks.append(Check("version_agreement", True, f"{len(placed)} node agents run torch {mine.get('torch')}"))
    return checks
