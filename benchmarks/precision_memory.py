"""Memory per rank of the ZeRO stages, and what activation checkpointing saves and costs (issue 12's benchmark).

ZeRO: four Gloo processes run the engine's Trainer (tiny preset widths, 4 layers) at dp4 for one step with
``zero_stage`` 0, 1, 2 and 3; each stage's bytes of parameters, gradients and AdamW state per rank are measured from
the engine's tensors after the step (``GradSync.tensor_bytes``), beside 16Ψ (ZeRO-0),
4Ψ + 4Ψ + 8Ψ/N, 4Ψ + 12Ψ/N and 16Ψ/N. Goal: ZeRO-3 ≤ 0.30× ZeRO-0.

One process trains a Llama-style model (the tiny preset's widths, 4 layers, 8 × 256 tokens per step) with
``none``, ``full`` and ``selective`` activation checkpointing, alternated in blocks (order rotated every block).
Memory: the C heap bytes the forward leaves held (``kuangchao_core.hal.heap``), per mode after a warm-up; time:
per-block ratios of the median step time (forward + backward + AdamW) against ``none`` (``benchmarks/_ratios.py``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/precision_memory.py [--blocks 10] [--steps 4] [--skip-zero]

Goals (the issue): ZeRO-3 ≤ 0.30× ZeRO-0; activation memory full ≤ 0.5×, selective ≤ 0.75× of none; step time full ≤ 1.35×, selective
≤ 1.15×. Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _engine_ranks import init_rank, run_ranks  # noqa: E402
from _ratios import block_stats, format_line, keyed_result_fields  # noqa: E402
from _results import emit  # noqa: E402

MODES = ("none", "full", "selective")
ZERO_WORLD = 4  # --smoke: 2
RESULT_KEYS = (
    "zero_bytes_per_rank",
    "zero_vs_zero0",
    "activation_memory_vs_none",
    "activation_bytes",
    "step_time_ratio_vs_peer",
    "step_time_ratio_iqr",
    "step_time_ratio_min_max",
    "step_time_blocks",
    "goals",
)


def _zero_worker(rank: int, world: int, port: int, root: str, queue) -> None:
    init_rank(rank, world, port)
    import torch

    from kuangchao_core.comm import world_group
    from kuangchao_core.config import config_from_dict
    from kuangchao_core.config.settings import run_settings
    from kuangchao_core.engine.trainer import Trainer
    from kuangchao_core.parallel.mesh import ParallelMesh

    out = {}
    for stage in (0, 1, 2, 3):
        cfg = config_from_dict(
            {
                "task": {"name": f"zero{stage}", "seed": 1},
                "model": {"preset": "tiny", "num_layers": 4},
                "data": {"format": "synthetic", "seq_len": 32, "synthetic": {"num_train": 256, "num_eval": 8}},
                "parallel": {"data_parallel_size": world, "zero_stage": stage, "micro_batch_size": 2},
                "optimizer": {"lr": 1e-3},
                "train": {"steps": 1, "device": "cpu", "log_interval": 100},
                "permission": {"mode": "trusted"},
                "checkpoint": {"dir": f"{root}/ckpt", "interval": 100, "resume": "never"},
                "tracking": {"uri": f"sqlite:///{root}/mlflow.db"},
            }
        )
        mesh = ParallelMesh.from_config(cfg.parallel, rank, world)
        trainer = Trainer(run_settings(cfg), rank, world, torch.device("cpu"), world_group(), mesh)
        trainer.run(resume="never", max_steps=1)
        out[stage] = trainer.sync.tensor_bytes()
        out["psi"] = trainer.model_config.num_params()
        trainer.barrier()
    queue.put((rank, out))


def zero_memory(world: int = ZERO_WORLD) -> dict:
    """Bytes per rank (the largest over the ``world`` ranks) of parameters + gradients + AdamW state by ZeRO stage."""
    results = run_ranks(world, _zero_worker)
    psi = results[0]["psi"]
    per_stage = {stage: max(sum(results[r][stage].values()) for r in range(world)) for stage in (0, 1, 2, 3)}
    n = world
    formula = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}
    return {"psi": psi, "bytes": per_stage, "formula": formula}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--skip-zero", action="store_true", help="only the activation-checkpointing part")
    ap.add_argument("--smoke", action="store_true", help="ZeRO at dp2; 2 x 32 tokens, one block of one step")
    args = ap.parse_args(argv)
    if args.smoke:
        args.blocks, args.steps, args.seq, args.batch = 1, 1, 32, 2
    world = 2 if args.smoke else ZERO_WORLD

    zero = None if args.skip_zero else zero_memory(world)
    if zero is not None:
        print(f"ZeRO at dp{world}, {zero['psi'] / 1e6:.3f} M params: params + grads + AdamW state per rank")
        for stage, b in zero["bytes"].items():
            print(
                f"  ZeRO-{stage}: {b / 2**20:7.3f} MiB  ({b / zero['bytes'][0]:.3f}x ZeRO-0; formula "
                f"{zero['formula'][stage] / 2**20:7.3f} MiB)"
            )

    import torch

    from kuangchao_core.hal.heap import heap_in_use_bytes
    from kuangchao_core.models.llama import LlamaConfig, LlamaForCausalLM, causal_lm_loss

    torch.set_num_threads(1)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=args.seq,
    )
    models, opts = {}, {}
    for mode in MODES:
        models[mode] = LlamaForCausalLM(cfg)
        models[mode].init_weights(1)
        models[mode].activation_checkpointing = mode
        opts[mode] = torch.optim.AdamW(models[mode].parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def batch():
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    def step(mode: str, x, y) -> int | None:
        before = heap_in_use_bytes()
        loss = causal_lm_loss(models[mode](x), y)
        held = heap_in_use_bytes() - before if before is not None else None
        loss.backward()
        opts[mode].step()
        opts[mode].zero_grad(set_to_none=True)
        return held

    for mode in MODES:  # warm-up: first-step allocations and caches
        step(mode, *batch())
    held = {mode: step(mode, *batch()) for mode in MODES}
    times: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
    for b in range(args.blocks):
        order = MODES[b % 3 :] + MODES[: b % 3]
        for mode in order:
            block = []
            for _ in range(args.steps):
                x, y = batch()
                t0 = time.perf_counter()
                step(mode, x, y)
                block.append(time.perf_counter() - t0)
            times[mode].append(block)
    stats = {mode: block_stats(list(zip(times[mode], times["none"], strict=True))) for mode in ("full", "selective")}
    mem = {mode: (held[mode] / held["none"] if held["none"] else None) for mode in ("full", "selective")}
    print(f"model: {cfg.num_params() / 1e6:.2f} M params, {cfg.num_layers} layers; {args.batch}x{args.seq} tokens/step")
    for mode in MODES:
        print(f"{mode:<10} activations held after the forward: {held[mode] / 2**20:8.2f} MiB")
    for mode, st in stats.items():
        print(format_line(f"step time {mode} ÷ none", st) + f"; memory {mem[mode]:.3f}× of none")
    skipped = {"skipped": "--skip-zero"}
    result = {
        "zero_bytes_per_rank": zero["bytes"] if zero is not None else skipped,
        "zero_vs_zero0": {s: round(b / zero["bytes"][0], 4) for s, b in zero["bytes"].items()} if zero else skipped,
        "activation_memory_vs_none": {m: round(v, 4) for m, v in mem.items()},
        "activation_bytes": held,
        **{f"step_time_{k}": v for k, v in keyed_result_fields(stats).items()},
        "goals": {
            "zero3_vs_zero0": 0.30,
            "memory": {"full": 0.5, "selective": 0.75},
            "step_time": {"full": 1.35, "selective": 1.15},
        },
    }
    emit(result, RESULT_KEYS, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
