"""The engine end to end on one GPU (issue 25 item 6); ``check.py`` runs it after its own sections.

    python benchmarks/gpu/engine_check.py [--out DIR]      # alone, on a CUDA machine
    python benchmarks/gpu/engine_check.py --smoke          # the same code paths on the CPU with the tiny model

(c) **kc train**: a real ``kc train`` (the CLI, the whole ``kuangchao-train`` Prefect flow: doctor, topology probe,
    data validation, tokens, launch, checkpoint verification) of a Llama-3.2-1B-shaped model (hidden 2048, 16
    layers, 32/8 heads, MLP 8192, vocabulary 128256, tied embeddings: 1.236 B parameters) on one GPU: bf16 autocast
    over fp32 master weights, ``train.compile: true`` (inductor), fused AdamW (the engine's choice for CUDA
    parameters), the engine's attention (``F.scaled_dot_product_attention``, causal, no mask: packing ``concat``,
    so flash attention on CUDA), the synthetic arithmetic corpus (generated, nothing downloaded), T = 2048,
    micro-batch 4, 40 steps. The job is written as ``kc_train_job.yaml`` into the output directory; checkpoints,
    MLflow store and run directories go to a scratch directory removed at the end. Reported: tokens/s (median of
    the steps after the first ``WARM`` ones, which pay the compilation), MFU = tokens/s × F_tok ÷ the device's bf16
    dense peak with F_tok = 6·N_matmul + 12·L·d·T (``/work/shared/reference/performance.md`` §2.1: the input
    embedding is not a matmul, the head is), the compile time the engine logs, the peak memory (largest step peak
    after warm-up, each its own: ``metrics.start_phase``; RSS on the CPU) against ``kc plan``'s rank 0, and the
    engine's measured parameter, gradient and optimizer bytes against the plan's.
(d) **the loss against fp32**: the same job file with ``--set train.dtype=fp32 train.compile=false`` trained for its
    first 8 steps by the engine's Trainer in this process; the relative difference of each step's loss from the
    ``kc train`` run's (bf16), with tests/test_mixed_precision.py's stated 2 % beside it.
(e) **the multi-rank path**: a 2-process data-parallel job (dp2, ``parallel.backend: gloo``, ``train.device``
    cuda, the small preset, fp32, 10 steps), its two engine workers started as ``kc train``'s torchrun starts them
    (``LOCAL_RANK`` 0 and 1). On a machine with one GPU the second one stops in ``hal.context.device_init``, which
    takes ``LOCAL_RANK`` as the device index; that failure is reported and the job runs again with both workers on
    device 0 (``LOCAL_RANK=0``), so Gloo reduces CUDA tensors between two ranks on one GPU (NCCL refuses two ranks
    on one device). Its losses are compared with the same global batch trained in one process (dp1, 2 micro-batches).

Budget on one H200 (estimates until the first run there; each section's wall time is in the RESULT): (c) ~4 min
(flow start ~40 s, 1.2 B model built on the CPU and moved ~30 s, inductor compile ~60 s, 40 steps ~10 s, final
15 GB checkpoint written and verified ~60 s), (d) ~1 min (build ~30 s, 8 fp32 steps ~15 s), (e) ~1 min; with
check.py's (a) ~0.5 min and (b) ~2.5 min about 9 min in all. Every subprocess is bounded by what is left of
``--budget-s`` (600 s), and a section that no longer fits is skipped and says so. ``--smoke`` runs every section with
the tiny model for 3 steps on the CPU (~1.5 min on 2 cores with check.py, 2.1 min with a cold inductor cache;
most of it the flow's start: Prefect server, doctor, probe, MLflow, data validation).
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kuangchao_core.config.presets import MODEL_PRESETS  # noqa: E402

#: bf16 dense peak FLOP/s by device name fragment (vendor figures, without sparsity)
PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}
#: Llama-3.2-1B's shape (tied embeddings: 1.236 B parameters): the ``1b`` preset, at 2048 positions
LLAMA_1B = {**MODEL_PRESETS["1b"], "max_seq_len": 2048}
#: steps of the kc train run whose time includes the compilation (left out of tokens/s and MFU)
WARM = 5
#: tests/test_mixed_precision.py's stated bf16 tolerance (relative, per step, for the tiny and small presets)
BF16_REL = 0.02
#: tests/tolerances.py's fp32 bound for a layout against one process (relative, per step)
FP32_LOSS_REL = 1e-5
#: environment variables of this process's own process group, which must not reach the jobs it starts
_OWN_PG_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


class Budget:
    """Wall-clock seconds left for the whole check."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left (may be negative)."""
        return self.deadline - time.monotonic()

    def allows(self, need_s: float) -> bool:
        """Whether ``need_s`` seconds still fit."""
        return self.left() >= need_s


