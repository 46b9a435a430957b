"""Our tensor parallelism against torch DTensor TP (``parallelize_module`` with ColwiseParallel/RowwiseParallel):
the same small Llama model, tp=2 on 2 Gloo processes.

Ours: :func:`kuangchao_core.models.tp_llama.build_tp_model` (vocab-parallel embedding and cross-entropy, one
copy-to-region per block). Peer: the one-process ``LlamaForCausalLM`` parallelized with torchtitan's Llama plan
(q/k/v/gate/up colwise, o/down rowwise, embedding rowwise from replicated ids, lm_head colwise with replicated
output and the ordinary cross-entropy). Both start from the same weights; their first losses are checked to agree.
Blocks of ``--steps`` steps alternate between the two, the order flipped every block; a step is forward +
backward + AdamW step as seen by rank 0, and each block gives one ratio, median step of ours ÷ median step of
DTensor in the block (``benchmarks/_ratios.py``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tp_vs_dtensor.py [--blocks 16] [--steps 4]

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
RESULT_KEYS = (
    *FIELDS,
    "ours_median_step_s",
    "dtensor_median_step_s",
    "steps_each",
    "first_loss_ours",
    "first_loss_dtensor",
    "first_loss_rel_diff",
    "ours_comm_ops_per_step",
    "model",
    "batch",
    "tp",
    "backend",
)
BATCH, SEQ = 4, 64


def _model_config():
    from kuangchao_core.models.llama import LlamaConfig

    return LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        max_seq_len=SEQ,
    )


def _peer_model(cfg, seed: int):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from kuangchao_core.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(cfg)
    model.init_weights(seed)
    mesh = DeviceMesh("cpu", list(range(WORLD)))
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[p + name] = ColwiseParallel()
        plan[p + "self_attn.o_proj"] = RowwiseParallel()
        plan[p + "mlp.down_proj"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _worker(rank: int, port: int, args, queue) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        from kuangchao_core.comm import COMM_STATS
        from kuangchao_core.models.llama import causal_lm_loss
        from kuangchao_core.models.tp_llama import build_tp_model
        from kuangchao_core.parallel.mesh import ParallelMesh
        from kuangchao_core.perm.guard_api import AllowAll, install_guard

        install_guard(AllowAll())
        cfg = _model_config()
        mesh = ParallelMesh(dp=1, tp=WORLD, pp=1, backend="gloo", timeout_ms=120_000)
        ours = build_tp_model(cfg, mesh.tp_group, seed=11)
        peer = _peer_model(cfg, seed=11)
        opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3)
        opt_peer = torch.optim.AdamW(peer.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=gen)
        ids, labels = tokens[:, :-1], tokens[:, 1:]

        def step_ours() -> float:
            loss = ours.loss(ours(ids), labels)
            loss.backward()
            opt_ours.step()
            opt_ours.zero_grad(set_to_none=True)
            return loss.item()

        def step_peer() -> float:
            loss = causal_lm_loss(peer(ids), labels)
            loss.backward()
            opt_peer.step()
            opt_peer.zero_grad(set_to_none=True)
            return loss.item()

        first = (step_ours(), step_peer())  # also the warm-up
        for _ in range(2):
            step_ours()
            step_peer()
        times: dict[str, list[list[float]]] = {"ours": [], "dtensor": []}  # [block][step]
        comm_ops = 0
        for blk in range(args.blocks):
            order = [("ours", step_ours), ("dtensor", step_peer)]
            if blk % 2:
                order.reverse()
            for name, fn in order:
                got = []
                for _ in range(args.steps):
                    dist.barrier()
                    COMM_STATS.reset()
                    t0 = time.perf_counter()
                    fn()
                    got.append(time.perf_counter() - t0)
                    if name == "ours":
                        comm_ops = sum(COMM_STATS.counts_by_op().values())
                times[name].append(got)
        if rank == 0:
            queue.put({"times": times, "first_losses": first, "ours_comm_ops_per_step": comm_ops})
    except BaseException as exc:  # report any failure to the parent
        import traceback

        queue.put({"error": f"rank {rank}: {exc}\n{traceback.format_exc()}"})
        raise
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", "--rounds", dest="blocks", type=int, default=16, help="blocks of ours + DTensor")
    parser.add_argument("--steps", type=int, default=4, help="steps of each side per block")
    parser.add_argument("--smoke", action="store_true", help="one block of one step (seconds)")
    args = parser.parse_args()
    if args.smoke:
        args.blocks, args.steps = 1, 1
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    if "error" in out:
        raise SystemExit(out["error"])
    times = out["times"]
    stats = block_stats(list(zip(times["ours"], times["dtensor"], strict=True)))
    med = {k: statistics.median(t for blk in v for t in blk) for k, v in times.items()}
    ours_loss, peer_loss = out["first_losses"]
    result = {
        **result_fields(stats),
        "ours_median_step_s": round(med["ours"], 5),
        "dtensor_median_step_s": round(med["dtensor"], 5),
        "steps_each": args.blocks * args.steps,
        "first_loss_ours": ours_loss,
        "first_loss_dtensor": peer_loss,
        "first_loss_rel_diff": abs(ours_loss - peer_loss) / abs(peer_loss),
        "ours_comm_ops_per_step": out["ours_comm_ops_per_step"],
        "model": {k: v for k, v in vars(_model_config()).items() if k != "rope_theta"},
        "batch": [BATCH, SEQ],
        "tp": WORLD,
        "backend": "gloo",
    }
    print(f"ours {med['ours'] * 1e3:.1f} ms/step, DTensor {med['dtensor'] * 1e3:.1f} ms/step (all blocks)")
    print(format_line("ours/dtensor", stats))
    emit(result, RESULT_KEYS, smoke=args.smoke)


if __name__ == "__main__":
    main()
