"""The GPU check (issue 12): one command on a CUDA machine that says whether mixed precision works there and how
fast a ~1B-parameter Llama step is, beside plain PyTorch on the same shapes.

    python benchmarks/gpu/check.py [--out DIR] [--steps 20] [--blocks 6]
    python benchmarks/gpu/check.py --smoke          # the same code paths on the CPU with tiny shapes (CI-sized)

(a) **bf16 vs fp32**: the engine's Trainer on one device trains the small preset for 50 steps in fp32 and in bf16
    (autocast, fp32 master weights); the largest relative loss difference is reported (the CPU test states 2%).
(b) **~1B Llama step** (Llama-3.2-1B's shapes: hidden 2048, 16 layers, 32/8 heads, MLP 8192, vocabulary 128256,
    sequence 2048): ours (``LlamaForCausalLM`` under bf16 autocast, selective activation checkpointing, fused
    AdamW on fp32 master weights) against the peer — a plain PyTorch Llama of the same shapes written here, under
    the same autocast, ``torch.compile``d, with fused AdamW — alternated in blocks (``benchmarks/_ratios.py``).
    Reported per side: step time, tokens/s, MFU (6·N·tokens per step ÷ time ÷ the device's bf16 dense peak;
    attention FLOPs not counted), peak memory.

(c)-(e) **the engine end to end** (``engine_check.py``, under ``engine`` in the RESULT): a real ``kc train`` through
    the Prefect flow of a Llama-3.2-1B-shaped model (bf16, ``train.compile``, fused AdamW, flash attention, 40
    steps; its job file ``kc_train_job.yaml`` is written into ``--out``) with tokens/s, MFU, the compile time and
    peak memory against ``kc plan``'s estimate; its loss against an fp32 run of the same job; a 2-process Gloo job
    on CUDA tensors (both ranks on the one GPU) against one process.

(f) **packed-document attention** (``attention_check.py``, under ``packed_attention``): the path a packed job takes
    (per-document fused SDPA, no dense mask) against the dense document mask at s = 2048 and 8192, Llama-1B's
    attention heads in bf16: step time ratio and peak memory of each.

(g) **bytes per rank** (``memory_check.py``, under ``bytes_per_rank``; issue 29 item 5): bf16 parameters with fp32
    master weights against bf16 autocast at dp4 ZeRO-1 and ZeRO-2 (four Gloo ranks on the one GPU, the engine's
    Trainer for one step of a 0.17 B-parameter model): the engine's tensors per rank and
    ``torch.cuda.max_memory_allocated``, and their ratios (``benchmarks/bytes_per_rank.py``'s worker).

(g) runs its four ranks on Gloo device groups (NCCL refuses several ranks on one GPU), as (e) does: their CUDA
    tensors go through host memory (``kuangchao_core.comm.host_staging``).
Also: ``phase_peak`` (the engine's per-step peak reset, ``engine.metrics.start_phase``, on the real allocator, with
its control) and ``communicators_plan`` (``kc plan``'s communicators and NCCL buffer estimate for eight GPUs).

Budget: the whole check fits in 10 minutes on one H100/H200 — (a) ~0.5 min, (b) ~2.5 min, (f) < 1 min, (g) < 1 min,
(c)-(e) ~6 min (itemised in ``engine_check.py``, run last). Every section is independent (``_sections.py``): it
prints a line when it starts and ends, runs under its own time limit, and a failure or time-out is recorded as
``{"error": ...}`` under its key while the next section runs; a section that no longer fits ``--budget-s`` (600)
is skipped and says so. ``benchmarks/gpu/run_all.sh`` is the one command for a device session.
``--smoke`` runs everything on the CPU with tiny shapes: ~1.5 min on 2 cores, ~2.1 min with a cold inductor cache
((g): ~10 s, two processes' start).

Writes ``gpu_check.json`` into ``--out`` (default ``$OUT`` or ``.``) after every section (``"complete": false``
until the end; ``"sections"`` holds each one's status and wall time) and ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _ratios import block_stats, format_line, result_fields  # noqa: E402
from torch import nn  # noqa: E402

#: bf16 dense peak FLOP/s by device name fragment (vendor figures, without sparsity)
PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}

LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    max_seq_len=2048,
    rope_theta=500000.0,
)
SMOKE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=176,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_seq_len=64,
    rope_theta=10000.0,
)


def _peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAKS.items() if k in name), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------- (a) bf16 vs fp32


def loss_tracking(device: torch.device, smoke: bool, steps: int = 50) -> dict:
    """Train the small preset (tiny on --smoke) through the engine's Trainer in fp32 and bf16; max relative
    loss difference."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    from kuangchao_core.comm import init_distributed, world_group
    from kuangchao_core.config import config_from_dict
    from kuangchao_core.config.settings import run_settings
    from kuangchao_core.engine.trainer import Trainer
    from kuangchao_core.parallel.mesh import ParallelMesh
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    init_distributed(backend="auto", timeout_ms=600_000)
    losses = {}
    for dtype in ("fp32", "bf16"):
        cfg = config_from_dict(
            {
                "task": {"name": f"gpu-check-{dtype}", "seed": 7},
                "model": {"preset": "tiny" if smoke else "small"},
                "data": {"format": "synthetic", "seq_len": 32 if smoke else 256, "synthetic": {"num_train": 2048}},
                "parallel": {"micro_batch_size": 4 if smoke else 16},
                "optimizer": {"lr": 1e-3},
                "train": {"steps": steps, "warmup_steps": 5, "dtype": dtype, "device": device.type},
                "permission": {"mode": "trusted"},
                "checkpoint": {"dir": str(Path(os.environ.get("OUT", "/tmp")) / "gpu-check-ckpt"), "interval": 10**6},
                "tracking": {"uri": "sqlite:////tmp/gpu-check-mlflow.db"},
            }
        )
        mesh = ParallelMesh.from_config(cfg.parallel, 0, 1)
        trainer = Trainer(run_settings(cfg), 0, 1, device, world_group(), mesh)
        losses[dtype] = list(trainer.run(resume="never").losses)
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses["bf16"], losses["fp32"], strict=True))
    return {"steps": steps, "max_rel_loss_diff": rel, "final": {k: v[-1] for k, v in losses.items()}}


