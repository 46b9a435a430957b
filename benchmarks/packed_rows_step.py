"""A training step of the demo's model on the demo's packed rows: one masked call per short row (``short_rows_mask``,
the path since rows of at most 128 tokens take it) against one SDPA call per document (the path they took before).

One process, one thread: the tiny preset (hidden 64, 2 layers, 4 query / 2 K/V heads), fp32, 8 rows of 64 tokens
packed with documents of 8..14 tokens (the arithmetic problems of ``configs/tiny.yaml`` are 7..13 tokens plus the end
token), forward, backward and AdamW. The two sides alternate in blocks (order flipped every block); the figure is the
median of the per-block ratios of median step times, with its spread (``benchmarks/_ratios.py``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/packed_rows_step.py [--blocks 8] [--steps 20]

Ends with ``RESULT {json}``: ``ratio_vs_peer`` is short_rows_mask ÷ per-document (below 1: faster).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ratios import FIELDS, block_stats, format_line, result_fields  # noqa: E402
from _results import emit  # noqa: E402
from attention_packed import packed_batch  # noqa: E402

RESULT_KEYS = (*FIELDS,)


@contextlib.contextmanager
def short_row_tokens(value: int):
    """Rows of at most ``value`` tokens take the masked call inside the block (0: every row one call per document)."""
    from kuangchao_core.models import attention

    real = attention.SHORT_ROW_TOKENS
    attention.SHORT_ROW_TOKENS = value
    try:
        yield
    finally:
        attention.SHORT_ROW_TOKENS = real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="one block of one step (seconds)")
    args = ap.parse_args()
    if args.smoke:
        args.blocks, args.steps = 1, 1

    import torch

    from kuangchao_core.models.attention import SHORT_ROW_TOKENS
    from kuangchao_core.models.llama import PRESETS, LlamaForCausalLM, causal_lm_loss

    torch.set_num_threads(1)
    cfg = PRESETS["tiny"]
    model = LlamaForCausalLM(cfg)
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seg = packed_batch(8, 64, doc_tokens=(8, 14)).segment_ids
    starts = torch.cat([torch.ones(8, 1, dtype=torch.bool), seg[:, 1:] != seg[:, :-1]], dim=1)
    positions = torch.arange(64).expand(8, 64) - torch.cummax(torch.where(starts, torch.arange(64), 0), dim=1).values
    ids = torch.randint(0, cfg.vocab_size, (8, 65), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        t0 = time.perf_counter()
        logits = model(ids[:, :-1], position_ids=positions, segment_ids=seg)
        causal_lm_loss(logits, ids[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    sides = {"short_rows_mask": SHORT_ROW_TOKENS, "per_document": 0}
    for value in sides.values():
        with short_row_tokens(value):
            for _ in range(3):
                step()
    times: dict[str, list[list[float]]] = {side: [] for side in sides}
    for b in range(args.blocks):
        for side in sides if b % 2 == 0 else reversed(list(sides)):
            with short_row_tokens(sides[side]):
                times[side].append([step() for _ in range(args.steps)])
    stats = block_stats(list(zip(times["short_rows_mask"], times["per_document"], strict=True)))
    print(
        f"tiny preset, 8 rows of 64 tokens, documents of 8..14 tokens ({len(packed_batch(8, 64, doc_tokens=(8, 14)).spans[0])} in row 0)"
    )
    print(format_line("training step short_rows_mask ÷ per-document", stats))
    emit(result_fields(stats), RESULT_KEYS, smoke=args.smoke)


if __name__ == "__main__":
    main()
