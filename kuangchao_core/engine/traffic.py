"""What each parallel group moves per optimizer step, and where that traffic lands under a placement (SPEC L4.1).

:func:`group_traffic` estimates the bytes one member of each group kind sends per step from the model and the
layout (the node-level placement puts the heaviest kind innermost); :func:`link_report` says, for a
:class:`~kuangchao_core.sched.rank_placement.RankPlacement`, which groups of each node stay inside it and how many
bytes per step cross to other nodes (``kc plan`` and the run's placement record print it).
"""

from __future__ import annotations

from typing import Any

from kuangchao_core.axes import MeshAxes, group_name
from kuangchao_core.config.access import setting
from kuangchao_core.engine.plan_experts import expert_parallel_size, expert_traffic, split_elements
from kuangchao_core.models.layout import slices_for_rank
from kuangchao_core.models.llama import config_from_model_section


def group_traffic(cfg: Any) -> dict[str, float]:
    """Bytes one member of each group kind sends per optimizer step (ring algorithms), ``{"tp", "pp", "dp"}`` and
    ``"cp"`` when the layout has context parallelism.

    With b micro-batch, s sequence length (the s/c tokens of a rank under CP: the TP and PP terms count those), h
    hidden size, L layers, m micro-batches per step, e bytes per element (4 in fp32), Ψ parameters per rank:

    - TP (Megatron layers): 4 all-reduces of b·s·h·e per layer and micro-batch (2 forward, 2 backward), each
      sending 2(t−1)/t of its size: ``4 · (L/p) · m · b·s·h·e · 2(t−1)/t``;
    - PP: activations forward and their gradients backward over each stage boundary: ``2 · v · m · b·s·h·e``;
    - DP: one all-reduce of the gradients over the d·c ranks holding the same parameters: ``2(dc−1)/(dc) · Ψ · 4``
      (at cp > 1 :func:`link_report` puts these bytes on the ``dp_cp`` groups);
    - TP with sequence parallelism (``parallel.sequence_parallel``): each all-reduce becomes an all-gather and a
      reduce-scatter, (t−1)/t of b·s·h·e each — the same bytes on a ring — and per layer and micro-batch the
      backward all-gathers the two saved norm outputs again; the vocabulary-parallel embedding reduce-scatters
      (backward: all-gathers) and the head all-gathers (backward: reduce-scatters); the 2L/p + 1 norm weights'
      gradients (h elements each, 1 on the stage without the final norm) are all-reduced every micro-batch:
      ``m · ((10·L/p + 2·E) · b·s·h·e · (t−1)/t + (2·L/p + N) · h·e · 2(t−1)/t)`` with E the ends on the stage
      (embedding, head: 2 without a pipeline, 1 on the busiest stage with one) and N = 1 (the final norm, on
      the busiest stage);
    - CP (ring attention, c ranks, k = key/value width per TP rank): every layer and micro-batch each rank passes
      its s/c tokens' K and V on c−1 times forward, again c−1 times in the backward, and the dK/dV accumulators
      c times (the last hop returns them to their owner): ``(6c − 4) · (L/p) · m · b·(s/c)·k·e``;
    - EP (``parallel.expert_parallel_size`` > 1, issue 40): the tokens' all-to-alls on ``ep`` and the experts'
      gradient sum on ``dp_mod_ep`` (:func:`~kuangchao_core.engine.plan_experts.expert_traffic`); the DP term then
      counts the parameters other than the routed experts.
    """

    mcfg = config_from_model_section(cfg.model)
    par = cfg.parallel
    axes = MeshAxes.from_parallel(par)
    dp, tp, pp, cp = axes.dp, axes.tp, axes.pp, axes.cp
    v, m, b = par.virtual_pipeline_size, par.gradient_accumulation_steps, par.micro_batch_size
    seq = setting(cfg, "data.seq_len", None) or mcfg.max_seq_len
    e = 4.0
    act = b * seq / cp * mcfg.hidden_size * e  # a CP rank's TP and PP tensors hold its s/c tokens
    slices = slices_for_rank(mcfg, tp, 0, pp, 0, v)
    psi = sum(r.numel for r in slices.values())
    if expert_parallel_size(par) > 1:  # the routed experts are summed over dp_mod_ep, not dp
        psi = split_elements(slices, expert_parallel_size(par))[0]
    layers, share = mcfg.num_layers / pp, (tp - 1) / tp
    tp_bytes = 4 * layers * m * act * 2 * share
    if tp > 1 and setting(cfg, "parallel.sequence_parallel", False):
        ends = 2 if pp == 1 else 1  # the busiest stage: the last (head and final norm)
        tp_bytes = m * ((10 * layers + 2 * ends) * act * share + (2 * layers + 1) * mcfg.hidden_size * e * 2 * share)
    out = {
        "tp": tp_bytes if tp > 1 else 0.0,
        "pp": 2 * v * m * act if pp > 1 else 0.0,
        "dp": 2 * (dp * cp - 1) / (dp * cp) * psi * 4 if dp * cp > 1 else 0.0,
    }
    if cp > 1:
        kv_width = max(mcfg.num_kv_heads // tp, 1) * mcfg.head_dim
        out["cp"] = (6 * cp - 4) * layers * m * b * (seq / cp) * kv_width * e
    return out | expert_traffic(mcfg, par, seq, slices, e)


def link_report(placement: Any, cfg: Any) -> list[dict[str, Any]]:
    """Per node: its ranks, the groups they belong to, and the bytes per step each group sends inside the node
    and over the node's links to other nodes (from :func:`group_traffic`)."""
    axes = MeshAxes.from_parallel(cfg.parallel)
    traffic = placement.traffic or group_traffic(cfg)
    node_of = placement.node_of_rank()
    out = []
    for i, name in enumerate(placement.nodes):
        mine = placement.ranks_of_node(i)
        groups: dict[str, dict[str, Any]] = {}
        inside = across = 0.0
        for kind in axes.active():
            for ranks in axes.groups(kind):
                members = [r for r in ranks if r in mine]
                if len(ranks) < 2 or not members:
                    continue
                spans = sorted({placement.nodes[node_of[r]] for r in ranks})
                per_member = _bytes_of(traffic, kind, axes.cp)
                crosses = len(spans) > 1
                groups[group_name(kind, ranks)] = {"members_here": members, "nodes": spans, "crosses_nodes": crosses}
                if crosses:
                    across += per_member * len(members)
                else:
                    inside += per_member * len(members)
        out.append(
            {
                "node": name,
                "ranks": mine,
                "groups": groups,
                "bytes_per_step_inside": inside,
                "bytes_per_step_across": across,
            }
        )
    return out


def _bytes_of(traffic: dict[str, float], kind: str, cp: int) -> float:
    """Bytes per member of a group ``kind``: at cp > 1 the gradients' reduction (``traffic["dp"]``) runs on the
    ``dp_cp`` groups, not on the ``dp`` ones."""
    if cp > 1 and kind in ("dp", "dp_cp"):
        return traffic.get("dp", 0.0) if kind == "dp_cp" else 0.0
    return traffic.get(kind, 0.0)


def described_placement(cfg: Any, report: Any = None) -> dict[str, Any] | None:
    """The placement ``kc plan`` shows for a static cluster's described nodes (``cluster.nodes`` with ``gpus`` or
    ``nproc_per_node``), from ``report`` (a probe's :class:`~kuangchao_core.sched.topology.TopologyReport` of those
    nodes) when given, else from the traffic estimate alone; None for other clusters."""
    from kuangchao_core.sched.rank_placement import place_ranks, placement_sizes

    cluster, par = cfg.cluster, cfg.parallel
    workers = cluster.worker_nodes if cluster.mode == "static" else []
    if not workers:
        return None
    nproc = int(cluster.nproc_per_node or workers[0].gpus or 0)
    names = [w.host for w in workers]
    if not nproc or nproc * len(names) != par.world_size:
        return None
    bw = lat = None
    if report is not None and all(n in report.nodes for n in names):
        bw, lat = report.submatrix(names, "bandwidth"), report.submatrix(names, "latency")
    traffic = group_traffic(cfg)
    placement = place_ranks(
        placement_sizes(par),
        names,
        nproc,
        traffic=traffic,
        mode=cluster.placement,
        node_bandwidth=bw,
        node_latency=lat,
    )
    return {"placement": placement.to_dict(), "links": link_report(placement, cfg), "measured": bw is not None}


def format_placement(described: dict[str, Any]) -> str:
    """Text lines for ``kc plan``: per node its ranks, the groups inside and across, bytes per step each way."""
    p = described["placement"]
    head = f"placement ({p['mode']}, {'measured links' if described['measured'] else 'traffic estimate only'}):"
    lines = [head]
    for row in described["links"]:
        inside = sorted(g for g, v in row["groups"].items() if not v["crosses_nodes"])
        across = sorted(g for g, v in row["groups"].items() if v["crosses_nodes"])
        lines.append(
            f"  {row['node']}: ranks {row['ranks']}; inside {', '.join(inside) or '-'} "
            f"({row['bytes_per_step_inside'] / 2**20:.4g} MiB/step); across {', '.join(across) or '-'} "
            f"({row['bytes_per_step_across'] / 2**20:.4g} MiB/step over the node's links)"
        )
    return "\n".join(lines)
