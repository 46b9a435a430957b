"""One rank of the doctor's all-reduce smoke (issue 44 item 5), started by torchrun on every node through the node
agents (as the topology probe's :mod:`~kuangchao_core.sched.probe_worker` is) or as a local process.

    python -m kuangchao_core.sched.nccl_smoke_worker --out DIR [--backend nccl|gloo] [--numel N]

It joins the group from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), sums
``rank + 1`` over every rank on its GPU (``LOCAL_RANK``) and writes ``DIR/rank_<r>.json`` with what it got;
:func:`kuangchao_core.sched.nccl_smoke.verify_rank_files` judges the files. Gloo is there for the CPU test of the
same path; the doctor runs it with NCCL only.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
from pathlib import Path

from kuangchao_core.sched.probe_worker import write_rank_json


def main(argv: list[str] | None = None) -> int:
    """Join the group, all-reduce once, write this rank's result."""
    parser = argparse.ArgumentParser(prog="kuangchao-nccl-smoke")
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("--numel", type=int, default=1 << 16)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        t = torch.full((args.numel,), float(rank + 1), device=device)
        dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        result = {
            "rank": rank,
            "world": world,
            "node": os.environ.get("KC_NODE") or socket.gethostname(),
            "backend": args.backend,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "value": float(t[0].item()),
            "uniform": bool(torch.equal(t, torch.full_like(t, t[0].item()))),
        }
        write_rank_json(Path(args.out), rank, result)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
