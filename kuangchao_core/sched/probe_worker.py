"""One rank of the node-to-node topology probe (SPEC L4.2), started by torchrun on every candidate node.

    python -m kuangchao_core.sched.probe_worker --out DIR [--small BYTES] [--large BYTES] [--iters N]

The node agents run it like a training share (:func:`kuangchao_core.sched.node_probe.probe_nodes`): ranks inside a
node meet over its loopback, ranks of different nodes over the training interface (``GLOO_SOCKET_IFNAME``).
Each rank measures the collective and every pair (:func:`~kuangchao_core.sched.topology.measure_rank`), the
matrix-multiply rate it gets while every rank computes at once (the compute figure the step-time model needs),
and, on GPU nodes, local rank 0 reads the device links (``nvidia-smi topo -m``); it writes
``DIR/rank_<r>.json``. It runs before capability tokens exist and talks to ``torch.distributed`` directly.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def write_rank_json(out: Path, rank: int, result: dict[str, Any]) -> None:
    """``out/rank_<rank>.json``, written atomically (the launcher reads every rank's file once the ranks exit)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".rank_{rank}.json.tmp"
    tmp.write_text(json.dumps(result), encoding="utf-8")
    os.replace(tmp, out / f"rank_{rank}.json")


def matmul_rate(n: int = 256, seconds: float = 0.5) -> float:
    """FLOP/s of fp32 ``n×n`` matrix products on this process's device, timed for about ``seconds``."""
    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    a @ b
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        count += 1
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * count / (time.perf_counter() - t0)


def device_links() -> dict[str, Any]:
    """Links between this node's GPUs: ``{"kind": "cpu"}`` without CUDA, else the ``nvidia-smi topo -m`` matrix
    (``NV<k>`` = k NVLinks; ``PIX``/``PXB``/``PHB``/``NODE``/``SYS`` = PCIe paths) and the NVLink pairs."""
    import torch

    if not torch.cuda.is_available():
        return {"kind": "cpu", "nvlink_pairs": []}
    from kuangchao_core.sched.device_topology import read_nvidia_smi_topo

    return {"kind": "cuda", **read_nvidia_smi_topo()}


def main(argv: list[str] | None = None) -> int:
    """Measure this rank and write its JSON."""
    parser = argparse.ArgumentParser(prog="kuangchao-probe-worker")
    parser.add_argument("--out", required=True)
    parser.add_argument("--small", type=int, default=8)
    parser.add_argument("--large", type=int, default=1 << 20)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    from kuangchao_core.sched.topology import measure_rank

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    try:
        result = measure_rank((args.small, args.large), args.iters)
        dist.barrier()
        result["flops_per_s"] = matmul_rate()  # every rank at once: what a rank gets when all compute
        dist.barrier()
        result["node"] = os.environ.get("KC_NODE") or result["hostname"]
        result["local_rank"] = int(os.environ.get("LOCAL_RANK", "0"))
        if result["local_rank"] == 0:
            result["device_links"] = device_links()
        write_rank_json(Path(args.out), result["rank"], result)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
