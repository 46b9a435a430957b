"""How ``check.py`` runs its sections so that one device session gets every figure it can (issue 41 item 5).

Each section runs through :func:`run_section`: a progress line when it starts (with the budget left) and when it
ends (its wall time), its own time limit (in-process sections: an alarm that raises :class:`SectionTimeout` in
the main thread; sections that start processes bound them themselves), and any failure — an exception or the
limit — recorded as ``{"error": …}`` under the section's key while the next section still runs. After every
section the whole RESULT so far is written to ``gpu_check.json`` (``"complete": false`` until the end), so a
session cut short still leaves the figures it reached.

Two small sections live here: :func:`phase_peak_check` (the engine's per-step peak reset on the real allocator)
and :func:`plan_communicators` (``kc plan``'s communicators and NCCL buffer estimate for one node of eight GPUs).
"""

from __future__ import annotations

import json
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class SectionTimeout(Exception):
    """A section ran past its time limit."""


def _alarm(signum, frame):  # noqa: ARG001 - signal handler signature
    raise SectionTimeout("section time limit reached")


def write_partial(result: dict[str, Any], out: Path, complete: bool = False) -> None:
    """Write ``result`` (with ``complete``) to ``out/gpu_check.json``."""
    out.mkdir(parents=True, exist_ok=True)
    result["complete"] = complete
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))


def run_section(
    result: dict[str, Any],
    key: str,
    fn: Callable[..., Any],
    *args: Any,
    out: Path,
    limit_s: float | None,
    budget_left: Callable[[], float],
    need_s: float = 0.0,
) -> Any:
    """``result[key] = fn(*args)``, bounded by ``limit_s`` (None: ``fn`` bounds itself), skipped when fewer than
    ``need_s`` seconds of the budget are left; ``result["sections"][key]`` gets its status and wall time."""
    sections = result.setdefault("sections", {})
    left = budget_left()
    if left < need_s:
        result[key] = {"skipped": f"budget: {left:.0f} s left, {need_s:.0f} s needed"}
        sections[key] = {"status": "skipped", "wall_s": 0.0}
        print(f"[gpu-check] {key}: skipped ({left:.0f} s of the budget left, {need_s:.0f} s needed)", flush=True)
        write_partial(result, out)
        return result[key]
    limit = None if limit_s is None else max(1.0, min(limit_s, left))
    print(f"[gpu-check] {key}: start (limit {limit or 'own'} s, budget left {left:.0f} s)", flush=True)
    t0 = time.perf_counter()
    status = "ok"
    old = signal.signal(signal.SIGALRM, _alarm) if limit else None
    if limit:
        signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        result[key] = fn(*args)
        if isinstance(result[key], dict) and "error" in result[key]:
            status = "failed"
    except SectionTimeout:
        status = "timed_out"
        result[key] = {"error": f"timed out after {limit:.0f} s", "traceback": traceback.format_exc()[-2000:]}
    except Exception as exc:  # noqa: BLE001 - every failure is a finding; the next section still runs
        status = "failed"
        result[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    finally:
        if limit:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    wall = round(time.perf_counter() - t0, 1)
    sections[key] = {"status": status, "wall_s": wall}
    detail = f": {result[key]['error']}" if status != "ok" else ""
    print(f"[gpu-check] {key}: {status} in {wall:.1f} s{detail}", flush=True)
    write_partial(result, out)
    return result[key]


def phase_peak_check(device: torch.device) -> dict[str, Any]:
    """The engine's per-step peak (``engine.metrics``) on the real allocator: a 1 GiB phase, then
    ``start_phase`` and a 64 MiB phase; the second phase's ``memory_bytes`` must exclude the first's 1 GiB (and
    does not, without the reset: the control). On the CPU: the figure's kind only (no peak to reset)."""
    from kuangchao_core.engine.metrics import memory_bytes, memory_kind, start_phase

    out: dict[str, Any] = {"mem_kind": memory_kind(device)}
    if device.type != "cuda":
        out["skipped"] = "the CPU reports its resident set size, not a peak"
        return out
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)

    def phase(nbytes: int) -> None:
        x = torch.empty(nbytes, dtype=torch.uint8, device=device)
        x.fill_(1)
        torch.cuda.synchronize(device)
        del x

    phase(2**30)
    without_reset = memory_bytes(device) - base  # the control: the 1 GiB phase still shows
    start_phase(device)
    phase(64 * 2**20)
    with_reset = memory_bytes(device) - base
    out.update(phase1_bytes=2**30, phase2_bytes=64 * 2**20, without_reset=without_reset, with_reset=with_reset)
    out["ok"] = bool(without_reset >= 2**30 and 64 * 2**20 <= with_reset < 2**30)
    print(
        f"phase peak: without reset {without_reset / 2**20:.0f} MiB (control, >= 1024), after start_phase "
        f"{with_reset / 2**20:.0f} MiB (the 64 MiB phase alone): {'ok' if out['ok'] else 'WRONG'}"
    )
    return out


def plan_communicators() -> dict[str, Any]:
    """``kc plan``'s communicators of rank 0 and its NCCL buffer estimate for Llama-1B on one node of eight
    GPUs: dp8, dp2×tp4 and dp2×pp2×tp2 (arithmetic only; the figures for RESULTS.md beside the device's own)."""
    from engine_check import LLAMA_1B

    from kuangchao_core.config import config_from_dict
    from kuangchao_core.engine.plan_comms import communicators

    out: dict[str, Any] = {}
    for name, par in {
        "dp8": {"data_parallel_size": 8},
        "dp2_tp4": {"data_parallel_size": 2, "tensor_parallel_size": 4},
        "dp2_pp2_tp2": {"data_parallel_size": 2, "pipeline_parallel_size": 2, "tensor_parallel_size": 2},
    }.items():
        cfg = config_from_dict(
            {
                "task": {"name": f"plan-{name}"},
                "model": dict(LLAMA_1B),
                "data": {"format": "synthetic", "seq_len": 2048},
                "parallel": {"micro_batch_size": 1, "gradient_accumulation_steps": 4, **par},
                "train": {"device": "cuda"},
                "cluster": {"mode": "local", "nproc_per_node": 8},
            }
        )
        comms = communicators(cfg)
        r0 = comms["ranks"][0]
        out[name] = {
            "rank0": [f"{c['name']}: {c['communicator']}" for c in r0["communicators"]],
            "rank0_nccl_bytes_estimate": r0["nccl_bytes"],
            "max_rank_nccl_bytes_estimate": max(r["nccl_bytes"] for r in comms["ranks"]),
        }
        out["per_communicator_bytes_estimate"] = comms["estimate"]["per_communicator_bytes"]
        print(f"kc plan communicators {name}, rank 0: {', '.join(out[name]['rank0'])}; NCCL buffers (estimate) "
              f"{r0['nccl_bytes'] / 2**20:.0f} MiB")  # fmt: skip
    return out
