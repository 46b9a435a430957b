"""Our DataParallel against torch's DistributedDataParallel: same model, same data, 2 Gloo processes.

Both wrappers train their own copy of one small Llama-style model (same initial weights) on the same batches.
They are alternated in blocks (each block ``--steps`` steps of ours and as many of DDP, the order flipped every
block, so that load drift on a shared machine hits both alike). A step is forward + backward + gradient sync +
AdamW step, as seen by rank 0; each block gives one ratio, median step of ours ÷ median step of DDP in the block
(``benchmarks/_ratios.py``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dp_vs_ddp.py [--blocks 20] [--steps 4] [--bucket-mb 25]

Ends with ``RESULT {"ratio_vs_peer": median of the per-block ratios, "ratio_iqr": [q1, q3], "ratio_min_max":
[min, max], "blocks": n, ...}`` (DESIGN.md §4).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _ratios import FIELDS, block_stats, format_line, result_fields
from _results import emit

from kuangchao_core.sched.launcher import free_port

WORLD = 2
RESULT_KEYS = (*FIELDS, "ours_median_s", "ddp_median_s", "params_equal")


def _model_config():
    from kuangchao_core.models.llama import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        max_seq_len=64,
    )


def _build(seed: int):
    from kuangchao_core.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(_model_config())
    model.init_weights(seed)
    return model


def _worker(rank: int, port: int, args, queue) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        from kuangchao_core.comm import CommGroup
        from kuangchao_core.models.llama import causal_lm_loss
        from kuangchao_core.parallel.data import DataParallel
        from kuangchao_core.perm.guard_api import AllowAll, install_guard

        install_guard(AllowAll())  # trusted mode: the benchmark measures the data path, not token checks
        group = CommGroup(ranks=list(range(WORLD)), backend="gloo", name="dp")
        ours_model, ddp_model = _build(1), _build(1)
        ours = DataParallel(ours_model, group, bucket_cap_mb=args.bucket_mb)
        ours.sync_parameters()
        ddp = torch.nn.parallel.DistributedDataParallel(ddp_model, bucket_cap_mb=args.bucket_mb)
        opts = {
            "ours": torch.optim.AdamW(ours_model.parameters(), lr=1e-3, foreach=False),
            "ddp": torch.optim.AdamW(ddp_model.parameters(), lr=1e-3, foreach=False),
        }
        vocab = _model_config().vocab_size

        def batch(step: int):
            gen = torch.Generator().manual_seed(step * WORLD + rank)
            tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
            return tokens[:, :-1], tokens[:, 1:]

        def step_ours(x, y):
            causal_lm_loss(ours(x), y).backward()
            ours.finish_gradient_sync()
            opts["ours"].step()
            ours.zero_grad()

        def step_ddp(x, y):
            causal_lm_loss(ddp(x), y).backward()
            opts["ddp"].step()
            opts["ddp"].zero_grad()

        runners = {"ours": step_ours, "ddp": step_ddp}
        # times[name][block] = that block's step times
        times: dict[str, list[list[float]]] = {"ours": [], "ddp": []}
        for fn in runners.values():  # warm-up (allocations, DDP's bucket rebuild)
            for s in range(2):
                fn(*batch(s))
        for blk in range(args.blocks):
            order = ("ours", "ddp") if blk % 2 == 0 else ("ddp", "ours")
            for name in order:
                dist.barrier()
                got = []
                for s in range(args.steps):
                    x, y = batch(blk * args.steps + s)
                    t0 = time.perf_counter()
                    runners[name](x, y)
                    got.append(time.perf_counter() - t0)
                times[name].append(got)
        same = all(
            torch.allclose(p, q, rtol=1e-4, atol=1e-6)
            for p, q in zip(ours_model.parameters(), ddp_model.parameters(), strict=True)
        )
        queue.put((rank, {"times": times, "same_params": same, "buckets": ours.num_buckets}))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", "--rounds", dest="blocks", type=int, default=20, help="blocks of ours + DDP")
    parser.add_argument("--steps", type=int, default=4, help="steps of each side per block")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--smoke", action="store_true", help="one block of one step, batch 2 x 16 (seconds)")
    args = parser.parse_args()
    if args.smoke:
        args.blocks, args.steps, args.batch, args.seq = 1, 1, 2, 16

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args, queue)) for r in range(WORLD)]
    t_start = time.perf_counter()
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in range(WORLD))
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a benchmark worker failed: exit codes {[p.exitcode for p in procs]}")

    times = results[0]["times"]
    stats = block_stats(list(zip(times["ours"], times["ddp"], strict=True)))
    pooled = {name: [t for blk in times[name] for t in blk] for name in times}
    ours_med = statistics.median(pooled["ours"])
    ddp_med = statistics.median(pooled["ddp"])
    n_params = _build(1).config.num_params()
    print(f"model: Llama-like, {n_params / 1e6:.2f} M params; 2 Gloo processes; batch {args.batch}x{args.seq} per rank")
    print(
        f"blocks {args.blocks} x {args.steps} steps, bucket {args.bucket_mb} MiB, ours used {results[0]['buckets']} buckets"
    )
    print(f"{'impl':<6} {'median s':>10} {'min s':>10} {'max s':>10} {'steps':>6}")
    for name, med in (("ours", ours_med), ("ddp", ddp_med)):
        ts = pooled[name]
        print(f"{name:<6} {med:>10.4f} {min(ts):>10.4f} {max(ts):>10.4f} {len(ts):>6}")
    print(format_line("ours/ddp", stats))
    print(f"parameters equal after training: {results[0]['same_params']}")
    print(f"wall time {time.perf_counter() - t_start:.1f} s")
    result = {
        **result_fields(stats),
        "ours_median_s": round(ours_med, 5),
        "ddp_median_s": round(ddp_med, 5),
        "params_equal": results[0]["same_params"],
    }
    emit(result, RESULT_KEYS, smoke=args.smoke)


if __name__ == "__main__":
    main()
