"""The batch script of a Slurm attempt, and the ``sbatch`` line that submits it (issue 32 §1, §6).

The script is meant to be read: ``#SBATCH`` lines from ``cluster.slurm``, then one ``srun`` step with one task per
node; each task is Kuangchao's node launcher (:mod:`kuangchao_core.sched.slurm.node`) running the torchrun line
written out after ``--``, a c10d rendezvous on the first allocated node (its ``NodeAddr`` from ``scontrol show
node``, not DNS) and ``--rdzv_id`` from the Slurm job id and the attempt.

Slurm stores the script and the exported environment where others may read them, so nothing secret is in either:
the environment is an explicit allow-list (:data:`EXPORTED`, never ``ALL``), the workers' settings are in the run
directory's ``share.json`` and each node's tokens in a 0600 file of its own (``docs/architecture.md``, "Slurm").
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

from kuangchao_core.sched.bind_address import RDZV_BACKEND, TORCHRUN
from kuangchao_core.sched.slurm import time_limit

#: environment variables the batch job gets from ``kc train``'s (when set), plus ``cluster.slurm.export_env``
EXPORTED = (
    "PATH",
    "PYTHONPATH",
    "HOME",
    "USER",
    "LANG",
    "LC_ALL",
    "TZ",
    "OMP_NUM_THREADS",
    "VIRTUAL_ENV",
    "SLURM_CONF",
)
#: the worker entry point every rank runs
WORKER = "kuangchao_core.engine.worker"
#: the topology probe's rank (issue 32 §5)
PROBE = "kuangchao_core.sched.probe_worker"


def slurm_dir(run_dir: str | Path, attempt: int) -> Path:
    """``attempt_<n>/slurm/`` of a run: the script, the sbatch line, the job's state log and output."""
    return Path(run_dir) / f"attempt_{attempt}" / "slurm"


def exported_names(slurm: Any, env: dict[str, str] | None = None) -> list[str]:
    """The allow-list of variables the job gets, those set in ``env`` (default this process's) only."""
    env = os.environ if env is None else env
    wanted = [*EXPORTED, *getattr(slurm, "export_env", [])]
    return [name for i, name in enumerate(wanted) if name in env and name not in wanted[:i]]


def secret_warnings(slurm: Any) -> list[str]:
    """One warning per ``export_env`` name that looks like a credential and is exported because
    ``cluster.slurm.export_env_allow_secrets`` allows it (the config refuses such a name otherwise)."""
    from kuangchao_core.config.slurm_options import exported_secrets

    return [
        f"warning: cluster.slurm.export_env exports {name}, which looks like a credential "
        "(cluster.slurm.export_env_allow_secrets): Slurm keeps the job's environment where others can read it"
        for name in exported_secrets(slurm)
    ]


