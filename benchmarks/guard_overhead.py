"""Cost of the permission guard: a data-parallel training step with the guard enforcing vs trusted mode.

Two Gloo ranks train a small model whose gradients are averaged with ``kuangchao.distributed.all_reduce`` (one
guarded collective per parameter). Blocks of steps alternate between the enforcing guard (a verified token,
audit log on) and ``AllowAll`` in the same processes; medians of the per-step times are compared. Also measured:
one ``check`` in nanoseconds and one token verification (Ed25519 + strict parse) in microseconds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/guard_overhead.py [--blocks 6] [--steps 15]

The last line is ``RESULT {json}`` with ``ratio_vs_peer`` = enforcing ÷ trusted median step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _body(rank, world_size, token_file, trust, audit, blocks, steps):
    import torch

    import kuangchao.distributed as kc
    from kuangchao_core.perm import guard_api
    from kuangchao_core.perm.runtime import install_worker_guard

    enforcing = install_worker_guard(token_file, trust, "bench", 0, audit, renew=False)
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
    times = {"enforcing": [], "trusted": []}
    for b in range(blocks):
        order = ("enforcing", "trusted") if b % 2 == 0 else ("trusted", "enforcing")
        for mode in order:
            guard_api.install_guard(enforcing if mode == "enforcing" else trusted)
            kc.all_reduce(tensor=torch.zeros(1))  # line the ranks up before timing
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                times[mode].append(time.perf_counter() - t0)
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
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args(argv)

    from kuangchao_core.perm.authority import Authority
    from tests.mp import run_distributed

    tmp = Path(tempfile.mkdtemp(prefix="kc-guard-bench-"))
    auth = Authority(tmp / "auth")
    tokens = {}
    for r in range(2):
        p = tmp / f"worker-{r}.token"
        p.write_text(
            auth.issue(
                f"worker-{r}",
                "trainer",
                "bench",
                0,
                interfaces=["all_reduce", "device_init"],
                devices=["cpu"],
                groups=["world"],
                ttl_s=3600,
            )
        )
        tokens[r] = str(p)
    token = Path(tokens[0]).read_text()
    verifier = auth.verifier("bench")
    n = 300
    t0 = time.perf_counter()
    for _ in range(n):
        verifier.verify(token, subject="worker-0")
    verify_us = (time.perf_counter() - t0) / n * 1e6

    res = run_distributed(
        _rank_body,
        2,
        args=(tokens, str(auth.trust_store_path), str(tmp / "audit.jsonl"), args.blocks, args.steps),
        timeout=600,
    )
    enf = [t for r in res for t in r["times"]["enforcing"]]
    tru = [t for r in res for t in r["times"]["trusted"]]
    enf_ms, tru_ms = statistics.median(enf) * 1e3, statistics.median(tru) * 1e3
    check_ns = statistics.median(r["check_ns"] for r in res)
    allow_ns = statistics.median(r["allow_all_ns"] for r in res)
    checks = res[0]["checks_per_step"]
    result = {
        "ratio_vs_peer": round(enf_ms / tru_ms, 4),
        "enforcing_step_ms": round(enf_ms, 3),
        "trusted_step_ms": round(tru_ms, 3),
        "steps_per_mode": len(enf),
        "check_ns": round(check_ns, 1),
        "allow_all_check_ns": round(allow_ns, 1),
        "checks_per_step": checks,
        "guard_cost_per_step_pct": round(100 * checks * (check_ns - allow_ns) * 1e-9 / (tru_ms * 1e-3), 4),
        "verify_us": round(verify_us, 1),
        "world_size": 2,
        "backend": "gloo",
    }
    print(f"enforcing median step {enf_ms:.3f} ms, trusted {tru_ms:.3f} ms (ratio {result['ratio_vs_peer']})")
    print(
        f"one check {check_ns:.0f} ns (AllowAll {allow_ns:.0f} ns); {checks} checks/step "
        f"= {result['guard_cost_per_step_pct']}% of a step; token verify {verify_us:.1f} us"
    )
    print("RESULT " + json.dumps(result))
    return 0


def _rank_body(rank, world_size, tokens, trust, audit, blocks, steps):
    return _body(rank, world_size, tokens[rank], trust, audit, blocks, steps)


if __name__ == "__main__":
    raise SystemExit(main())
