"""A Slurm time limit close to running out: checkpoint first, then stop (issue 32 §3).

With ``cluster.slurm.checkpoint_before_limit_s`` (0: off) the job is submitted with ``--signal=B:USR1@<seconds>``:
Slurm signals the batch shell that many seconds before the limit (up to a minute earlier: its timer is coarse).
The batch script runs its ``srun`` step in the background and ``wait``\\s (bash runs a trap only when ``wait``
returns); the trap creates the attempt's stop file (:data:`STOP_FILE`), then the script waits for the step again.
Rank 0 looks for that file at every log boundary and tells the others over the broadcast they already share there
(:mod:`kuangchao_core.engine.live_config`): every rank checkpoints the same step and stops, and rank 0 writes
``<stop file>.step``. The orchestrator then ends the run with :class:`TimeLimitReached` (not retried): the job
reached its time limit after checkpointing step S; ``kc train --resume auto`` continues from it.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from kuangchao_core.sched.slurm.commands import SlurmRefused

#: created by the batch script's trap in ``attempt_<n>/slurm/``
STOP_FILE = "time_limit_near"
#: the ranks' variable naming a file whose appearance asks them to checkpoint and stop (read by the engine)
ENV_STOP_FILE = "KC_STOP_FILE"
#: the signal Slurm sends the batch shell
SIGNAL = "USR1"


class TimeLimitReached(SlurmRefused):
    """The job's time limit came close: every rank checkpointed the same step and stopped (not retried)."""


def enabled(slurm: Any) -> bool:
    """Whether the job asks Slurm for the signal before its time limit."""
    return bool(getattr(slurm, "checkpoint_before_limit_s", 0))


def sbatch_options(slurm: Any) -> list[str]:
    """``--signal=B:USR1@<seconds>`` when enabled."""
    return [f"--signal=B:{SIGNAL}@{int(slurm.checkpoint_before_limit_s)}"] if enabled(slurm) else []


def stop_file(out: Path) -> Path:
    """The stop file of the attempt whose Slurm directory is ``out``."""
    return Path(out) / STOP_FILE


def worker_env(slurm: Any, out: Path) -> dict[str, str]:
    """What the ranks of the attempt whose Slurm directory is ``out`` get to follow the stop file (nothing when
    disabled)."""
    return {ENV_STOP_FILE: str(stop_file(out))} if enabled(slurm) else {}


def step_lines(step: str, out: Path, before: list[str] = ()) -> list[str]:
    """The batch script's step under the trap: ``step`` (the srun line) in the background, waited for until it
    ended (again after the trap ran), its exit code the script's; ``before``: lines run under the trap first (the
    probe and placement steps: a signal meanwhile marks the stop file, the training stops after its first step)."""
    flag = shlex.quote(str(stop_file(out)))
    say = f"kuangchao: job $SLURM_JOB_ID near its time limit: the ranks checkpoint and stop ({SIGNAL})"
    return [
        "near_limit=0",
        f"trap 'near_limit=1; date -u +%Y-%m-%dT%H:%M:%SZ > {flag}; echo \"{say}\"' {SIGNAL}",
        *before,
        step + " &",
        "step_pid=$!",
        'rc=0; wait "$step_pid" || rc=$?',
        'if [ "$near_limit" = 1 ]; then rc=0; wait "$step_pid" || rc=$?; fi  # the trap ended the first wait',
        'exit "$rc"',
    ]


def stopped_step(out: Path) -> int | None:
    """The step the ranks checkpointed and stopped at after the signal (None: they were not asked, or did not)."""
    try:
        return int(json.loads(Path(f"{stop_file(out)}.step").read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def raise_if_stopped(out: Path, job_id: str, slurm: Any) -> None:
    """:class:`TimeLimitReached` when the ranks stopped at the signal."""
    step = stopped_step(out)
    if step is not None:
        raise TimeLimitReached(
            f"Slurm job {job_id} reached its time limit after checkpointing at step {step} (signalled "
            f"{slurm.checkpoint_before_limit_s} s before the limit, cluster.slurm.checkpoint_before_limit_s); "
            "continue it with kc train --resume auto"
        )