def sbatch_options(cfg: Any, run_dir: str | Path, attempt: int, exclude: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The ``#SBATCH`` options of the job, from ``cluster.slurm`` (``exclude``: nodes lost in earlier attempts)."""
    slurm = cfg.cluster.slurm
    return [
        f"--job-name={cfg.task.name}",
        f"--nodes={slurm.nodes}",
        "--ntasks-per-node=1",
        f"--output={slurm_dir(run_dir, attempt) / 'batch-%j.out'}",
        f"--chdir={Path(run_dir)}",
        *([f"--exclude={','.join(exclude)}"] if exclude else []),
        *request_options(slurm),
        *time_limit.sbatch_options(slurm),
    ]


def request_options(slurm: Any) -> list[str]:
    """What ``cluster.slurm`` asks of the scheduler besides the node count (partition, account, qos, constraint,
    time, GPUs, exclusivity, switches, extra options): the same in the job and in ``kc doctor``'s ``--test-only``."""
    out: list[str] = []
    for name in ("partition", "account", "qos", "constraint"):
        if getattr(slurm, name):
            out.append(f"--{name}={getattr(slurm, name)}")
    if slurm.time_limit:
        out.append(f"--time={slurm.time_limit}")
    if slurm.gpus_per_node:
        out.append(f"--gpus-per-node={slurm.gpus_per_node}")
    if slurm.exclusive:
        out.append("--exclusive")
    if slurm.switches:
        out.append(f"--switches={slurm.switches}" + (f"@{slurm.switches_wait}" if slurm.switches_wait else ""))
    return out + list(slurm.extra_sbatch_args)


def torchrun_line(
    cfg: Any, args: list[str], port: int, attempt: int, python: str = sys.executable, module: str = WORKER,
    rdzv_suffix: str = "",
) -> list[str]:  # fmt: skip
    """The torchrun command every node's launcher runs (shell words; ``$…`` expanded by the batch shell): torchrun
    with the ``kc-c10d`` rendezvous, whose store the head node binds to ``$head_addr`` only (issue 38 item 2)."""
    return [
        python,
        "-m",
        TORCHRUN,
        '--nnodes="$SLURM_NNODES"',
        f"--nproc-per-node={cfg.cluster.slurm.tasks_per_node}",
        f"--rdzv_backend={RDZV_BACKEND}",
        f'--rdzv_endpoint="$head_addr:{port}"',
        f'--rdzv_id="$SLURM_JOB_ID-{attempt}{rdzv_suffix}"',
        "--max-restarts=0",
        "-m",
        module,
        *[shlex.quote(str(a)) for a in args],
    ]


def _step(run_dir: str | Path, attempt: int, output: str) -> str:
    out = shlex.quote(str(slurm_dir(run_dir, attempt) / output))
    return f'srun --ntasks-per-node=1 --nodes="$SLURM_NNODES" --kill-on-bad-exit=1 --output={out}'


def placement_lines(
    cfg: Any, run_dir: str | Path, attempt: int, placement: dict[str, Any], python: str = sys.executable
) -> list[str]:
    """The steps before training (issue 32 §5): the topology probe when ``placement`` asks for it (a failure is
    said and the job goes on without measured links), then the placement step that writes ``placement.json``."""
    share = shlex.quote(str(slurm_dir(run_dir, attempt) / "share.json"))
    lines = []
    if placement.get("probe"):
        out = slurm_dir(run_dir, attempt) / "probe" / "ranks"
        sizes = placement["probe_sizes"]
        probe_args = ["--out", out, "--small", sizes[0], "--large", sizes[1], "--iters", placement["probe_iters"]]
        launcher = [python, "-m", "kuangchao_core.sched.slurm.node", "--share", share, "--probe", "--"]
        torchrun = torchrun_line(cfg, probe_args, placement["probe_port"], attempt, python, PROBE, "-probe")
        lines += [
            "# 1. the links between the allocated nodes, measured as on every path (kuangchao_core.sched.probe_worker)",
            " \\\n  ".join([_step(run_dir, attempt, "probe-%N.out"), " ".join(launcher), " ".join(torchrun)])
            + ' \\\n  || echo "kuangchao: warning: the node probe failed (exit $?); see probe-<node>.out"',
        ]
    lines += [
        "# 2. which node hosts which ranks (kuangchao_core.sched.rank_placement), written to placement.json",
        f"{python} -m kuangchao_core.sched.slurm.placement --share {share}",
    ]
    return lines


def render_script(
    cfg: Any,
    run_dir: str | Path,
    attempt: int,
    args: list[str],
    port: int,
    python: str = sys.executable,
    exclude: list[str] | tuple[str, ...] = (),
    placement: dict[str, Any] | None = None,
) -> str:
    """The batch script of ``attempt`` (also run as is with ``bash`` inside an allocation: ``#SBATCH`` lines are
    comments there); ``placement`` (``share.json``'s): the probe and placement steps before training."""
    share = slurm_dir(run_dir, attempt) / "share.json"
    launcher = [python, "-m", "kuangchao_core.sched.slurm.node", "--share", shlex.quote(str(share)), "--"]
    lines = [
        "#!/bin/bash",
        f"# Kuangchao job {cfg.task.name}, attempt {attempt}: written by `kc train` (cluster.mode: slurm).",
        "# One task per node: Kuangchao's node launcher starts torchrun for that node's ranks and hands each rank its",
        "# tokens (read from a 0600 file in the run directory; nothing secret is in this script or its environment).",
        *[f"#SBATCH {opt}" for opt in sbatch_options(cfg, run_dir, attempt, exclude)],
        "set -euo pipefail",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "head_addr=$(scontrol show node -o \"$head_node\" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')",
        'echo "kuangchao: job $SLURM_JOB_ID attempt ' + str(attempt) + " on $SLURM_JOB_NODELIST, "
        'rendezvous on $head_node ($head_addr)"',
    ]
    before = [*placement_lines(cfg, run_dir, attempt, placement, python), "# 3. the training"] if placement else []
    srun = " \\\n  ".join(
        [
            _step(run_dir, attempt, "node-%N.out"),
            " ".join(launcher),
            " ".join(torchrun_line(cfg, args, port, attempt, python)),
        ]
    )
    if time_limit.enabled(cfg.cluster.slurm):  # a checkpoint before the time limit: the step waited for under a trap
        lines += time_limit.step_lines(srun, slurm_dir(run_dir, attempt), before)
    else:
        lines += [*before, srun]
    return "\n".join(lines) + "\n"


def sbatch_argv(cfg: Any, script: str | Path, env: dict[str, str] | None = None) -> list[str]:
    """``sbatch --parsable --export=<allow-list> <script>`` (the options are in the script's ``#SBATCH`` lines)."""
    names = exported_names(cfg.cluster.slurm, env)
    return ["sbatch", "--parsable", f"--export={','.join(names) if names else 'NONE'}", str(script)]


def step_env(cfg: Any, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the step run inside an allocation: the allow-list and the allocation's ``SLURM_*``."""
    env = dict(os.environ if env is None else env)
    kept = {name: env[name] for name in exported_names(cfg.cluster.slurm, env)}
    return {**kept, **{k: v for k, v in env.items() if k.startswith("SLURM_")}}


def example_script(cfg: Any, config_path: str | Path, overrides: list[str] = (), python: str = sys.executable) -> str:
    """A batch script that runs ``kc train`` inside its own allocation (``kc slurm script``): the training then
    uses the allocation's nodes through ``srun`` instead of submitting a job of its own."""
    skip = ("--output", "--chdir", "--signal")  # the signal is for a job's own batch script (its trap)
    opts = [o for o in sbatch_options(cfg, "$SLURM_SUBMIT_DIR", 0) if not o.startswith(skip)]
    opts.append("--output=kc-train-%j.out")
    lines = [
        "#!/bin/bash",
        "# `kc train` inside this allocation: cluster.mode slurm then runs on the allocation's nodes (srun), no new job.",
        "# kc train runs where sbatch was run: its runs/, checkpoints and relative paths resolve there.",
        *[f"#SBATCH {opt}" for opt in opts],
        f"#SBATCH --export={','.join(exported_names(cfg.cluster.slurm)) or 'NONE'}",
        "set -euo pipefail",
        " ".join(
            [
                shlex.quote(python),
                "-m kuangchao.cli.main train --config",
                shlex.quote(str(Path(config_path).absolute())),
            ]
            + [f"--set {shlex.quote(o)}" for o in overrides]
        ),
    ]
    return "\n".join(lines) + "\n"
