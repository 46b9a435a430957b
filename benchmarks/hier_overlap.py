"""How much of the DP gradient exchange backward hides: the hierarchical all-reduce beside the flat one (issue 41).

Four Gloo ranks on this machine, declared as two nodes of two, train a Llama-style model with
:class:`~kuangchao_core.parallel.data.DataParallel` under three bucket reducers, alternated in rounds (the order
flipped every round, so drift hits all alike):

- ``flat``: one asynchronous all-reduce per bucket over the DP group (the peer);
- ``hier``: the hierarchical all-reduce pipelined per bucket (``HierarchicalPipeline``: intra-node reduce-scatter at
  the bucket's launch, cross-node all-reduce and intra-node all-gather at the next launches);
- ``hier_blocking``: the same three steps run to the end at each launch (the behaviour before; the control).

Per round and reducer three timings, each the slowest rank's: ``step`` (forward, backward with the exchange,
the final wait), ``compute`` (the same under ``no_sync``: no exchange) and ``comm`` (every bucket's exchange alone,
launched and waited with nothing else running). With ``--compute sleep`` (the default) the backward is simulated:
each bucket's share of ``--sleep-ms`` is slept, then the bucket launches — the cores stay free for the exchange, so
what is measured is how much of it the schedule overlaps (four ranks' real backward and their exchange compete for
two shared cores here; ``--compute real`` runs the model's backward). The hidden share of the exchange is
``(compute + comm − step) / comm``: 1 when backward hides all of it, 0 when none. Prints each reducer's median
with its interquartile range, and ends with ``RESULT {json}``: hidden shares, the times, and ``hier``'s step time
over ``flat``'s (median of per-round ratios with spread, ``benchmarks/_ratios.py``).

    .venv/bin/python benchmarks/hier_overlap.py [--rounds 8] [--hidden 256] [--layers 4] [--bucket-mb 1]
    .venv/bin/python benchmarks/hier_overlap.py --smoke     # seconds on a CPU, the same keys
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ratios import FIELDS  # noqa: E402
from _results import emit  # noqa: E402

METHODS = ("flat", "hier", "hier_blocking")
WORLD, NODES = 4, [0, 0, 1, 1]
#: the RESULT's keys (benchmarks/_results.py)
RESULT_KEYS = ("compute", "world", "nodes", "buckets", "elements", "rounds", "hidden_share", "step_ms", "compute_ms",
               "comm_ms", *FIELDS)  # fmt: skip


def _rank(rank: int, world: int, port: int, root: str, args: dict, queue) -> None:
    from _engine_ranks import init_rank

    init_rank(rank, world, port)
    import torch

    from kuangchao_core.comm import primitives as P
    from kuangchao_core.comm import world_group
    from kuangchao_core.models.llama import LlamaConfig, LlamaForCausalLM, causal_lm_loss
    from kuangchao_core.parallel.bucket_reduce import BucketReducer
    from kuangchao_core.parallel.data import DataParallel
    from kuangchao_core.parallel.mesh import ParallelMesh

    mesh = ParallelMesh({"dp": world}, rank, world, backend="gloo", node_of_rank=NODES, hierarchical="on")
    h = args["hidden"]
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=h,
        intermediate_size=h * 8 // 3 // 8 * 8,
        num_layers=args["layers"],
        num_heads=max(1, h // 32),
        num_kv_heads=max(1, h // 64),
        max_seq_len=args["seq"],
    )
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 512, (args["batch"], args["seq"] + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    dps = {}
    for m in METHODS:
        model = LlamaForCausalLM(cfg)
        model.init_weights(1)
        intra, inter = (mesh.dp_intra_group, mesh.dp_inter_group) if m != "flat" else (None, None)
        reducer = BucketReducer(mesh.dp_group, intra, inter)
        reducer.pipeline.overlap = m != "hier_blocking"
        reducer.pipeline.lag = args["lag"]
        dps[m] = (model, DataParallel(model, mesh.dp_group, bucket_cap_mb=args["bucket_mb"], reducer=reducer))
    world_g = world_group()
    simulated = args["compute"] == "sleep"
    per_bucket_s = args["sleep_ms"] / 1e3 / len(dps["flat"][1]._buckets)

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        P.all_reduce(t, group=world_g, op="max")
        return float(t[0])

    def timed(fn) -> float:
        P.all_reduce(torch.zeros(1), group=world_g)  # start together
        t0 = time.perf_counter()
        fn()
        return slowest(time.perf_counter() - t0)

    def measure(m: str) -> dict[str, float]:
        model, dp = dps[m]

        def step() -> None:
            if simulated:  # each bucket's gradients take their share of the compute, then the bucket launches
                handles = []
                for k, b in enumerate(dp._buckets):
                    time.sleep(per_bucket_s)
                    handles.append(dp.reducer.launch(k, b.buffer))
                for hd in handles:
                    hd.wait()
                return
            causal_lm_loss(model(x), y).backward()
            dp.finish_gradient_sync()

        def compute() -> None:
            if simulated:
                for _ in dp._buckets:
                    time.sleep(per_bucket_s)
                return
            with dp.no_sync():
                causal_lm_loss(model(x), y).backward()

        def comm() -> None:
            handles = [dp.reducer.launch(k, b.buffer) for k, b in enumerate(dp._buckets)]
            for hd in handles:
                hd.wait()

        out = {}
        for name, fn in (("step", step), ("compute", compute), ("comm", comm)):
            dp.zero_grad()
            out[name] = min(timed(fn) for _ in range(args["reps"]))  # the least-disturbed of a few
        dp.zero_grad()
        return out

    for m in METHODS:  # warm-up: connections, allocations
        measure(m)
    rounds = []
    for r in range(args["rounds"]):
        order = METHODS if r % 2 == 0 else tuple(reversed(METHODS))
        rounds.append({m: measure(m) for m in order})
    sizes = [b.buffer.numel() for b in dps["flat"][1]._buckets]
    queue.put((rank, {"rounds": rounds, "buckets": sizes}))


def _summary(values: list[float]) -> dict[str, float]:
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values[0],) * 3
    return {"median": round(statistics.median(values), 4), "iqr": [round(q1, 4), round(q3, 4)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument(
        "--compute",
        choices=("sleep", "real"),
        default="sleep",
        help="sleep: backward simulated as a sleep per bucket, which leaves the cores to the exchange (the schedule "
        "measured, as the pipeline-bubble benchmark does); real: the model's own backward",
    )
    ap.add_argument("--lag", type=int, default=1, help="launches a pipelined step gets before it is waited for")
    ap.add_argument("--sleep-ms", type=float, default=150.0, help="simulated backward time per step (all buckets)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, two rounds: seconds on a CPU")
    args = vars(ap.parse_args())
    if args["smoke"]:
        args.update(rounds=2, reps=1, hidden=32, layers=2, seq=8, batch=2, bucket_mb=0.01, sleep_ms=20.0)
    from _engine_ranks import run_ranks
    from _ratios import block_stats, format_line, result_fields

    out = run_ranks(WORLD, _rank, (args,))[0]
    rounds = out["rounds"]
    hidden: dict[str, list[float]] = {m: [] for m in METHODS}
    for rd in rounds:
        for m in METHODS:
            t = rd[m]
            hidden[m].append((t["compute"] + t["comm"] - t["step"]) / t["comm"])
    result = {
        "compute": args["compute"],
        "world": WORLD,
        "nodes": 2,
        "buckets": len(out["buckets"]),
        "elements": sum(out["buckets"]),
        "rounds": len(rounds),
        "hidden_share": {m: _summary(hidden[m]) for m in METHODS},
        "step_ms": {m: _summary([rd[m]["step"] * 1e3 for rd in rounds]) for m in METHODS},
        "compute_ms": {m: _summary([rd[m]["compute"] * 1e3 for rd in rounds]) for m in METHODS},
        "comm_ms": {m: _summary([rd[m]["comm"] * 1e3 for rd in rounds]) for m in METHODS},
    }
    for m in METHODS:
        s, c = result["hidden_share"][m], result["comm_ms"][m]
        print(
            f"{m:>14}: hidden share of the exchange median {s['median']:.3f} (IQR {s['iqr'][0]:.3f}–{s['iqr'][1]:.3f});"
            f" exchange alone {c['median']:.1f} ms, step {result['step_ms'][m]['median']:.1f} ms"
        )
    stats = block_stats([([rd["hier"]["step"]], [rd["flat"]["step"]]) for rd in rounds])
    print(format_line("hier step ÷ flat step", stats))
    result.update(result_fields(stats))
    emit(result, RESULT_KEYS, smoke=args["smoke"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