# ----------------------------------------------------------------------------------------- (b) the peer


class _PeerBlock(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        h, d = c["hidden_size"], c["hidden_size"] // c["num_heads"]
        self.heads, self.kv, self.d = c["num_heads"], c["num_kv_heads"], d
        self.n1, self.n2 = nn.RMSNorm(h, eps=1e-5), nn.RMSNorm(h, eps=1e-5)
        self.qkv = nn.Linear(h, (self.heads + 2 * self.kv) * d, bias=False)
        self.o = nn.Linear(self.heads * d, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * c["intermediate_size"], bias=False)
        self.down = nn.Linear(c["intermediate_size"], h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).split([self.heads * self.d, self.kv * self.d, self.kv * self.d], dim=-1)
        q, k, v = (t.view(b, s, -1, self.d).transpose(1, 2) for t in (q, k, v))

        def rope(t):
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos + torch.cat((-t2, t1), dim=-1) * sin

        a = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        g, u = self.gate_up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class PeerLlama(nn.Module):
    """A plain PyTorch Llama (fused QKV and gate/up projections, ``nn.RMSNorm``, SDPA with GQA)."""

    def __init__(self, c: dict):
        super().__init__()
        self.embed = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.blocks = nn.ModuleList(_PeerBlock(c) for _ in range(c["num_layers"]))
        self.norm = nn.RMSNorm(c["hidden_size"], eps=1e-5)
        self.head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        d = c["hidden_size"] // c["num_heads"]
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.outer(torch.arange(c["max_seq_len"]).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x, self.cos[:s], self.sin[:s])
        return self.head(self.norm(x))


# ----------------------------------------------------------------------------------------- (b) the timing


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def step_timing(device: torch.device, smoke: bool, steps: int, blocks: int, batch: int, recompute: str) -> dict:
    """Ours and the peer alternated in blocks of ``steps`` steps; medians, tokens/s, MFU and peak memory."""
    from kuangchao_core.hal.dtypes import adamw_kernel
    from kuangchao_core.models.llama import LlamaConfig, LlamaForCausalLM, causal_lm_loss

    shapes = SMOKE if smoke else LLAMA_1B
    seq = shapes["max_seq_len"]
    ours = LlamaForCausalLM(LlamaConfig(**shapes)).to(device)
    ours.init_weights(1)
    ours.activation_checkpointing = recompute
    peer = PeerLlama(shapes).to(device)
    compiled_peer = peer if smoke else torch.compile(peer)
    sides = {
        "ours": (ours, lambda ids, y: causal_lm_loss(ours(ids), y)),
        "peer": (peer, lambda ids, y: F.cross_entropy(compiled_peer(ids).float().flatten(0, 1), y.flatten())),
    }
    opts = {
        k: torch.optim.AdamW(list(m.parameters()), lr=1e-4, **adamw_kernel(list(m.parameters())))
        for k, (m, _) in sides.items()
    }
    gen = torch.Generator().manual_seed(0)
    autocast_type = device.type

    def one_step(side: str) -> float:
        ids = torch.randint(0, shapes["vocab_size"], (batch, seq + 1), generator=gen).to(device)
        _sync(device)
        t0 = time.perf_counter()
        with torch.autocast(autocast_type, dtype=torch.bfloat16):
            loss = sides[side][1](ids[:, :-1], ids[:, 1:])
        loss.backward()
        opts[side].step()
        opts[side].zero_grad(set_to_none=True)
        _sync(device)
        return time.perf_counter() - t0

    for side in sides:  # warm-up (compilation, allocator, cuBLAS heuristics)
        for _ in range(2 if smoke else 3):
            one_step(side)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times: dict[str, list[list[float]]] = {"ours": [], "peer": []}
    peak_mem: dict[str, int] = {}
    for b in range(blocks):
        for side in ("ours", "peer") if b % 2 == 0 else ("peer", "ours"):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times[side].append([one_step(side) for _ in range(steps)])
            if device.type == "cuda":
                peak_mem[side] = max(peak_mem.get(side, 0), torch.cuda.max_memory_allocated(device))
    stats = block_stats(list(zip(times["ours"], times["peer"], strict=True)))
    peak = _peak(device)
    tokens = batch * seq
    out = {"shapes": shapes, "batch": batch, "seq": seq, "activation_checkpointing": recompute}
    for side, (model, _) in sides.items():
        n = _num_params(model)
        med = statistics.median(t for blk in times[side] for t in blk)
        out[side] = {
            "params": n,
            "step_s": med,
            "tokens_per_s": tokens / med,
            "mfu": (6 * n * tokens / med / peak) if peak else None,
            "peak_mem_gib": peak_mem[side] / 2**30 if side in peak_mem else None,
        }
    out["ratio"] = result_fields(stats)
    print(format_line("step time ours ÷ plain PyTorch (compiled)", stats))
    return out


def _release(device: torch.device) -> None:
    """Free what (a) and (b) left on the device (their models, compiled graphs) before the engine's jobs start."""
    import gc

    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


#: the RESULT's keys (benchmarks/_results.py); a section left out by a flag or the budget says so as its value
RESULT_KEYS = ("device", "torch", "phase_peak", "communicators_plan", "bf16_vs_fp32", "llama_1b_step",
               "packed_attention", "bytes_per_rank", "engine", "host_staging", "wall_s", "sections",
               "complete")  # fmt: skip


def _print_step(result: dict) -> None:
    for side in ("ours", "peer"):
        r = result[side]
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a"
        mem = f"{r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] else "n/a"
        print(
            f"{side}: {r['params'] / 1e9:.3f} B params, {r['step_s'] * 1e3:.1f} ms/step, "
            f"{r['tokens_per_s']:,.0f} tok/s, MFU {mfu}, peak memory {mem}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the code paths only")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--recompute", default="selective", choices=("none", "full", "selective"))
    ap.add_argument("--skip-tracking", action="store_true")
    ap.add_argument("--skip-engine", action="store_true", help="leave out (c)-(e): kc train, fp32, 2 ranks")
    ap.add_argument("--kc-train-steps", type=int, default=None, help="steps of the kc train run (40; --smoke 3)")
    ap.add_argument("--budget-s", type=float, default=600.0, help="wall-clock seconds for the whole check")
    args = ap.parse_args(argv)
    from _results import emit
    from _sections import phase_peak_check, plan_communicators, run_section, write_partial
    from engine_check import Budget, engine_checks

    budget = Budget(args.budget_s)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device here: run with --smoke for the CPU code paths", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    out = Path(args.out)
    result: dict = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    # (section key, function and arguments, time limit in s (None: bounds its own processes), seconds it needs)
    small = args.smoke
    plan: list[tuple] = [
        ("phase_peak", (phase_peak_check, device), 60, 0),
        ("communicators_plan", (plan_communicators,), 60, 0),
    ]
    if not args.skip_tracking:
        plan.append(("bf16_vs_fp32", (loss_tracking, device, small, 10 if small else 50), 150, 30))
    else:
        result["bf16_vs_fp32"] = {"skipped": "--skip-tracking"}
    step_args = (step_timing, device, small, args.steps, args.blocks, args.batch, args.recompute)
    plan += [("llama_1b_step", step_args, 240, 60), ("packed_attention", (_attention, device, small), 120, 20)]
    plan.append(("bytes_per_rank", (_bytes_per_rank, device, small), None, 30 if small else 90))
    if not args.skip_engine:
        engine = (engine_checks, device, small, out, args.kc_train_steps, budget)
        plan.append(("engine", (_engine, *engine), None, 0))
    else:
        result["engine"] = {"skipped": "--skip-engine"}
    for key, (fn, *fn_args), limit, need in plan:
        run_section(result, key, fn, *fn_args, out=out, limit_s=limit, budget_left=budget.left, need_s=need)
        if key == "bf16_vs_fp32" and "max_rel_loss_diff" in result[key]:
            print(f"bf16 vs fp32: max relative loss difference {result[key]['max_rel_loss_diff']:.4f}")
        if key == "llama_1b_step" and "ours" in result[key]:
            _print_step(result[key])
        if key in ("llama_1b_step", "packed_attention"):
            _release(device)  # what the in-process sections left on the device, before the jobs start
    from kuangchao_core.comm import host_staging

    result["host_staging"] = host_staging.summary()  # this process's staged ops (the jobs' are in their logs)
    result["wall_s"] = round(args.budget_s - budget.left(), 1)
    write_partial(result, out, complete=True)
    emit(result, RESULT_KEYS, smoke=args.smoke)
    return 0


def _attention(device: torch.device, smoke: bool) -> dict:
    from attention_check import attention_check

    return attention_check(device, smoke)


def _bytes_per_rank(device: torch.device, smoke: bool) -> dict:
    from memory_check import memory_check

    return memory_check(device, smoke)


def _engine(fn, device: torch.device, smoke: bool, out: Path, steps: int | None, budget) -> dict:
    return fn(device, smoke, out, steps=steps, budget=budget)


if __name__ == "__main__":
    raise SystemExit(main())
