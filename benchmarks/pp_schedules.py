"""Pipeline schedules: ours against torch.distributed.pipelining on the same stages (Gloo, CPU).

1. Real compute (tiny Llama, 8 layers): our 1F1B / interleaved 1F1B (v=2) against torch's ``Schedule1F1B`` /
   ``ScheduleInterleaved1F1B``, p=2 and p=4, m=8. The four runners alternate in blocks (``--steps`` steps of
   each; the order reversed every block, so each pair ours/torch swaps order and drift hits both alike); each
   comparison gets one ratio per block, median step of ours ÷ median step of torch in the block (rank 0's
   barrier-to-barrier step time; ``benchmarks/_ratios.py``). Also the measured bubble fraction
   (1 - mean compute time / step time, over all blocks) next to (p-1)/(m+p-1) and (p-1)/(v m+p-1).
2. Simulated compute (each stage sleeps a fixed time per forward and twice that per backward, split over its
   chunks) so two cores can show the schedules themselves: step times, bubbles and interleaved/1F1B throughput.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pp_schedules.py [--blocks 10] [--steps 2] [--sim-rounds 2]

Ends with ``RESULT {json}``: ``ratio_vs_peer``, ``ratio_iqr``, ``ratio_min_max`` and ``blocks``, each a mapping
comparison (``1f1b_p2``, ``interleaved_p2``, ``1f1b_p4``, ``interleaved_p4``) -> value; bubbles and the simulated
step times beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _ratios import FIELDS, block_stats, format_line, keyed_result_fields  # noqa: E402
from _results import emit  # noqa: E402

from kuangchao_core.sched.launcher import free_port  # noqa: E402

RESULT_KEYS = (*FIELDS, "bubble", "interleaved_gain", "sim_step", "config")
M = 8
V = 2
MB = 2
SEQ = 32
HIDDEN = 64
LAYERS = 8
SLEEP_F = 0.02  # seconds per stage forward in the simulated-compute run (backward: twice that)


class Wrapped(nn.Module):
    """A chunk as a module that owns the model (torch's stage wants the parameters registered)."""

    def __init__(self, chunk):
        super().__init__()
        self.model = chunk.model
        self.chunk = chunk

    def forward(self, x):
        return self.chunk(x)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tf, tb):
        ctx.tb = tb
        time.sleep(tf)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.tb)
        return g, None, None


class SleepStage(nn.Module):
    """Fixed compute time: ``tf`` per forward, ``2 tf`` per backward; the first stage lifts (b, s) to (b, s, h)."""

    def __init__(self, tf, first):
        super().__init__()
        self.w = nn.Parameter(torch.ones(HIDDEN))
        self.tf = tf
        self.first = first

    def forward(self, x):
        if self.first:
            x = x.unsqueeze(-1).expand(*x.shape, HIDDEN)
        return _Sleep.apply(x * self.w, self.tf, 2 * self.tf)


def _sleep_loss(out, labels):
    return out.float().pow(2).mean()


def _real_setup(p, rank, v):
    from kuangchao_core.models.llama import LlamaConfig, LlamaForCausalLM
    from kuangchao_core.parallel.pipeline import build_stage_chunks

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=176,
        num_layers=LAYERS,
        num_heads=4,
        num_kv_heads=2,
        max_seq_len=SEQ,
    )
    model = LlamaForCausalLM(cfg)
    model.init_weights(1)
    return [Wrapped(c) for c in build_stage_chunks(model, p, rank, v)]


def _sleep_setup(p, rank, v):
    return [SleepStage(SLEEP_F / v, first=(c * p + rank == 0)) for c in range(v)]


def _batch(sim):
    gen = torch.Generator().manual_seed(3)
    if sim:
        return torch.ones(M * MB, SEQ), torch.zeros(M * MB, SEQ)
    ids = torch.randint(0, 128, (M * MB, SEQ + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _ours(group, modules, loss_fn, schedule):
    from kuangchao_core.parallel.pipeline import PipelineExecutor

    ex = PipelineExecutor(group, modules, loss_fn, HIDDEN, schedule=schedule)

    def step(x, y):
        mbs = [{"input_ids": x[i * MB : (i + 1) * MB], "labels": y[i * MB : (i + 1) * MB]} for i in range(M)]
        ex.run(mbs)
        return ex.compute_seconds

    return step


def _torch(p, rank, modules, loss_fn, interleaved):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    n = p * len(modules)
    stages = [PipelineStage(mod, c * p + rank, n, torch.device("cpu")) for c, mod in enumerate(modules)]
    sched = (
        ScheduleInterleaved1F1B(stages, M, loss_fn=loss_fn)
        if interleaved
        else Schedule1F1B(stages[0], M, loss_fn=loss_fn)
    )

    def step(x, y):
        if rank == 0:
            sched.step(x)
        elif rank == p - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        return None

    return step


def _time(step, x, y, n):
    out = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        compute = step(x, y)
        dist.barrier()
        out.append((time.perf_counter() - t0, compute))
    return out


def _body(rank, p, port, q, blocks, steps, sim_rounds):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(p))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=p, timeout=timedelta(seconds=120))
    from kuangchao_core.comm import CommGroup, init_distributed
    from kuangchao_core.models.llama import causal_lm_loss
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    install_guard(AllowAll())
    init_distributed("gloo")
    group = CommGroup(list(range(p)), backend="gloo", name="pp")
    res = {}
    for sim in (False, True):
        setup, loss_fn = (_sleep_setup, _sleep_loss) if sim else (_real_setup, causal_lm_loss)
        x, y = _batch(sim)
        runners = {}
        for v, name in ((1, "1f1b"), (V, "interleaved_1f1b")):
            mods = setup(p, rank, v)
            runners[f"ours_{name}"] = _ours(group, mods, loss_fn, name)
            if not sim:
                runners[f"torch_{name}"] = _torch(p, rank, setup(p, rank, v), loss_fn, v > 1)
        times = {k: [] for k in runners}  # runner -> [block][step] (step time, compute time)
        for step in runners.values():  # warm-up (torch infers shapes on its first step)
            _time(step, x, y, 1)
        keys = list(runners)
        for blk in range(sim_rounds if sim else blocks):
            for k in keys if blk % 2 == 0 else reversed(keys):
                times[k].append(_time(runners[k], x, y, steps))
        res["sim" if sim else "real"] = times
    q.put((rank, res))
    dist.destroy_process_group()


