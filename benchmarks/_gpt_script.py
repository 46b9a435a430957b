"""The peer of ``benchmarks/loop_vs_script.py``: a minimal single-file GPT training script in plain PyTorch, of the
kind people start from — GPT-2 style (pre-LayerNorm, GELU MLP of width 4·d, learned positions, biases), random
windows of a token file, AdamW with warm-up and cosine decay, gradient clipping at 1.0, the held-out loss over every
held-out window each ``--eval-interval`` steps, a final checkpoint and greedy samples at the end. It imports nothing
of Kuangchao. One process (``python``) or data parallel over Gloo (``torchrun --nproc_per_node N``, DDP; each rank
takes ``--batch / N`` sequences a step).

    python benchmarks/_gpt_script.py --data DIR --vocab 4096 --steps 500 --eval-interval 250 [--out result.json]

``DIR/train.bin`` and ``DIR/val.bin``: the token ids as little-endian uint16 (the driver writes them from the same
tokenized cache ``kc train`` reads). Rank 0 writes ``--out``: the wall-clock (epoch) ends of step 1 and of the last
step, the loop's seconds and tokens (evaluations included), and the last held-out loss.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, context: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lr_at(step: int, args) -> float:
    if step <= args.warmup:
        return args.lr * step / max(1, args.warmup)
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, val: np.ndarray, seq: int, micro: int, rank: int, world: int) -> float:
    """Mean loss over every held-out window ``val[i·seq : (i+1)·seq + 1]``, the windows shared out over the ranks."""
    model.eval()
    windows = (len(val) - 1) // seq
    sums = torch.zeros(2, dtype=torch.float64)
    starts = list(range(rank * micro, windows, world * micro))
    for first in starts:
        rows = np.stack([val[i * seq : (i + 1) * seq + 1] for i in range(first, min(first + micro, windows))])
        chunk = torch.from_numpy(rows.astype(np.int64))
        loss = F.cross_entropy(model(chunk[:, :-1]).flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        sums += torch.tensor([loss.item(), chunk[:, 1:].numel()], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(sums)
    model.train()
    return float(sums[0] / sums[1])


@torch.no_grad()
def sample(model, prompt: torch.Tensor, new: int, context: int) -> torch.Tensor:
    """Greedy continuation of ``prompt`` (no cache: the whole sequence each token)."""
    model.eval()
    out = prompt
    for _ in range(new):
        out = torch.cat([out, model(out[:, -context:])[:, -1:].argmax(-1)], dim=1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=12, help="sequences per step, all ranks")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-interval", type=int, default=250)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--sample-tokens", type=int, default=48)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(1234)
    train = np.memmap(os.path.join(args.data, "train.bin"), dtype="<u2", mode="r")
    val = np.memmap(os.path.join(args.data, "val.bin"), dtype="<u2", mode="r")
    model = GPT(args.vocab, args.d, args.layers, args.heads, args.context)
    net = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(1234 + rank)
    micro = args.batch // world
    stamps, eval_loss, loop_t0 = {}, None, time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = torch.randint(len(train) - args.seq - 1, (micro,), generator=gen).tolist()
        chunk = torch.from_numpy(np.stack([train[s : s + args.seq + 1] for s in starts]).astype(np.int64))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        loss = F.cross_entropy(net(chunk[:, :-1]).flatten(0, 1), chunk[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.eval_interval == 0:
            eval_loss = evaluate(model, val, args.seq, micro, rank, world)
            if rank == 0:
                print(f"step {step}/{args.steps} loss {loss.item():.4f} held-out {eval_loss:.4f}", flush=True)
        if step == 1:
            stamps["step_1_end"] = time.time()
    loop_s = time.perf_counter() - loop_t0
    stamps["last_step_end"] = time.time()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(args.data, f"ckpt-{os.getpid()}.pt"))
        prompts = torch.from_numpy(np.stack([val[i * 97 : i * 97 + 16] for i in range(args.samples)]).astype(np.int64))
        outs = sample(model, prompts, args.sample_tokens, args.context)
        print(f"samples: {outs.shape[0]} × {args.sample_tokens} tokens", flush=True)
        if args.out:
            tokens = args.steps * args.batch * args.seq
            record = {**stamps, "loop_s": loop_s, "tokens": tokens, "tokens_per_s_loop": tokens / loop_s}
            with open(args.out, "w") as f:
                json.dump({**record, "eval_loss": eval_loss}, f)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