# ----------------------------------------------------------------------------------------- job files


def kc_train_job(smoke: bool, device: str, steps: int, work: Path) -> dict[str, Any]:
    """The (c) job: the 1B shape (the tiny preset on --smoke), bf16, compiled, one process."""
    model = {"preset": "tiny", "tie_embeddings": True} if smoke else dict(LLAMA_1B)
    seq, batch = (64, 4) if smoke else (2048, 4)
    # enough arithmetic problems (~8 bytes each) that no window repeats within the run
    problems = max(2000, int(1.5 * steps * batch * (seq + 1) / 8))
    return {
        "task": {"name": "kc-gpu-check", "seed": 1234},
        "model": model,
        "data": {
            "format": "synthetic",
            "tokenizer": "byte",
            "seq_len": seq,
            "packing": "concat",  # no document mask: causal SDPA (flash on CUDA)
            "synthetic": {"task": "arithmetic", "num_train": problems, "num_eval": 0, "seed": 0},
        },
        "parallel": {"data_parallel_size": 1, "micro_batch_size": batch, "backend": "auto"},
        "optimizer": {"lr": 3e-4, "weight_decay": 0.01},
        "train": {
            "steps": steps,
            "warmup_steps": min(10, steps),
            "log_interval": 1,
            "device": device,
            "dtype": "bf16",
            "compile": True,
            "anomaly": {"comm_share": 1.0},
        },
        "cluster": {"mode": "local", "nproc_per_node": 1},
        "checkpoint": {"dir": str(work / "ckpt"), "interval": 10**6, "keep_last": 1, "resume": "never"},
        "tracking": {"uri": f"sqlite:///{work / 'mlflow.db'}", "log_model": False, "system_metrics": False},
        "permission": {"mode": "enforcing", "audit_log": str(work / "audit")},
    }


def multi_rank_job(smoke: bool, device: str, steps: int, work: Path) -> dict[str, Any]:
    """The (e) job: dp2 over Gloo on ``device``, the small preset (tiny on --smoke), fp32, trusted workers."""
    return {
        "task": {"name": "kc-gpu-check-dp2", "seed": 7},
        "model": {"preset": "tiny" if smoke else "small"},
        "data": {
            "format": "synthetic",
            "seq_len": 32 if smoke else 256,
            "packing": "concat",
            "synthetic": {"num_train": 2048, "num_eval": 0},
        },
        "parallel": {"data_parallel_size": 2, "micro_batch_size": 4 if smoke else 8, "backend": "gloo"},
        "optimizer": {"lr": 1e-3},
        "train": {"steps": steps, "warmup_steps": 2, "log_interval": 1, "device": device, "dtype": "fp32"},
        "cluster": {"mode": "local", "nproc_per_node": 2},
        "checkpoint": {"dir": str(work / "ckpt-dp2"), "interval": 10**6, "keep_last": 1, "resume": "never"},
        "tracking": {"uri": f"sqlite:///{work / 'mlflow-dp2.db'}", "system_metrics": False},
        "permission": {"mode": "trusted"},
        "logging": {"json_file": str(work / "dp2" / "worker-{rank}.jsonl")},
    }