def _run(p, args):
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_body, args=(r, p, port, q, args.blocks, args.steps, args.sim_rounds)) for r in range(p)
    ]
    for pr in procs:
        pr.start()
    out = dict(q.get(timeout=600) for _ in range(p))
    for pr in procs:
        pr.join()
    return [out[r] for r in range(p)]


def _step_times(rank_res, kind, key) -> list[list[float]]:
    """[block][step] step times of one runner on one rank."""
    return [[t for t, _ in blk] for blk in rank_res[kind][key]]


def _summary(per_rank, kind, key, p):
    steps = [t for blk in _step_times(per_rank[0], kind, key) for t in blk]
    med = statistics.median(steps)
    comp = [
        statistics.median(c for blk in r[kind][key] for _, c in blk)
        for r in per_rank
        if r[kind][key][0][0][1] is not None
    ]
    bubble = 1.0 - statistics.mean(comp) / med if comp else None
    return med, bubble


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=10, help="blocks of the four real-compute runners")
    ap.add_argument("--steps", type=int, default=2, help="steps of each runner per block")
    ap.add_argument("--sim-rounds", type=int, default=2, help="rounds of the simulated-compute runs")
    ap.add_argument("--smoke", action="store_true", help="p=2 only, one block of one step, one simulated round")
    args = ap.parse_args(argv)
    if args.smoke:
        args.blocks, args.steps, args.sim_rounds = 1, 1, 1
    from kuangchao_core.parallel.pp_schedules import bubble_fraction

    t_start = time.perf_counter()
    stats, bubble, sim, gain = {}, {}, {}, {}
    for p in (2,) if args.smoke else (2, 4):
        per_rank = _run(p, args)
        for name, short, v in (("1f1b", "1f1b", 1), ("interleaved_1f1b", "interleaved", V)):
            ours, b = _summary(per_rank, "real", f"ours_{name}", p)
            peer, _ = _summary(per_rank, "real", f"torch_{name}", p)
            blocks = zip(
                _step_times(per_rank[0], "real", f"ours_{name}"),
                _step_times(per_rank[0], "real", f"torch_{name}"),
                strict=True,
            )
            st = stats[f"{short}_p{p}"] = block_stats(list(blocks))
            s_med, s_b = _summary(per_rank, "sim", f"ours_{name}", p)
            ideal = (M * v + p - 1) * 3 * SLEEP_F / v
            theory = bubble_fraction(p, M, v)
            bubble[f"{short}_p{p}"] = {
                "measured_real": round(b, 3),
                "measured_sim": round(s_b, 3),
                "theory": round(theory, 3),
            }
            sim[f"{short}_p{p}"] = {"step_s": round(s_med, 4), "ideal_s": round(ideal, 4)}
            print(
                f"p={p} {name:17s} real: ours {ours * 1e3:7.1f} ms  torch {peer * 1e3:7.1f} ms"
                f"  bubble {b:.3f} (theory {theory:.3f}) | sim: {s_med * 1e3:6.1f} ms (ideal {ideal * 1e3:6.1f})"
                f"  bubble {s_b:.3f}"
            )
            print(format_line(f"p={p} {name:17s} ours/torch", st))
        gain[f"p{p}"] = round(sim[f"1f1b_p{p}"]["step_s"] / sim[f"interleaved_p{p}"]["step_s"], 3)
        print(f"p={p} simulated interleaved/1F1B throughput: {gain[f'p{p}']:.3f}x")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    result = {
        **keyed_result_fields(stats),
        "bubble": bubble,
        "interleaved_gain": gain,
        "sim_step": sim,
        "config": {
            "m": M,
            "v": V,
            "micro_batch": MB,
            "seq": SEQ,
            "hidden": HIDDEN,
            "layers": LAYERS,
            "sleep_f": SLEEP_F,
            "steps_per_block": args.steps,
            "sim_rounds": args.sim_rounds,
        },
    }
    emit(result, RESULT_KEYS, smoke=args.smoke)


if __name__ == "__main__":
    main()
