"""The model's step alone (issue 39 item 2): Kuangchao's Llama in a bare training loop against a GPT-2 style model
of (nearly) equal parameters, in one process, alternating.

Both sides are plain PyTorch loops (forward, cross-entropy, backward, AdamW) with no engine around them: the peer is
written here (LayerNorm, GELU MLP of width 4·d, learned positions, causal ``scaled_dot_product_attention``, biases);
ours is ``LlamaForCausalLM`` with the SwiGLU width 8·d/3 that gives the same matrix parameters. Blocks of steps
alternate between the two (the order flipped every block); each block gives one ratio, median Llama step ÷ median
GPT-2 step (``benchmarks/_ratios.py``). Also counted: the ATen operators one step of each runs (the profiler's
count, forward and backward), which is what a CPU pays per op.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/model_step.py [--blocks 12] [--steps 10]

The issue's goal: ratio ≤ 1.1. The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ratios import FIELDS, block_stats, format_line, result_fields  # noqa: E402
from _results import emit  # noqa: E402

RESULT_KEYS = (
    "benchmark",
    "shape",
    "llama_params",
    "gpt2_params",
    "llama_step_ms",
    "gpt2_step_ms",
    "llama_ops_per_step",
    "gpt2_ops_per_step",
    *FIELDS,
)


def gpt2_model(vocab: int, d: int, layers: int, heads: int, seq: int):
    """A GPT-2 style decoder (pre-LayerNorm, GELU MLP, learned positions, tied nothing)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, heads, d // heads).transpose(1, 3).unbind(2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, ids):
            x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    return GPT()


def llama_model(vocab: int, d: int, layers: int, heads: int, seq: int):
    """Kuangchao's Llama of the same width and depth: full-head attention, SwiGLU width 8·d/3."""
    from kuangchao_core.models.llama import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=round(8 * d / 3),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        max_seq_len=seq,
    )
    return LlamaForCausalLM(cfg)


def trainer(model, batch, seq, vocab, seed):
    """One training step of ``model`` on a fixed random batch, as a closure."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    return step


def count_ops(step) -> int:
    """ATen operators one step runs (forward, backward and optimizer)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="one block of 2 steps of a smaller model (seconds)")
    args = parser.parse_args()
    import torch

    torch.manual_seed(0)
    vocab, d, layers, heads, seq, batch = 256, 128, 4, 4, 64, 12  # issue 39's user run
    if args.smoke:
        args.blocks, args.steps, d, layers, batch = 1, 2, 32, 2, 2
    models = {"llama": llama_model(vocab, d, layers, heads, seq), "gpt2": gpt2_model(vocab, d, layers, heads, seq)}
    steps = {name: trainer(m, batch, seq, vocab, seed=1) for name, m in models.items()}
    for step in steps.values():  # warm-up
        step()
    ops = {name: count_ops(step) for name, step in steps.items()}
    blocks = []
    for b in range(args.blocks):
        order = ("llama", "gpt2") if b % 2 == 0 else ("gpt2", "llama")
        got = {name: [steps[name]() for _ in range(args.steps)] for name in order}
        blocks.append((got["llama"], got["gpt2"]))
    stats = block_stats(blocks)
    ms = {k: statistics.median(t for b in blocks for t in b[i]) * 1e3 for i, k in enumerate(("llama", "gpt2"))}
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    print(f"shape: vocab {vocab}, d {d}, {layers} layers, {heads} heads, seq {seq}, batch {batch}; params {params}")
    print(f"ATen ops per step: llama {ops['llama']}, gpt2 {ops['gpt2']}")
    print(format_line("llama/gpt2 step", stats))
    result = {
        "benchmark": "model_step",
        "shape": {"vocab": vocab, "hidden": d, "layers": layers, "heads": heads, "seq": seq, "batch": batch},
        "llama_params": params["llama"],
        "gpt2_params": params["gpt2"],
        "llama_step_ms": round(ms["llama"], 3),
        "gpt2_step_ms": round(ms["gpt2"], 3),
        "llama_ops_per_step": ops["llama"],
        "gpt2_ops_per_step": ops["gpt2"],
    }
    emit(result | result_fields(stats), RESULT_KEYS, smoke=args.smoke)


if __name__ == "__main__":
    main()
