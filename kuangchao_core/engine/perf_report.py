"""``kc plan --scale N``: the predicted step of a config's layout and its weak-scaling efficiency at N GPUs.

The cluster is a described one (:meth:`~kuangchao_core.sched.perf_cluster.ClusterModel.described`): 8 GPUs per
node on NVLink, one NIC per GPU at 200 and at 400 Gb/s between nodes, 989.5 TFLOP/s bf16 peak at an assumed 40 %
MFU. The step of the config's own layout is predicted on as many such nodes as it needs; the efficiency at N GPUs
keeps tp, pp and the per-GPU batch and sets ``dp = N/(tp·pp)`` (weak scaling,
:func:`~kuangchao_core.sched.perf_scaling.scaling_point`), for each DP gradient method.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kuangchao_core.sched.perf_model import ClusterModel, Layout, predict_step
from kuangchao_core.sched.perf_scaling import scaling_point

INTER_GBIT_PER_S = (200.0, 400.0)
SCALE_METHODS = ("flat", "hierarchical", "fp16", "topk")
GPUS_PER_NODE = 8


def _described(n_gpus: int, inter_gbit_per_s: float) -> ClusterModel:
    per_node = min(GPUS_PER_NODE, n_gpus)
    return ClusterModel.described(-(-n_gpus // per_node), per_node, inter_gbit_per_s=inter_gbit_per_s)


def scale_report(
    model_cfg: Any,
    layout: Layout,
    sizes: Iterable[int],
    methods: Iterable[str] = SCALE_METHODS,
    inter_gbit_per_s: Iterable[float] = INTER_GBIT_PER_S,
    topk_ratio: float = 0.01,
    overlap_dp: bool = False,
) -> dict[str, Any]:
    """JSON-ready predictions: ``step`` (the layout as configured, per bandwidth and method) and ``scaling``
    (efficiency per GPU count, bandwidth and method). Raises ValueError when a size is not a multiple of tp·pp."""
    methods, bws, sizes = list(methods), list(inter_gbit_per_s), list(sizes)
    kw = {"topk_ratio": topk_ratio, "overlap_dp": overlap_dp}
    step = []
    for bw in bws:
        cluster = _described(layout.world_size, bw)
        for method in methods:
            pred = predict_step(model_cfg, layout, cluster, method=method, **kw)
            step.append(
                {
                    "inter_gbit_per_s": bw,
                    "cluster": cluster.name,
                    "method": method,
                    **pred.breakdown,
                    "step_s": pred.step_s,
                    "tokens_per_s": pred.tokens_per_s,
                    "mfu": pred.mfu,
                    "dp_comm_total_s": pred.dp_comm_s,
                    "dp_bytes_per_rank": pred.dp_bytes_per_rank,
                }
            )
    scaling = []
    for n in sizes:
        for bw in bws:
            for method in methods:
                point = scaling_point(model_cfg, layout, lambda g, bw=bw: _described(g, bw), n, method, **kw)
                pred = point.pop("prediction")
                scaling.append(
                    {**point, "inter_gbit_per_s": bw, "step_s": pred.step_s, "tokens_per_s": pred.tokens_per_s}
                )
    c = _described(GPUS_PER_NODE, bws[0])
    return {
        "assumptions": {
            "gpus_per_node": GPUS_PER_NODE,
            "intra_gbyte_per_s": c.intra.bandwidth_gbyte_per_s,
            "flops_per_s_per_gpu": c.flops_per_s,
            "peak_flops_per_s_per_gpu": c.peak_flops_per_s,
            "topk_ratio": topk_ratio,
            "overlap_dp": overlap_dp,
            "seq_len": layout.seq_len,
            "bytes_per_element": layout.bytes_per_element,
        },
        "layout": layout.layout_dict(),
        "step": step,
        "scaling": scaling,
    }


def _method_label(method: str, ratio: float) -> str:
    return f"topk {100 * ratio:g}%" if method == "topk" else method


def format_scale_report(report: dict[str, Any]) -> str:
    """Human-readable text of :func:`scale_report`."""
    a, lay = report["assumptions"], report["layout"]
    lines = [
        "predicted step (alpha-beta + FLOP model; "
        f"{a['flops_per_s_per_gpu'] / 1e12:.1f} TFLOP/s per GPU = {a['peak_flops_per_s_per_gpu'] / 1e12:.1f} peak x "
        f"{a['flops_per_s_per_gpu'] / a['peak_flops_per_s_per_gpu']:.0%} MFU; {a['gpus_per_node']} GPUs per node, "
        f"NVLink {a['intra_gbyte_per_s']:.0f} GB/s; {a['bytes_per_element']}-byte gradients and activations; "
        f"DP {'overlapped with' if a['overlap_dp'] else 'after'} the backward pass):",
        f"  layout dp={lay['dp']} x tp={lay['tp']} x pp={lay['pp']}, ZeRO {lay['zero_stage']}, "
        f"{lay['gradient_accumulation_steps']} micro-batches of {lay['micro_batch_size']} x {a['seq_len']} tokens",
        "  between nodes  DP method      compute ms  bubble ms     TP ms     PP ms     DP ms   step ms     tokens/s"
        "    MFU",
    ]
    for r in report["step"]:
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        times = "".join(
            f"{1e3 * r[k]:>10.4g}" for k in ("compute_s", "bubble_s", "tp_comm_s", "pp_comm_s", "dp_comm_s")
        )
        lines.append(
            f"  {r['inter_gbit_per_s']:>6g} Gb/s    {_method_label(r['method'], a['topk_ratio']):<13}{times}"
            f"{1e3 * r['step_s']:>10.4g}{r['tokens_per_s']:>13,.0f}{mfu:>7}"
        )
    methods = list(dict.fromkeys(r["method"] for r in report["scaling"]))
    lines.append(
        "weak-scaling efficiency (per-GPU batch fixed; tokens/s at N / (N x one GPU's compute-only tokens/s)):"
    )
    lines.append("   GPUs  between nodes  " + "".join(f"{_method_label(m, a['topk_ratio']):>14}" for m in methods))
    rows: dict[tuple[int, float], dict[str, float]] = {}
    for r in report["scaling"]:
        rows.setdefault((r["n_gpus"], r["inter_gbit_per_s"]), {})[r["method"]] = r["efficiency"]
    for (n, bw), effs in rows.items():
        lines.append(f"  {n:>5}  {bw:>6g} Gb/s    " + "".join(f"{100 * effs[m]:>13.1f}%" for m in methods))
    return "\n".join(lines)
