"""Packed-document attention without a dense mask against the dense mask it replaced (issue 29, item 3).

One process runs the engine's attention layer (``LlamaAttention`` of the tiny preset: hidden 64, 4 query heads, 2
K/V heads, fp32) forward and backward on packed documents (lengths drawn from 32..s/4 tokens, seed 0, every row its
own boundaries) at each sequence length. Ours: the model's attention (one causal SDPA per document,
``enable_gqa``: ``kuangchao_core.models.attention``). Peer: the code it replaced — K/V repeated with
``repeat_interleave`` and a dense (batch, 1, s, s) document mask — swapped into the same layer. The two alternate in
blocks (order flipped every block); the figure is the median of the per-block ratios of median step times, with
their spread (``benchmarks/_ratios.py``). Memory: the peak bytes tensors allocated during one step held at once
(``kuangchao_core.hal.heap.peak_tensor_bytes``: the profiler's record of every CPU allocation and free), ours ÷ peer.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/attention_packed.py [--blocks 8] [--steps 3] [--seqs 512 2048]

Short rows (why ``short_rows_mask`` up to 128 tokens): ``--seqs 64 128 256 --batch 8 --doc-tokens 8 14
--per-document`` times the per-document path at every length against the dense mask.

Goal (the issue): memory no longer grows with s² (ratio falls as s grows); time ≤ 1× the dense mask on CPU. Ends
with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ratios import FIELDS, block_stats, format_line, keyed_result_fields  # noqa: E402
from _results import emit  # noqa: E402

RESULT_KEYS = ("memory_ratio", "peak_bytes", *FIELDS)


def dense_attend(q, k, v, documents=None):
    """The attention core before issue 29: repeated K/V and the dense document mask."""
    import torch.nn.functional as F

    from kuangchao_core.models.attention import document_mask

    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(documents.segment_ids))


@contextlib.contextmanager
def attending_with(fn):
    """The model's layers call ``fn`` as their attention core inside the block (``None``: their own)."""
    from kuangchao_core.models import llama

    real = llama.attend
    llama.attend = fn or real
    try:
        yield
    finally:
        llama.attend = real


def packed_batch(batch: int, seq: int, seed: int = 0, doc_tokens: tuple[int, int] | None = None):
    """:class:`Documents` of ``batch`` rows of packed documents (``doc_tokens`` lowest and highest length, default
    32..s/4), each row its own boundaries."""
    import torch

    from kuangchao_core.models.attention import Documents

    gen = torch.Generator().manual_seed(seed)
    lo, hi = doc_tokens or (32, max(32, seq // 4))
    rows = []
    for _ in range(batch):
        lengths, total = [], 0
        while total < seq:
            n = min(int(torch.randint(lo, hi + 1, (1,), generator=gen)), seq - total)
            lengths.append(n)
            total += n
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return Documents.from_segment_ids(torch.stack(rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqs", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--doc-tokens", type=int, nargs=2, metavar=("LO", "HI"), help="document lengths (32..s/4)")
    ap.add_argument("--per-document", action="store_true", help="ours: one SDPA call per document at every length")
    ap.add_argument("--smoke", action="store_true", help="s = 256, batch 1, one block of one step (seconds)")
    args = ap.parse_args()
    if args.smoke:
        args.blocks, args.steps, args.batch, args.seqs = 1, 1, 1, [256]

    import torch

    from kuangchao_core.hal.heap import peak_tensor_bytes
    from kuangchao_core.models.llama import PRESETS, LlamaAttention, LlamaForCausalLM

    torch.set_num_threads(1)
    if args.per_document:
        from kuangchao_core.models import attention

        attention.SHORT_ROW_TOKENS = 0
    cfg = PRESETS["tiny"]
    model = LlamaForCausalLM(cfg)
    model.init_weights(0)
    attn: LlamaAttention = model.model.layers[0].self_attn
    sides = {"ours": None, "dense": dense_attend}
    times: dict[int, dict[str, list[list[float]]]] = {}
    mem: dict[int, dict[str, int]] = {}
    docs_per_row: dict[int, float] = {}
    for seq in args.seqs:
        docs = packed_batch(args.batch, seq, doc_tokens=args.doc_tokens)
        docs_per_row[seq] = statistics.mean(len(r) for r in docs.spans)
        x = torch.randn(args.batch, seq, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
        x.requires_grad_(True)
        cos, sin = model.rotary(seq, x.device, x.dtype)

        def step(x=x, cos=cos, sin=sin, docs=docs):
            out = attn(x, cos, sin, docs)
            out.sum().backward()

        mem[seq] = {}
        for side, fn in sides.items():
            with attending_with(fn):
                step()  # warm-up
                mem[seq][side], _ = peak_tensor_bytes(step)
        times[seq] = {side: [] for side in sides}
        for b in range(args.blocks):
            order = list(sides) if b % 2 == 0 else list(reversed(sides))
            for side in order:
                block = []
                with attending_with(sides[side]):
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        step()
                        block.append(time.perf_counter() - t0)
                times[seq][side].append(block)
    stats = {
        f"s{seq}": block_stats(list(zip(times[seq]["ours"], times[seq]["dense"], strict=True))) for seq in args.seqs
    }
    print(
        f"attention layer: hidden {cfg.hidden_size}, {cfg.num_heads} query / {cfg.num_kv_heads} K/V heads, fp32, "
        f"batch {args.batch}, packed documents of {'..'.join(map(str, args.doc_tokens or (32, 's/4')))} tokens; "
        f"ours: {'one call per document' if args.per_document else 'the job path'}; forward + backward"
    )
    result: dict = {"memory_ratio": {}, "peak_bytes": {}}
    for seq in args.seqs:
        ours, dense = mem[seq]["ours"], mem[seq]["dense"]
        print(
            f"s={seq} ({docs_per_row[seq]:.1f} documents/row): peak bytes ours {ours / 2**20:.2f} MiB, "
            f"dense mask {dense / 2**20:.2f} MiB, ours ÷ dense {ours / dense:.3f}"
        )
        print(format_line(f"s={seq} step time ours ÷ dense mask", stats[f"s{seq}"]))
        result["memory_ratio"][f"s{seq}"] = round(ours / dense, 4)
        result["peak_bytes"][f"s{seq}"] = {"ours": ours, "dense": dense}
    result.update(keyed_result_fields(stats))
    emit(result, RESULT_KEYS, smoke=args.smoke)


if __name__ == "__main__":
    main()
