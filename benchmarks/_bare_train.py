"""The peer of ``benchmarks/startup.py``: a bare torchrun script training the same model (the tiny preset) data
parallel over Gloo, no orchestration. It prints ``BARE step N`` after each step, as ``kc train`` prints its steps.

    torchrun --nproc_per_node 2 benchmarks/_bare_train.py --steps 6 --micro-batch 2 --seq-len 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from kuangchao_core.models.llama import PRESETS, LlamaForCausalLM, causal_lm_loss

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234)
    model = LlamaForCausalLM(PRESETS["tiny"])
    model.init_weights(1234)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(rank)
    vocab = PRESETS["tiny"].vocab_size
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=gen)
        loss = causal_lm_loss(ddp(tokens[:, :-1]), tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"BARE step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