def write_job(job: dict[str, Any], path: Path) -> Path:
    """Write ``job`` as YAML to ``path``; returns it."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def _child_env(work: Path) -> dict[str, str]:
    """The environment of a job this check starts: its own Prefect home (a ``PREFECT_API_URL`` set in the
    environment is still used) and runs directory, the user's operator key or one of its own, no telemetry, and
    none of this process's own process-group variables."""
    env = {k: v for k, v in os.environ.items() if k not in _OWN_PG_ENV and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PREFECT_HOME"] = str(work / "prefect")
    env.setdefault("KC_OPERATOR_KEY", str(work / "operator.key"))
    env["KC_RUNS_DIR"] = str(work / "runs")
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", MLFLOW_ENABLE_TELEMETRY="false", DO_NOT_TRACK="1")
    return env


# ----------------------------------------------------------------------------------------- model arithmetic


def model_shape(job_path: Path) -> Any:
    """The LlamaConfig the job builds."""
    from kuangchao_core.config import load_config
    from kuangchao_core.models.llama import config_from_model_section

    return config_from_model_section(load_config(str(job_path)).model)


def flops_per_token(cfg: Any, seq: int) -> float:
    """Model FLOPs per trained token, ``6·N_matmul + 12·L·d·T`` (attention's score and value products counted,
    causal sparsity not; the input embedding is a lookup, the head a matmul)."""
    n_matmul = cfg.num_params() - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size)
    return 6.0 * n_matmul + 12.0 * cfg.num_layers * cfg.hidden_size * seq


