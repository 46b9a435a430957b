"""Context parallelism's step time and bytes: our ring attention at cp2 against the all-gather-K/V variant
torchtitan also offers, and against one process on the same sequence (issue 30).

Two Gloo processes. A Llama-style model (hidden 128, 2 layers, 4 query and 2 K/V heads) whose attention runs over
the CP group in one of two ways (``models.ring_attention.use_attention``): ``ring`` — ours, ``cp_attention``
(K/V shards passed around the ring, the next exchange overlapping the current block, a second ring pass in the
backward) — or ``allgather`` — every rank's K/V gathered before one local SDPA, ``dK``/``dV`` reduce-scattered in
the backward (``benchmarks/_allgather_kv.py``). Each rank keeps its load-balanced shard of the batch
(``parallel.context.shard_inputs``), the loss is the global batch's mean and gradients are summed over the group.
The baseline: the same model and sequence in one process (rank 0; rank 1 waits). A step is forward + backward +
AdamW, seen by rank 0; blocks of ``--steps`` steps rotate the three sides, and each block gives one ratio per
comparison, median ours ÷ median peer (``benchmarks/_ratios.py``).

Bytes: the comm layer's counters over one step of each cp2 side, against the formula from the shapes
(``_allgather_kv.payload_formula``: exact, so the run fails when they differ); times are reported, not asserted.
Torch's own ``context_parallel`` is not timed: torch 2.13 runs it only with the CUDA SDPA kernels.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/context_parallel.py [--blocks 10] [--steps 3] [--seq 2048]
    .venv/bin/python benchmarks/context_parallel.py --smoke     # seconds: one block of one step, seq 64

Ends with ``RESULT {json}``: ``ratio_vs_peer`` etc. keyed by comparison (``ring_vs_allgather_kv``,
``ring_vs_one_process``), each cp2 side's first loss against one process's, and ``bytes_per_step`` (counted,
formula, bytes a rank sends) per side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _allgather_kv import allgather_attention, counted, payload_formula, sent_bytes  # noqa: E402
from _engine_ranks import init_rank, run_ranks  # noqa: E402
from _ratios import FIELDS, block_stats, format_line, keyed_result_fields  # noqa: E402
from _results import emit  # noqa: E402

WORLD = 2
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32  # _model's
RESULT_KEYS = (*FIELDS, "first_loss_rel_diff", "bytes_per_step", "batch", "cp", "backend")


def _model(seq: int):
    from kuangchao_core.models.llama import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=344,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=seq,
    )
    model = LlamaForCausalLM(cfg)
    model.init_weights(11)
    return model


def _worker(rank: int, world: int, port: int, root: str, args, queue) -> None:
    init_rank(rank, world, port)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from kuangchao_core.comm import COMM_STATS
    from kuangchao_core.comm import primitives as P
    from kuangchao_core.comm.group import CommGroup
    from kuangchao_core.models.ring_attention import cp_attention, use_attention
    from kuangchao_core.parallel.context import shard_inputs

    group = CommGroup(list(range(world)), backend="gloo", name="cp")
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].contiguous()}
    count = batch["labels"].numel()
    local = shard_inputs(batch, world, rank)
    models = {"ring": _model(args.seq), "allgather": _model(args.seq), "one": _model(args.seq)}
    use_attention(models["ring"], cp_attention(group))
    use_attention(models["allgather"], allgather_attention(group))
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}

    def loss_of(model, b):
        logits = model(b["input_ids"], b.get("position_ids"))
        return F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="sum") / count

    def step_cp2(name: str) -> float:
        loss = loss_of(models[name], local)
        loss.backward()
        for p in models[name].parameters():
            P.all_reduce(p.grad, group=group)
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        return float(P.all_reduce(loss.detach().clone(), group=group))

    def step_one() -> float:
        if rank == 0:
            loss = loss_of(models["one"], batch)
            loss.backward()
            opts["one"].step()
            opts["one"].zero_grad(set_to_none=True)
            return float(loss.detach())
        return 0.0

    sides = {"ring": lambda: step_cp2("ring"), "allgather": lambda: step_cp2("allgather"), "one": step_one}
    first, counts = {}, {}
    for name, fn in sides.items():  # the first step of each: its loss, its bytes, and the warm-up
        before = COMM_STATS.bytes_by_op()
        first[name] = fn()
        counts[name] = counted(before, COMM_STATS.bytes_by_op())
    order = list(sides)
    times: dict[str, list[list[float]]] = {name: [] for name in sides}
    for blk in range(args.blocks):
        for name in order[blk % 3 :] + order[: blk % 3]:
            got = []
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                sides[name]()
                got.append(time.perf_counter() - t0)
            times[name].append(got)
    queue.put((rank, {"times": times, "first": first, "counted": counts}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="one block of one step at seq 64 (the test's run)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.blocks, args.steps, args.seq = 1, 1, 64
    out = run_ranks(WORLD, _worker, (args,))[0]
    times, first = out["times"], out["first"]
    stats = {
        "ring_vs_allgather_kv": block_stats(list(zip(times["ring"], times["allgather"], strict=True))),
        "ring_vs_one_process": block_stats(list(zip(times["ring"], times["one"], strict=True))),
    }
    med = {k: statistics.median(t for blk in v for t in blk) for k, v in times.items()}
    print(", ".join(f"{k} {v * 1e3:.1f} ms/step" for k, v in med.items()) + " (all blocks)")
    for name, st in stats.items():
        print(format_line(name.replace("_vs_", " ÷ "), st))
    n = args.seq // WORLD
    k_bytes = args.batch * KV_HEADS * n * HEAD_DIM * 4  # fp32
    nbytes = {}
    for side in ("ring", "allgather"):
        formula = {op: LAYERS * b for op, b in payload_formula(side, k_bytes, n, WORLD).items()}
        nbytes[side] = {
            "counted": out["counted"][side],
            "formula": formula,
            "sent_per_rank": sent_bytes(formula, WORLD),
        }
        print(
            f"{side}: bytes counted {out['counted'][side]}, formula {formula}; a rank sends {nbytes[side]['sent_per_rank']:,}"
        )
    result = {
        **keyed_result_fields(stats),
        "first_loss_rel_diff": {k: abs(first[k] - first["one"]) / abs(first["one"]) for k in ("ring", "allgather")},
        "bytes_per_step": nbytes,
        "batch": [args.batch, args.seq],
        "cp": WORLD,
        "backend": "gloo",
    }
    emit(result, RESULT_KEYS, smoke=args.smoke)
    wrong = [side for side, b in nbytes.items() if b["counted"] != b["formula"]]
    if wrong:
        print(f"context_parallel: the bytes counted differ from the formula for {wrong}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
