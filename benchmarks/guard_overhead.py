"""Cost of the permission guard: a data-parallel training step with the guard enforcing vs trusted mode.

Two Gloo ranks train a small model whose gradients are averaged with ``kuangchao.distributed.all_reduce`` (one
guarded collective per parameter). Blocks of steps alternate between the enforcing guard and ``AllowAll`` in the
same processes (the order flipped every block). The enforcing guard is installed as a worker's is: its token
handed over in memory (never written to a file), the authority's signed trust store and policy verified against
the trust root, audit log on. Each block gives one ratio, median enforcing step ÷ median trusted step (both
ranks' steps of the block; ``benchmarks/_ratios.py``). Also measured: one ``check`` in nanoseconds and one token
verification (Ed25519 + strict parse) in microseconds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/guard_overhead.py [--blocks 20] [--steps 20]

The last line is ``RESULT {json}`` with ``ratio_vs_peer`` = median of the per-block enforcing ÷ trusted ratios,
``ratio_iqr``, ``ratio_min_max`` and ``blocks``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _ratios import FIELDS, block_stats, format_line, result_fields  # noqa: E402
from _results import emit  # noqa: E402

JOB = "bench"
RESULT_KEYS = (
    *FIELDS,
    "enforcing_step_ms",
    "trusted_step_ms",
    "steps_per_mode_per_rank",
    "check_ns",
    "allow_all_check_ns",
    "checks_per_step",
    "guard_cost_per_step_pct",
    "verify_us",
    "world_size",
    "backend",
)


def _body(rank, world_size, token, trust, trust_root, policy_file, audit, blocks, steps):
    import torch

    import kuangchao.distributed as kc
    from kuangchao_core.perm import guard_api
    from kuangchao_core.perm.runtime import install_worker_guard

    enforcing = install_worker_guard(
        None,
        trust,
        JOB,
        0,
        audit,
        token=token,
        trust_root=trust_root,
        policy_file=policy_file,
        module_id=f"worker-{rank}",
        renew=False,
    )
    trusted = guard_api.AllowAll()
    kc.init()
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    gen = torch.Generator().manual_seed(rank)

    def step():
        x = torch.randn(32, 64, generator=gen)
        loss = (model(x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for p in params:
            kc.all_reduce(tensor=p.grad, op="avg")
        opt.step()

    guard_api.install_guard(enforcing)
    for _ in range(5):
        step()  # warm-up (first-use audit records happen here)
    times: dict[str, list[list[float]]] = {"enforcing": [], "trusted": []}  # [block][step]
    for b in range(blocks):
        order = ("enforcing", "trusted") if b % 2 == 0 else ("trusted", "enforcing")
        for mode in order:
            guard_api.install_guard(enforcing if mode == "enforcing" else trusted)
            kc.all_reduce(tensor=torch.zeros(1))  # line the ranks up before timing
            got = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                got.append(time.perf_counter() - t0)
            times[mode].append(got)
    guard_api.install_guard(enforcing)
    n = 200_000
    check = enforcing.check
    t0 = time.perf_counter()
    for _ in range(n):
        check("all_reduce", "group:world")
    check_ns = (time.perf_counter() - t0) / n * 1e9
    t0 = time.perf_counter()
    for _ in range(n):
        trusted.check("all_reduce", "group:world")
    allow_all_ns = (time.perf_counter() - t0) / n * 1e9
    enforcing.close()
    return {"times": times, "check_ns": check_ns, "allow_all_ns": allow_all_ns, "checks_per_step": len(params)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=20, help="blocks of enforcing + trusted")
    ap.add_argument("--steps", type=int, default=20, help="steps of each mode per block")
    ap.add_argument("--smoke", action="store_true", help="one block of two steps (seconds)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.blocks, args.steps = 1, 2

    from kuangchao_core.perm.authority import Authority
    from kuangchao_core.perm.issuance import POLICY_TYP
    from kuangchao_core.perm.roles import Policy
    from kuangchao_core.perm.signed_doc import write_document
    from tests.mp import run_distributed

    tmp = Path(tempfile.mkdtemp(prefix="kc-guard-bench-"))
    auth = Authority(tmp / "auth")
    # the tokens stay in memory (handed to the ranks as arguments); only the signed public files are written
    tokens = {
        r: auth.issue(
            f"worker-{r}",
            "trainer",
            JOB,
            0,
            interfaces=["all_reduce", "device_init"],
            devices=["cpu"],
            groups=["world"],
            ttl_s=3600,
        )
        for r in range(2)
    }
    trust_store = auth.export_trust_store(auth.trust_store_path)
    policy_file = write_document(auth.key_dir / "policy.json", auth.sign(POLICY_TYP, Policy().to_json()))
    token = tokens[0]
    verifier = auth.verifier(JOB)
    n = 300
    t0 = time.perf_counter()
    for _ in range(n):
        verifier.verify(token, subject="worker-0")
    verify_us = (time.perf_counter() - t0) / n * 1e6

    try:
        res = run_distributed(
            _rank_body,
            2,
            args=(
                tokens,
                str(trust_store),
                auth.trust_root,
                str(policy_file),
                str(tmp / "audit.jsonl"),
                args.blocks,
                args.steps,
            ),
            timeout=900,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # one block = both ranks' steps of each mode in that block
    blocks = [
        tuple([t for r in res for t in r["times"][mode][b]] for mode in ("enforcing", "trusted"))
        for b in range(args.blocks)
    ]
    stats = block_stats(blocks)
    enf = [t for ours, _ in blocks for t in ours]
    tru = [t for _, peer in blocks for t in peer]
    enf_ms, tru_ms = statistics.median(enf) * 1e3, statistics.median(tru) * 1e3
    check_ns = statistics.median(r["check_ns"] for r in res)
    allow_ns = statistics.median(r["allow_all_ns"] for r in res)
    checks = res[0]["checks_per_step"]
    result = {
        **result_fields(stats),
        "enforcing_step_ms": round(enf_ms, 3),
        "trusted_step_ms": round(tru_ms, 3),
        "steps_per_mode_per_rank": args.blocks * args.steps,
        "check_ns": round(check_ns, 1),
        "allow_all_check_ns": round(allow_ns, 1),
        "checks_per_step": checks,
        "guard_cost_per_step_pct": round(100 * checks * (check_ns - allow_ns) * 1e-9 / (tru_ms * 1e-3), 4),
        "verify_us": round(verify_us, 1),
        "world_size": 2,
        "backend": "gloo",
    }
    print(f"enforcing median step {enf_ms:.3f} ms, trusted {tru_ms:.3f} ms (all blocks, both ranks)")
    print(format_line("enforcing/trusted", stats))
    print(
        f"one check {check_ns:.0f} ns (AllowAll {allow_ns:.0f} ns); {checks} checks/step "
        f"= {result['guard_cost_per_step_pct']}% of a step; token verify {verify_us:.1f} us"
    )
    emit(result, RESULT_KEYS, smoke=args.smoke)
    return 0


def _rank_body(rank, world_size, tokens, *rest):
    return _body(rank, world_size, tokens[rank], *rest)


if __name__ == "__main__":
    raise SystemExit(main())