def peak_flops(device: torch.device) -> float | None:
    """The device's bf16 dense peak FLOP/s (None on the CPU or an unknown device)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAKS.items() if k in name), None)


def attention_kernel(cfg: Any, seq: int, device: torch.device) -> str | None:
    """The aten attention op(s) the engine's attention layer dispatches to at the job's head shapes under bf16
    autocast, with fp32 hidden states and rotary tables as in the engine (one eager forward of one sequence,
    profiled): ``aten::_scaled_dot_product_flash_attention`` is flash attention."""
    from kuangchao_core.models.llama import LlamaAttention, RotaryEmbedding

    with torch.device(device):
        layer = LlamaAttention(cfg, lambda i, o, role: torch.nn.Linear(i, o, bias=False))
        cos, sin = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)(torch.arange(seq), torch.float32)
        x = torch.randn(1, seq, cfg.hidden_size)
    with torch.profiler.profile() as prof, torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        layer(x, cos, sin)
    names = sorted({e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")})
    del layer, x
    return ", ".join(names) or None


def adamw_kind(device: torch.device) -> str:
    """The AdamW implementation the engine picks for parameters on ``device``."""
    from kuangchao_core.hal.dtypes import adamw_kernel

    flags = adamw_kernel([torch.empty(1, device=device)])
    return "fused" if flags.get("fused") else "foreach" if flags.get("foreach") else "single-tensor"


# ----------------------------------------------------------------------------------------- (c) kc train


def _last_json_object(text: str, key: str) -> dict | None:
    """The last JSON object in ``text`` that starts a line and has ``key`` (``kc train --json``'s summary)."""
    decoder = json.JSONDecoder()
    starts = [0] if text.startswith("{") else []
    starts += [i + 1 for i, c in enumerate(text) if c == "\n" and text[i + 1 : i + 2] == "{"]
    for start in reversed(starts):
        try:
            found, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(found, dict) and key in found:
            return found
    return None


def _json_lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def run_kc_train(job_path: Path, work: Path, out: Path, timeout_s: float, warm: int = WARM) -> dict[str, Any]:
    """``kc train --config JOB --resume never --json`` as a user runs it; the summary, every step's loss, tokens/s
    (median over the steps after the first ``warm``) and memory from the run's MLflow store, and the engine's
    compile and memory lines from rank 0's log."""
    argv = [sys.executable, "-m", "kuangchao.cli.main", "train", "--config", str(job_path), "--resume", "never"]
    t0 = time.perf_counter()
    rc, stdout, stderr = _run([*argv, "--json"], _child_env(work), timeout_s)
    wall = time.perf_counter() - t0
    (out / "kc_train.log").write_text(stdout + "\n--- stderr ---\n" + stderr)
    summary = _last_json_object(stdout, "mlflow_run_id")
    res: dict[str, Any] = {"command": " ".join(["kc", *argv[3:]]), "returncode": rc, "wall_s": round(wall, 1)}
    res["completed"] = bool(rc == 0 and summary and summary.get("trained_steps"))
    if summary is None:
        res["error"] = _tail(stderr)
        return res
    res["summary"] = {
        k: summary.get(k) for k in ("steps", "trained_steps", "final_loss", "tokens_per_s_mean", "wall_s", "layout")
    }
    cfg_uri = f"sqlite:///{work / 'mlflow.db'}"
    res["losses"] = [v for _, v in _metric_history(cfg_uri, summary["mlflow_run_id"], "loss")]
    tps = [v for s, v in _metric_history(cfg_uri, summary["mlflow_run_id"], "tokens_per_s") if s > warm]
    mem = [v for s, v in _metric_history(cfg_uri, summary["mlflow_run_id"], "mem_bytes") if s > warm]  # step peaks
    res["tokens_per_s"] = statistics.median(tps) if tps else None
    res["peak_mem_bytes"] = max(mem) if mem else None
    for rec in _json_lines(Path(summary["run_dir"]) / "logs" / "worker-0.jsonl"):
        if rec.get("logger") == "kuangchao.models.compile":
            res["compile_line"] = rec.get("msg")
            res["compile_s"] = rec.get("compile_s")
        elif rec.get("msg") == "memory":
            res["mem_kind"] = rec.get("mem_kind")
            res["tensor_bytes"] = rec.get("tensor_bytes")
            res["plan_state_bytes"] = rec.get("plan_estimate_bytes")
    return res


def kc_plan(job_path: Path, work: Path) -> dict[str, Any] | None:
    """``kc plan --config JOB --json``: rank 0's estimated memory (bytes: params, grads, optimizer, activations,
    total), or None if the command failed."""
    argv = [sys.executable, "-m", "kuangchao.cli.main", "plan", "--config", str(job_path), "--json"]
    rc, stdout, _ = _run(argv, _child_env(work), 120)
    plan = _last_json_object(stdout, "ranks") if rc == 0 else None
    return None if plan is None else plan["ranks"][0]["memory_bytes"]


# ----------------------------------------------------------------------------------------- in-process Trainer


def _process_group() -> None:
    """This process as a one-rank job (the engine's Trainer needs a process group), once."""
    import torch.distributed as dist

    from kuangchao_core.comm import init_distributed
    from kuangchao_core.perm import guard_api
    from kuangchao_core.sched.launcher import free_port

    guard_api.install_guard(guard_api.AllowAll())
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    init_distributed(backend="auto", timeout_ms=600_000)


def train_in_process(job_path: Path, overrides: list[str], device: torch.device, steps: int) -> list[float]:
    """The first ``steps`` losses of the job file (with ``--set`` ``overrides``) trained by the engine's Trainer in
    this process on ``device`` (one rank; the learning-rate schedule is the job's, cut after ``steps``)."""
    from kuangchao_core.comm import world_group
    from kuangchao_core.config import load_config, run_settings
    from kuangchao_core.engine.trainer import Trainer
    from kuangchao_core.parallel.mesh import ParallelMesh

    _process_group()
    cfg = load_config(str(job_path), overrides)
    mesh = ParallelMesh.from_config(cfg.parallel, 0, 1)
    trainer = Trainer(run_settings(cfg), 0, 1, device, world_group(), mesh)
    try:
        return list(trainer.run(resume="never", max_steps=steps).losses)
    finally:
        del trainer
        _free(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------- (e) two ranks


def launch_workers(job_path: Path, local_ranks: list[int], work: Path, tag: str, timeout_s: float) -> dict[str, Any]:
    """The engine's worker (``python -m kuangchao_core.engine.worker``) on ``len(local_ranks)`` processes, rank r
    told ``LOCAL_RANK=local_ranks[r]`` (torchrun gives 0, 1, …); rank 0's per-step losses from its events, and the
    first failing rank's last error line. A rank that fails stops the others."""
    from kuangchao_core.sched.launcher import free_port

    world = len(local_ranks)
    logs = work / f"workers-{tag}"
    logs.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    procs = []
    for rank, local in enumerate(local_ranks):
        env = _child_env(work) | {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        argv = [sys.executable, "-m", "kuangchao_core.engine.worker", "--config", str(job_path), "--resume", "never"]
        with open(logs / f"rank{rank}.out", "w") as so, open(logs / f"rank{rank}.err", "w") as se:
            procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=so, stderr=se, start_new_session=True))
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    failed_at: float | None = None
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            failed_at = failed_at or time.monotonic()
        if time.monotonic() > deadline or (failed_at and time.monotonic() - failed_at > 5):
            for p in procs:
                if p.poll() is None:
                    _kill_session(p)
            break
        time.sleep(0.2)
    codes = [p.returncode for p in procs]
    res: dict[str, Any] = {
        "local_ranks": local_ranks,
        "returncodes": codes,
        "ok": all(c == 0 for c in codes),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    events = [json.loads(line.split("KC_EVENT ", 1)[1]) for line in _lines(logs / "rank0.out") if "KC_EVENT " in line]
    res["losses"] = [e["loss"] for e in events if e.get("event") == "step"]
    # the rank that failed by itself (exit code > 0) rather than one stopped after it (killed: < 0)
    first_bad = next((r for r, c in enumerate(codes) if c is not None and c > 0), None)
    if first_bad is None:
        first_bad = next((r for r, c in enumerate(codes) if c != 0), None)
    if first_bad is not None:
        res["failed_rank"] = first_bad
        res["error"] = _error_line(logs / f"rank{first_bad}.err")
    return res


def multi_rank(job_path: Path, device: torch.device, work: Path, steps: int, budget: Budget) -> dict[str, Any]:
    """(e): the 2-rank job as torchrun starts it; if that fails on a one-GPU machine, again with both ranks on
    device 0; its losses against one process on the same global batch."""
    res: dict[str, Any] = {"as_launched": launch_workers(job_path, [0, 1], work, "launched", min(300, budget.left()))}
    run = res["as_launched"]
    one_gpu = device.type == "cuda" and torch.cuda.device_count() < 2
    if not run["ok"] and one_gpu and budget.allows(60):
        res["shared_device"] = launch_workers(job_path, [0, 0], work, "shared", min(300, budget.left()))
        run = res["shared_device"]
    if run["ok"] and budget.allows(30):
        # one process, the same global batch: dp1 with the two ranks' micro-batches accumulated
        ref = train_in_process(
            job_path,
            ["parallel.data_parallel_size=1", "parallel.gradient_accumulation_steps=2", "cluster.nproc_per_node=1"],
            device,
            steps,
        )
        res["one_process_losses"] = ref
        res["max_rel_loss_diff"] = _max_rel(run["losses"], ref)
        res["fp32_bound"] = FP32_LOSS_REL
    res["completed"] = bool(run["ok"] and len(run["losses"]) == steps and _finite(run["losses"]))
    return res


# ----------------------------------------------------------------------------------------- helpers


def _run(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[int | None, str, str]:
    """Run ``argv`` in its own session from the repository root; (exit code or None on timeout, stdout, stderr).
    On timeout the whole session is killed (a flow's launcher, workers and Prefect server with it)."""
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        stdout, stderr = proc.communicate()
        return None, stdout, stderr + f"\ntimed out after {timeout_s:.0f} s"


def _kill_session(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _lines(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines() if path.is_file() else []


def _tail(text: str, n: int = 6) -> str:
    return "\n".join([line for line in text.splitlines() if line.strip()][-n:])[-1500:]


def _error_line(path: Path) -> str:
    """The exception a traceback in ``path`` ends with, its message's lines joined (else the file's last lines)."""
    lines = [line for line in _lines(path) if line.strip()]
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i].split("]:", 1)[-1] if lines[i].startswith("[rank") else lines[i]  # torchrun's prefix
        head = line.split(":", 1)[0].strip()
        if head.endswith(("Error", "Exception", "Timeout")) and not line.startswith(" "):
            return " | ".join(x.strip() for x in [line, *lines[i + 1 :]])[:800]
    return _tail("\n".join(lines), 3)


def _finite(values: list[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)


def _max_rel(got: list[float], want: list[float]) -> float | None:
    n = min(len(got), len(want))
    if n == 0:
        return None
    return max(abs(g - w) / abs(w) for g, w in zip(got[:n], want[:n], strict=True))


# ----------------------------------------------------------------------------------------- the sections


def engine_checks(
    device: torch.device,
    smoke: bool,
    out: Path,
    *,
    steps: int | None = None,
    fp32_steps: int | None = None,
    budget: Budget | None = None,
    work: Path | None = None,
    keep_work: bool = False,
    skip: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Sections (c), (d) and (e) (see the module docstring; ``skip`` names any of ``kc_train``, ``multi_rank``);
    returns their RESULT fields and prints one line per figure."""
    budget = budget or Budget(600)
    steps = steps or (3 if smoke else 40)
    fp32_steps = min(steps, fp32_steps or (3 if smoke else 8))
    out.mkdir(parents=True, exist_ok=True)
    scratch = work or Path(tempfile.mkdtemp(prefix="kc-gpu-check-"))
    result: dict[str, Any] = {"wall_s": {}}
    try:
        if "kc_train" not in skip:
            part = _reported(_kc_train_sections, device, smoke, out, scratch, steps, fp32_steps, budget)
            if "error" in part:
                result["kc_train"] = part
            else:
                result["wall_s"].update(part.pop("wall_s"))
                result.update(part)
        if "multi_rank" not in skip:
            t0 = time.perf_counter()
            if budget.allows(60):
                job = write_job(
                    multi_rank_job(smoke, device.type, 3 if smoke else 10, scratch), out / "multi_rank_job.yaml"
                )
                result["multi_rank"] = _reported(multi_rank, job, device, scratch, 3 if smoke else 10, budget)
            else:
                result["multi_rank"] = {"skipped": f"budget: {budget.left():.0f} s left"}
            result["wall_s"]["multi_rank"] = round(time.perf_counter() - t0, 1)
            _print_multi_rank(result["multi_rank"])
    finally:
        if work is None and not keep_work:
            shutil.rmtree(scratch, ignore_errors=True)
    return result


def _reported(section: Any, *args: Any) -> dict[str, Any]:
    """``section(*args)``, or ``{"error": ...}`` naming what raised: the check reports a failure and goes on."""
    import traceback

    try:
        return section(*args)
    except Exception as exc:  # noqa: BLE001 - every failure is a finding of the check
        print(f"{section.__name__}: FAILED: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}


def _kc_train_sections(
    device: torch.device, smoke: bool, out: Path, work: Path, steps: int, fp32_steps: int, budget: Budget
) -> dict[str, Any]:
    result: dict[str, Any] = {"wall_s": {}}
    job = write_job(kc_train_job(smoke, device.type, steps, work), out / "kc_train_job.yaml")
    cfg = model_shape(job)
    seq = 64 if smoke else 2048
    t0 = time.perf_counter()
    warm = WARM if steps > 2 * WARM else 1
    run = run_kc_train(job, work, out, max(60.0, budget.left() - 90), warm)  # leaves room for (d) and (e)
    run["warm_steps"] = warm
    result["wall_s"]["kc_train"] = round(time.perf_counter() - t0, 1)
    run["params"] = cfg.num_params()
    run["flops_per_token"] = flops_per_token(cfg, seq)
    peak = peak_flops(device)
    run["peak_flops"] = peak
    run["mfu"] = run["tokens_per_s"] * run["flops_per_token"] / peak if peak and run.get("tokens_per_s") else None
    run["adamw"] = adamw_kind(device)
    run["attention"] = attention_kernel(cfg, seq, device)
    run["plan"] = kc_plan(job, work)
    total = (run["plan"] or {}).get("total")
    run["peak_mem_vs_plan"] = run["peak_mem_bytes"] / total if total and run.get("peak_mem_bytes") else None
    result["kc_train"] = run
    _print_kc_train(run)
    t0 = time.perf_counter()
    if run.get("losses") and budget.allows(90 if not smoke else 20):
        fp32 = train_in_process(job, ["train.dtype=fp32", "train.compile=false"], device, fp32_steps)
        rel = [abs(b - f) / abs(f) for b, f in zip(run["losses"], fp32, strict=False)]
        result["vs_fp32"] = {
            "steps": len(rel),
            "fp32_losses": fp32,
            "bf16_losses": run["losses"][: len(rel)],
            "rel_loss_diff": rel,
            "max_rel_loss_diff": max(rel) if rel else None,
            "bf16_rel_stated": BF16_REL,
        }
        print(
            f"kc train (bf16) against fp32, first {len(rel)} steps: max relative loss difference "
            f"{result['vs_fp32']['max_rel_loss_diff']:.2e} (the CPU test states {BF16_REL:.0%})"
        )
    else:
        result["vs_fp32"] = {"skipped": "no kc train losses" if not run.get("losses") else "budget"}
    result["wall_s"]["vs_fp32"] = round(time.perf_counter() - t0, 1)
    return result


def _fmt_bytes(n: float | None) -> str:
    return "n/a" if not n else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _print_kc_train(run: dict[str, Any]) -> None:
    if not run.get("completed"):
        print(f"kc train: FAILED (exit {run.get('returncode')}): {run.get('error', '')}")
    tps = run.get("tokens_per_s")
    mfu = f"{100 * run['mfu']:.1f}%" if run.get("mfu") else "n/a"
    speed = f"{tps:,.0f} tok/s after step {run.get('warm_steps')}, MFU {mfu}" if tps else "no tokens/s"
    print(
        f"kc train: {run['params'] / 1e9:.3f} B params, {len(run.get('losses', []))} steps in {run['wall_s']:.0f} s, "
        f"final loss {run.get('summary', {}).get('final_loss')}, {speed}"
    )
    print(f"kc train: {run.get('compile_line') or 'no compile line logged'}; AdamW {run['adamw']}; {run['attention']}")
    plan = run.get("plan") or {}
    print(
        f"kc train: peak memory {_fmt_bytes(run.get('peak_mem_bytes'))} ({run.get('mem_kind')}) against kc plan "
        f"{_fmt_bytes(plan.get('total'))} (ratio {run['peak_mem_vs_plan'] or float('nan'):.2f}); engine tensors "
        f"{_fmt_bytes(run.get('tensor_bytes'))} against plan states {_fmt_bytes(run.get('plan_state_bytes'))}"
    )


def _print_multi_rank(res: dict[str, Any]) -> None:
    if "skipped" in res or "error" in res:
        print(f"2 ranks: {'skipped' if 'skipped' in res else 'FAILED'} ({res.get('skipped') or res.get('error')})")
        return
    for name in ("as_launched", "shared_device"):
        run = res.get(name)
        if run is None:
            continue
        what = "ok" if run["ok"] else f"FAILED, rank {run.get('failed_rank')}: {run.get('error')}"
        print(f"2 ranks ({name}, LOCAL_RANK {run['local_ranks']}): {what}; losses {run['losses']}")
    if "max_rel_loss_diff" in res:
        print(
            f"2 ranks against one process: max relative loss difference {res['max_rel_loss_diff']:.2e} "
            f"(fp32 bound {FP32_LOSS_REL:.0e})"
        )


def main(argv: list[str] | None = None) -> int:
    """Run (c)-(e) alone and print ``RESULT {json}``."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="the tiny model on the CPU: checks the code paths only")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=600.0)
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device here: run with --smoke for the CPU code paths", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    result = engine_checks(device, args.smoke, Path(args.out), budget=Budget(args.budget_s))
    print("RESULT " + json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
