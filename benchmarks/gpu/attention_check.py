"""(f) Packed-document attention on the device (issue 29, items 3 and 5): the attention path a packed job takes
against the dense document mask it replaced, step time and peak memory, at two sequence lengths.

Shapes: Llama-3.2-1B's attention (32 query and 8 K/V heads of 64, bf16) on one row of packed documents of
32..s/4 tokens at s = 2048 and 8192 (``--smoke``: the tiny preset's 4/2 heads of 16, fp32, s = 64 and 256 on the
CPU). Ours: :func:`kuangchao_core.models.attention.attend` — one masked call for rows of at most 128 tokens, one
causal SDPA call per document beyond (FlashAttention/cuDNN kernels on a GPU), K/V never repeated. Peer: K/V
repeated and the dense (b, 1, s, s) mask (``benchmarks/attention_packed.py``'s ``dense_attend``). Forward and
backward alternate in blocks (``benchmarks/_ratios.py``); peak memory is the CUDA allocator's peak over one step
above what was allocated before it (on the CPU: the profiler's peak of tensor bytes, ``hal.heap``). Under a
minute on an H200.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from _ratios import block_stats, format_line, result_fields

GPU_SEQS = (2048, 8192)
SMOKE_SEQS = (64, 256)


def _peak_step_bytes(step, device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from kuangchao_core.hal.heap import peak_tensor_bytes

    peak, _ = peak_tensor_bytes(step)
    return peak


def attention_check(device: torch.device, smoke: bool, blocks: int = 4, steps: int = 3) -> dict[str, Any]:
    """Ours ÷ the dense mask at each sequence length: the path ours took, documents per row, peak bytes of one
    forward+backward, and the step-time ratio (median of per-block ratios, with its spread)."""
    from attention_packed import dense_attend, packed_batch

    from kuangchao_core.models.attention import Documents, attend, attention_path

    heads, kv_heads, head_dim = (4, 2, 16) if smoke else (32, 8, 64)
    dtype = torch.float32 if smoke else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"heads": [heads, kv_heads, head_dim], "dtype": str(dtype).replace("torch.", "")}
    for seq in SMOKE_SEQS if smoke else GPU_SEQS:
        docs = Documents.from_segment_ids(packed_batch(1, seq).segment_ids.to(device))
        q, k, v = (
            torch.randn(1, n, seq, head_dim, generator=gen).to(device, dtype).requires_grad_(True)
            for n in (heads, kv_heads, kv_heads)
        )
        sides = {"ours": attend, "dense": dense_attend}

        def step(fn, q=q, k=k, v=v, docs=docs) -> None:
            fn(q, k, v, docs).float().sum().backward()
            q.grad = k.grad = v.grad = None

        peak = {}
        for side, fn in sides.items():
            step(fn)  # warm-up: kernels chosen, allocator primed
            peak[side] = _peak_step_bytes(lambda fn=fn: step(fn), device)
        times: dict[str, list[list[float]]] = {side: [] for side in sides}
        for b in range(blocks):
            for side in sides if b % 2 == 0 else reversed(list(sides)):
                block = []
                for _ in range(steps):
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    step(sides[side])
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    block.append(time.perf_counter() - t0)
                times[side].append(block)
        stats = block_stats(list(zip(times["ours"], times["dense"], strict=True)))
        path = attention_path(docs)
        print(
            f"packed attention s={seq} ({len(docs.spans[0])} documents, ours: {path}): peak bytes ours "
            f"{peak['ours'] / 2**20:.1f} MiB, dense mask {peak['dense'] / 2**20:.1f} MiB"
        )
        print(format_line(f"packed attention s={seq} step time ours ÷ dense mask", stats))
        out[f"s{seq}"] = {
            "path": path,
            "documents": len(docs.spans[0]),
            "peak_bytes": peak,
            "memory_ratio": peak["ours"] / peak["dense"] if peak["dense"] else None,
            "ratio": result_fields(stats),
        }
    return out
