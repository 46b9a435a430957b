"""DP gradient all-reduce across hosts: hierarchical vs flat, and fp16 / top-k compressed vs dense (issue 11).

Two bench hosts (network namespaces, links shaped with tbf to ``--rate``) × two ranks each, one DP group of four.
Every rank holds the gradient buckets of one Llama-style model (the sizes ``DataParallel`` would cut for it) and
sums them, alternating the methods in rounds (order flipped every round, so drift hits all alike):

- ``flat``: one ring all-reduce per bucket over all four ranks (the shaped link carries 2(n−1)/n of each bucket);
- ``hier``: reduce-scatter inside the host, all-reduce of the half-shard across, all-gather inside;
- ``hier+fp16`` / ``hier+topk``: the cross-host step compressed (fp16; top-k 1 % with error feedback).

    sudo .venv/bin/python benchmarks/allreduce_hier.py [--rounds 6] [--rate 400mbit]

Prints the median time per method with its interquartile range and ends with ``RESULT {json}``: time ratios
hier/flat (goal ≤ 0.6), compressed/dense-hier, and the cross-host bytes ratios (goal ≤ 0.55 fp16, ≤ 0.2 top-k).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import emit  # noqa: E402

METHODS = ("flat", "hier", "hier+fp16", "hier+topk")
RESULT_KEYS = ("link", "buckets", "elements", "hier_vs_flat", "fp16_vs_dense_time", "topk_vs_dense_time",
               "fp16_bytes_ratio", "topk_bytes_ratio", "goals")  # fmt: skip


def _bucket_sizes(bucket_mb: float, smoke: bool = False) -> list[int]:
    import torch

    from kuangchao_core.models.llama import PRESETS, LlamaConfig, LlamaForCausalLM
    from kuangchao_core.parallel.data import DataParallel

    cfg = PRESETS["tiny"] if smoke else LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        max_seq_len=64,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)

    class _One:  # a group of one: bucket layout only, no communication
        size, ranks, name = 2, [0, 1], "sizes"

    dp = DataParallel(model, _One(), bucket_cap_mb=bucket_mb)
    sizes = [b.buffer.numel() for b in dp._buckets]
    dp.remove_hooks()
    del torch
    return sizes


def worker(rounds: int, bucket_mb: float, smoke: bool = False) -> None:
    """One rank: time each method ``rounds`` times, print this rank's JSON."""
    import torch

    from kuangchao_core.comm import init_distributed
    from kuangchao_core.comm import primitives as P
    from kuangchao_core.comm.hierarchical import hierarchical_all_reduce
    from kuangchao_core.parallel.grad_compression import CastCompressor, TopKCompressor
    from kuangchao_core.parallel.mesh import ParallelMesh
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    torch.set_num_threads(1)
    init_distributed(backend="gloo", timeout_ms=600_000)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    nproc = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = [r // nproc for r in range(world)]
    mesh = ParallelMesh({"dp": world}, rank, world, backend="gloo", node_of_rank=nodes, hierarchical="on")
    sizes = _bucket_sizes(bucket_mb, smoke)
    gen = torch.Generator().manual_seed(rank)
    buckets = [torch.randn(n, generator=gen) for n in sizes]
    fp16, topk = CastCompressor("fp16"), TopKCompressor(0.01)
    comp = {"hier+fp16": fp16, "hier+topk": topk}

    def run(method: str) -> float:
        work = [b.clone() for b in buckets]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for key, t in enumerate(work):
            if method == "flat":
                P.all_reduce(t, group=mesh.dp_group)
            else:
                c = comp.get(method)
                cross = (lambda s, c=c, key=key: c.exchange(key, s, mesh.dp_inter_group)) if c else None
                hierarchical_all_reduce(t, mesh.dp_intra_group, mesh.dp_inter_group, cross=cross)
        torch.distributed.barrier()
        return time.perf_counter() - t0

    for m in METHODS:  # warm-up: connections, allocations
        run(m)
    fp16.bytes_sent = topk.bytes_sent = 0
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for r in range(rounds):
        order = METHODS if r % 2 == 0 else tuple(reversed(METHODS))
        for m in order:
            times[m].append(run(m))
    shard_bytes = sum(-(-n // nproc) * 4 for n in sizes) * rounds  # dense fp32 shard sent across per round
    print(
        json.dumps(
            {
                "rank": rank,
                "times": times,
                "bytes": {"dense": shard_bytes, "fp16": fp16.bytes_sent, "topk": topk.bytes_sent},
                "buckets": sizes,
            }
        ),
        flush=True,
    )
    torch.distributed.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--rate", default="400mbit")
    ap.add_argument("--bucket-mb", type=float, default=4.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="the tiny preset's buckets, one round")
    args = ap.parse_args()
    if args.smoke:
        args.rounds = 1
    if args.worker:
        worker(args.rounds, args.bucket_mb, args.smoke)
        return 0
    from _multihost import Bench, bench_unavailable, run_ranks, spread

    why = bench_unavailable()
    if why:
        print(f"allreduce_hier: the multi-host bench cannot run here: {why}", file=sys.stderr)
        return 2
    with Bench(2, args.rate) as bench:
        outs = run_ranks(
            bench,
            2,
            [sys.executable, __file__, "--worker", "--rounds", str(args.rounds), "--bucket-mb", str(args.bucket_mb)]
            + (["--smoke"] if args.smoke else []),
        )
    per_rank = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    r0 = per_rank[0]
    stats = {m: spread(r0["times"][m]) for m in METHODS}
    for m in METHODS:
        s = stats[m]
        print(f"{m:>10}: median {s['median'] * 1e3:8.1f} ms  (IQR {s['q1'] * 1e3:.1f}–{s['q3'] * 1e3:.1f}, n={s['n']})")

    def ratio(a: str, b: str) -> dict[str, float]:
        pairs = [x / y for x, y in zip(r0["times"][a], r0["times"][b], strict=True)]
        return {"median": spread(pairs)["median"], "q1": spread(pairs)["q1"], "q3": spread(pairs)["q3"]}

    b = r0["bytes"]
    result = {
        "link": args.rate,
        "buckets": len(r0["buckets"]),
        "elements": sum(r0["buckets"]),
        "hier_vs_flat": ratio("hier", "flat"),
        "fp16_vs_dense_time": ratio("hier+fp16", "hier"),
        "topk_vs_dense_time": ratio("hier+topk", "hier"),
        "fp16_bytes_ratio": b["fp16"] / b["dense"],
        "topk_bytes_ratio": b["topk"] / b["dense"],
        "goals": {"hier_vs_flat": 0.6, "fp16_bytes_ratio": 0.55, "topk_bytes_ratio": 0.2},
    }
    emit(result, RESULT_KEYS, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
