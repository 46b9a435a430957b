"""The model's step alone (issue 39 item 2): Kuangchao's Llama in a bare training loop against a GPT-2 style model
of (nearly) equal parameters, in one process, alternating.

Both sides are plain PyTorch loops (forward, cross-entropy, backward, AdamW) with no engine around them: the peer is
written here (LayerNorm, GELU MLP of width 4·d, learned positions, causal ``scaled_dot_product_attention``, biases);
ours is ``LlamaForCausalLM`` with the SwiGLU width 8·d/3 that gives the same matrix parameters. Two comparisons in
one run: ``eager``, and ``compiled`` — each decoder layer compiled as ``train.compile`` does (inductor; the peer's
blocks the same way), where the Llama block's element-wise work (SwiGLU's product, RoPE, RMSNorm) fuses. Blocks of
steps alternate between the two (the order flipped every block); each block gives one ratio, median Llama step ÷
median GPT-2 step (``benchmarks/_ratios.py``). Also counted: the ATen operators one step of each runs (the profiler's
count, forward and backward), which is what a CPU pays per op.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/model_step.py [--blocks 12] [--steps 10]

The issue's goal: ratio ≤ 1.1. The last line is ``RESULT {json}``, each ratio field keyed ``eager`` / ``compiled``.
``--smoke`` traces the compiled side with dynamo's ``eager`` backend instead of inductor (seconds, not minutes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ratios import FIELDS, block_stats, format_line, keyed_result_fields  # noqa: E402
from _results import emit  # noqa: E402

RESULT_KEYS = (
    "benchmark",
    "shape",
    "compile_backend",
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


def compiled(models: dict, backend: str) -> dict:
    """The same two models, each block compiled as ``train.compile`` compiles ours (per decoder layer:
    ``kuangchao_core.models.compile.compile_layers``); the peer's blocks the same way."""
    from kuangchao_core.models.compile import compile_layers

    compile_layers(models["llama"], backend=backend)
    for block in models["gpt2"].blocks:
        block.compile(backend=backend)
    return models


def compare(models: dict, batch: int, seq: int, vocab: int, blocks: int, steps_per_block: int):
    """Alternating blocks of training steps of the two models: (block stats, median step ms of each, ATen ops per
    step of each)."""
    steps = {name: trainer(m, batch, seq, vocab, seed=1) for name, m in models.items()}
    for step in steps.values():  # warm-up (and, compiled, the compilation)
        step()
        step()
    ops = {name: count_ops(step) for name, step in steps.items()}
    runs = []
    for b in range(blocks):
        order = ("llama", "gpt2") if b % 2 == 0 else ("gpt2", "llama")
        got = {name: [steps[name]() for _ in range(steps_per_block)] for name in order}
        runs.append((got["llama"], got["gpt2"]))
    ms = {k: statistics.median(t for r in runs for t in r[i]) * 1e3 for i, k in enumerate(("llama", "gpt2"))}
    return block_stats(runs), ms, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="one block of 2 steps of a smaller model (seconds)")
    args = parser.parse_args()
    import torch

    vocab, d, layers, heads, seq, batch = 256, 128, 4, 4, 64, 12  # issue 39's user run
    backend = "inductor"
    if args.smoke:  # dynamo's eager backend: the compiled path traced, without inductor's minutes on a CPU
        args.blocks, args.steps, d, layers, batch, backend = 1, 2, 32, 2, 2, "eager"

    def build() -> dict:
        torch.manual_seed(0)
        return {"llama": llama_model(vocab, d, layers, heads, seq), "gpt2": gpt2_model(vocab, d, layers, heads, seq)}

    models = build()
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    print(f"shape: vocab {vocab}, d {d}, {layers} layers, {heads} heads, seq {seq}, batch {batch}; params {params}")
    stats, ms, ops = {}, {}, {}
    for mode in ("eager", "compiled"):
        if mode == "compiled":
            models = compiled(build(), backend)
        stats[mode], ms[mode], ops[mode] = compare(models, batch, seq, vocab, args.blocks, args.steps)
        print(f"{mode}: ATen ops per step: llama {ops[mode]['llama']}, gpt2 {ops[mode]['gpt2']}")
        print(format_line(f"{mode} llama/gpt2 step", stats[mode]))
    result = {
        "benchmark": "model_step",
        "shape": {"vocab": vocab, "hidden": d, "layers": layers, "heads": heads, "seq": seq, "batch": batch},
        "compile_backend": backend,
        "llama_params": params["llama"],
        "gpt2_params": params["gpt2"],
        "llama_step_ms": {mode: round(v["llama"], 3) for mode, v in ms.items()},
        "gpt2_step_ms": {mode: round(v["gpt2"], 3) for mode, v in ms.items()},
        "llama_ops_per_step": {mode: v["llama"] for mode, v in ops.items()},
        "gpt2_ops_per_step": {mode: v["gpt2"] for mode, v in ops.items()},
    }
    emit(result | keyed_result_fields(stats), RESULT_KEYS, smoke=args.smoke)


if __name__ == "__main__":
    main()
