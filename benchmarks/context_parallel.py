"""Context parallelism's step time: ours at cp2 against one process on the same sequence, and against torch's own
context parallelism (``torch.distributed.tensor.experimental.context_parallel``) where torch can run it (issue 30).

Two Gloo processes. Ours: a Llama-style model (hidden 128, 2 layers, 4 query and 2 K/V heads) whose attention is
ring attention over the CP group (``models.ring_attention.use_attention`` + ``cp_attention``, what the trainer
sets at cp > 1); each rank keeps its load-balanced shard of the batch (``parallel.context.shard_inputs``), the loss
is the global batch's mean, and gradients are summed over the CP group (the trainer reduces them over dp×cp). The
baseline: the same model and sequence in one process (rank 0; rank 1 waits). A step is forward + backward +
AdamW, seen by rank 0; blocks of ``--steps`` steps alternate the two sides, the order flipped every block, and each
block gives one ratio, median cp2 step ÷ median one-process step (``benchmarks/_ratios.py``).

Torch's context parallelism: probed with one causal SDPA forward and backward on the two CPU ranks. Torch 2.13
dispatches only the CUDA flash, memory-efficient and cuDNN SDPA ops to its ring; on CPU the SDPA op is
``aten._scaled_dot_product_flash_attention_for_cpu``, which has no DTensor sharding strategy, so the probe fails
and the benchmark prints torch's exact error instead of a ratio. (Timing torch's ring needs two or more GPUs and
NCCL; this CPU/Gloo benchmark does not do it.)

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/context_parallel.py [--blocks 10] [--steps 3] [--seq 2048]
    .venv/bin/python benchmarks/context_parallel.py --smoke     # seconds: one block of one step, seq 64

Ends with ``RESULT {json}``: ``ratio_vs_peer`` etc. keyed by comparison (``cp2_vs_one_process``), ``torch_cp``
("ran" or torch's error).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _engine_ranks import init_rank, run_ranks  # noqa: E402
from _ratios import block_stats, format_line, keyed_result_fields  # noqa: E402

WORLD = 2


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


def probe_torch_cp(device) -> str:
    """ "ran" when torch's ``context_parallel`` runs a causal SDPA forward and backward on ``device`` over the
    default group, else torch's exception as ``Type: message``."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = DeviceMesh(device.type, list(range(WORLD)))
    q, k, v = (torch.randn(1, 4, 64, 16, device=device) for _ in range(3))  # buffers torch reshards in place
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
            for t in (q, k, v):
                t.requires_grad_()
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    except Exception as exc:  # torch's own refusal is the result
        cause = exc.__context__ if isinstance(exc, RuntimeError) and exc.__context__ is not None else exc
        return f"{type(cause).__name__}: {cause}"
    return "ran"


def _worker(rank: int, world: int, port: int, root: str, args, queue) -> None:
    init_rank(rank, world, port)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from kuangchao_core.comm import primitives as P
    from kuangchao_core.comm.group import CommGroup
    from kuangchao_core.models.ring_attention import cp_attention, use_attention
    from kuangchao_core.parallel.context import shard_inputs

    device = torch.device("cpu")
    torch_cp = probe_torch_cp(device)
    group = CommGroup(list(range(world)), backend="gloo", name="cp")
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].contiguous()}
    count = batch["labels"].numel()
    local = shard_inputs(batch, world, rank)
    ours, one = _model(args.seq), _model(args.seq)
    use_attention(ours, cp_attention(group))
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in (("cp2", ours), ("one", one))}

    def loss_of(model, b):
        logits = model(b["input_ids"], b.get("position_ids"))
        return F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="sum") / count

    def step_cp2() -> float:
        loss = loss_of(ours, local)
        loss.backward()
        for p in ours.parameters():
            P.all_reduce(p.grad, group=group)
        opts["cp2"].step()
        opts["cp2"].zero_grad(set_to_none=True)
        return float(P.all_reduce(loss.detach().clone(), group=group))

    def step_one() -> float:
        if rank == 0:
            loss = loss_of(one, batch)
            loss.backward()
            opts["one"].step()
            opts["one"].zero_grad(set_to_none=True)
            return float(loss.detach())
        return 0.0

    first = {"cp2": step_cp2(), "one": step_one()}  # also the warm-up
    sides = [("cp2", step_cp2), ("one", step_one)]
    times: dict[str, list[list[float]]] = {name: [] for name, _ in sides}
    for blk in range(args.blocks):
        for name, fn in sides if blk % 2 == 0 else sides[::-1]:
            got = []
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                got.append(time.perf_counter() - t0)
            times[name].append(got)
    queue.put((rank, {"times": times, "first": first, "torch_cp": torch_cp}))


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
    times = out["times"]
    stats = {"cp2_vs_one_process": block_stats(list(zip(times["cp2"], times["one"], strict=True)))}
    med = {k: statistics.median(t for blk in v for t in blk) for k, v in times.items()}
    first = out["first"]
    print(f"cp2 {med['cp2'] * 1e3:.1f} ms/step, one process {med['one'] * 1e3:.1f} ms/step (all blocks)")
    print(format_line("cp2 ÷ one process", stats["cp2_vs_one_process"]))
    print(f"torch's context_parallel on CPU/Gloo: {out['torch_cp']}")
    result = {
        **keyed_result_fields(stats),
        "first_loss_rel_diff": abs(first["cp2"] - first["one"]) / abs(first["one"]),
        "torch_cp": out["torch_cp"],
        "batch": [args.batch, args.seq],
        "cp": WORLD,
        "backend": "gloo",
    }
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
