"""Activation checkpointing: the activation memory it saves and the step time it costs (issue 12's benchmark, the
activation-checkpointing part; ZeRO stages and mixed precision join it when they land).

One process trains a Llama-style model (the tiny preset's widths, 4 layers, 8 × 256 tokens per step) with
``none``, ``full`` and ``selective`` activation checkpointing, alternated in blocks (order rotated every block).
Memory: the C heap bytes the forward leaves held (``kuangchao_core.hal.heap``), per mode after a warm-up; time:
per-block ratios of the median step time (forward + backward + AdamW) against ``none`` (``benchmarks/_ratios.py``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/precision_memory.py [--blocks 10] [--steps 4]

Goals (the issue): activation memory full ≤ 0.5×, selective ≤ 0.75× of none; step time full ≤ 1.35×, selective
≤ 1.15×. Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ratios import block_stats, format_line, keyed_result_fields  # noqa: E402

MODES = ("none", "full", "selective")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)

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
    result = {
        "activation_memory_vs_none": {m: round(v, 4) for m, v in mem.items()},
        "activation_bytes": held,
        **{f"step_time_{k}": v for k, v in keyed_result_fields(stats).items()},
        "goals": {"memory": {"full": 0.5, "selective": 0.75}, "step_time": {"full": 1.35, "selective": 1.15}},
    }
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
