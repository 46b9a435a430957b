"""Topology-aware vs topology-blind rank placement of a dp2×tp2 job on two hosts × two ranks (issue 11).

The real engine worker trains the same job twice per round on the bench (hosts as network namespaces, the link
between them shaped with tbf to ``--rate``): once placed topology-aware (``place_ranks``: the group kind that
moves the most bytes — TP here — inside a host) and once topology-blind (ranks dealt out to the hosts in turn,
so every TP group crosses the slow link), the order flipped every round. The placement reaches the workers as
a placed multi-node job's does (``KC_RANK_MAP``).

    sudo .venv/bin/python benchmarks/placement.py [--rounds 3] [--steps 8] [--rate 400mbit]

Prints the median step time of each with its interquartile range and ends with ``RESULT {json}``:
``aware_vs_blind`` (goal ≤ 0.89, the original's +12 %).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: TP-heavy: activations (b·s·h per all-reduce, 4 per layer) outweigh the gradients (≈ 12·L·h² / tp)
MODEL = {
    "preset": "tiny",
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 4,
    "vocab_size": 256,
    "max_seq_len": 128,
}
PARALLEL = {"data_parallel_size": 2, "tensor_parallel_size": 2, "micro_batch_size": 8}
RESULT_KEYS = ("link", "traffic_bytes_per_step", "aware_rank_of_slot", "blind_rank_of_slot", "aware_vs_blind", "goal")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rate", default="400mbit")
    ap.add_argument("--smoke", action="store_true", help="one round of 3 steps (the first two are dropped)")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.steps = 1, 3
    from _multihost import Bench, bench_unavailable, engine_step_times, spread
    from _results import emit

    from kuangchao_core.config import config_from_dict
    from kuangchao_core.engine.traffic import group_traffic
    from kuangchao_core.sched.rank_placement import place_ranks

    why = bench_unavailable()
    if why:
        print(f"placement: the multi-host bench cannot run here: {why}", file=sys.stderr)
        return 2
    cfg = config_from_dict(
        {
            "task": {"name": "bench"},
            "model": MODEL,
            "data": {"format": "synthetic", "seq_len": 128},
            "parallel": PARALLEL,
        }
    )
    traffic = group_traffic(cfg)
    sizes = (2, 2, 1)
    placements = {
        "aware": place_ranks(sizes, ["h0", "h1"], 2, traffic=traffic),
        "blind": place_ranks(sizes, ["h0", "h1"], 2, mode="blind"),
    }
    times: dict[str, list[float]] = {"aware": [], "blind": []}
    per_round: list[float] = []
    with Bench(2, args.rate) as bench:
        for r in range(args.rounds):
            order = ("aware", "blind") if r % 2 == 0 else ("blind", "aware")
            medians = {}
            for mode in order:
                got = engine_step_times(bench, 2, MODEL, PARALLEL, args.steps, placements[mode])
                times[mode] += got
                medians[mode] = spread(got)["median"]
            per_round.append(medians["aware"] / medians["blind"])
            print(
                f"round {r}: aware {medians['aware'] * 1e3:.1f} ms, blind {medians['blind'] * 1e3:.1f} ms", flush=True
            )
    for mode in ("aware", "blind"):
        s = spread(times[mode])
        print(
            f"{mode:>6}: median {s['median'] * 1e3:.1f} ms/step (IQR {s['q1'] * 1e3:.1f}–{s['q3'] * 1e3:.1f}, n={s['n']})"
        )
    ratio = spread(per_round)
    result = {
        "link": args.rate,
        "traffic_bytes_per_step": traffic,
        "aware_rank_of_slot": placements["aware"].rank_of_slot,
        "blind_rank_of_slot": placements["blind"].rank_of_slot,
        "aware_vs_blind": ratio,
        "goal": 0.89,
    }
    emit(result, RESULT_KEYS, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
