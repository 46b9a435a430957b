"""Following the job's global configuration while it trains (``kc config set``: lr scale, log/checkpoint interval).

Ranks may see the file change at different moments, so only rank 0 reads it (a stat-cached read, no lock), before
the first step of an attempt and then every ``log_interval`` steps, and broadcasts ``[version, lr_scale,
log_interval, checkpoint_interval, stop]`` over the host group (a CPU tensor: host coordination); every rank applies
what it received at the same step. ``stop`` is whether the file named by ``$KC_STOP_FILE`` exists (a Slurm job's
batch script creates it when its time limit is close, issue 32 §3): every rank then checkpoints and stops at that
same step (:attr:`LiveConfig.stop_requested`). There is no per-step collective: one small broadcast every ``log_interval``
steps, and a change waits at most that many steps. Each applied change is logged on every rank and emitted as a ``config_applied`` event by rank 0.

:func:`worker_global_config` is how a worker opens the job's file: verified against the job's trust store, for this
job only, and never older than the newest version the job's audit log records — a worker of a new attempt refuses a
correctly signed older version copied back over the file (a rollback across attempts) and keeps its settings.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kuangchao_core.comm import primitives as P
from kuangchao_core.obs.jsonlog import emit_event, log_event
from kuangchao_core.sched.slurm.time_limit import ENV_STOP_FILE

log = logging.getLogger("kuangchao.engine")


def worker_global_config(process: Any, path: str, env: Mapping[str, str] | None = None) -> Any:
    """The :class:`~kuangchao_core.perm.global_config.GlobalConfig` a worker follows, from its environment ``env``
    (default ``os.environ``): outside trusted mode, verified against the trust store ``KC_TRUST_STORE`` (signed by
    ``KC_TRUST_ROOT``, roles from ``KC_POLICY_FILE``), for job ``KC_JOB_ID`` only, and accepting no version older
    than the newest one the job's audit log (``KC_AUDIT_LOG``, else ``permission.audit_log``) records. ``process``: the worker's :class:`~kuangchao_core.config.settings.ProcessSettings`."""
    from kuangchao_core.perm.global_config import GlobalConfig, newest_recorded_version

    env = os.environ if env is None else env
    trust = None
    if process.permission_mode != "trusted" and env.get("KC_TRUST_STORE"):
        from kuangchao_core.perm.runtime import load_trust

        trust, _ = load_trust(env["KC_TRUST_STORE"], env.get("KC_TRUST_ROOT"), env.get("KC_POLICY_FILE"))
    if trust is None:
        return GlobalConfig(path, process.task)
    audit_log = env.get("KC_AUDIT_LOG") or process.audit_log
    floor = newest_recorded_version(audit_log, process.task) if audit_log else 0
    if floor:
        log_event(log, "global config floor", version=floor, audit_log=str(audit_log))
    return GlobalConfig(path, process.task, trust=trust, job_id=env.get("KC_JOB_ID"), min_version=floor)


@dataclass
class LiveSettings:
    """The settings a running job follows."""

    lr_scale: float
    log_interval: int
    checkpoint_interval: int | None


class LiveConfig:
    """Applies changes of ``global_config`` (a :class:`~kuangchao_core.perm.global_config.GlobalConfig`, or None
    for nothing to follow) to :attr:`settings` at step boundaries every rank agrees on."""

    def __init__(
        self,
        global_config: Any,
        rank: int,
        world_size: int,
        host_group: Any,
        settings: LiveSettings,
        stop_file: str | None = None,
    ):
        """``stop_file``: default ``$KC_STOP_FILE`` (unset: no stop file)."""
        self.global_config = global_config
        self.rank = rank
        self.world_size = world_size
        self.host_group = host_group
        self.settings = settings
        self.stop_file = stop_file if stop_file is not None else os.environ.get(ENV_STOP_FILE) or None
        #: the step at which every rank learnt that ``stop_file`` exists (None: not asked to stop)
        self.stop_requested: int | None = None
        self._version = -1

    def follow(self, step: int, first: bool) -> LiveSettings:
        """Check for a change after ``step`` (always when ``first``: before an attempt's first step); returns the
        settings. After a step (never when ``first``: a checkpoint of the resumed step holds nothing new) it also
        sets :attr:`stop_requested` once the stop file exists."""
        gc = self.global_config
        current = self.settings
        if (gc is None and self.stop_file is None) or (not first and step % current.log_interval):
            return current
        packet = torch.zeros(5, dtype=torch.float64)
        if self.rank == 0 and not first and self.stop_file is not None and os.path.exists(self.stop_file):
            packet[4] = 1
        if self.rank == 0 and gc is None:
            packet[0] = -1
        elif self.rank == 0:
            try:
                snap = gc.snapshot()
                v = snap.values
                packet[:4] = torch.tensor(
                    [snap.version, v.get("lr_scale", 1.0), v.get("log_interval", 0), v.get("checkpoint_interval", 0)],
                    dtype=torch.float64,
                )
            except Exception as exc:  # rank 0 must still join the broadcast; the job keeps its current settings
                packet[0] = -1
                log.warning("global config %s not readable at step %d (%s); settings unchanged", gc.path, step, exc)
        if self.world_size > 1:
            P.broadcast(packet, src=0, group=self.host_group)
        if packet[4] and self.stop_requested is None:
            self.stop_requested = step
            log_event(log, "stop requested", step=step, stop_file=self.stop_file)
        version = int(packet[0])
        if version < 0 or version == self._version:
            return current
        self._version = version
        new = LiveSettings(
            lr_scale=float(packet[1]),
            log_interval=int(packet[2]) or current.log_interval,
            checkpoint_interval=int(packet[3]) or current.checkpoint_interval,
        )
        for key in ("lr_scale", "log_interval", "checkpoint_interval"):
            value, old = getattr(new, key), getattr(current, key)
            if value != old:
                fields = {"version": version, "key": key, "value": value, "old": old, "step": step}
                log_event(log, "global config applied", **fields)
                if self.rank == 0:
                    emit_event("config_applied", **fields)
        self.settings = new
        return new


def acknowledge_stop(stop_file: str, step: int) -> None:
    """Rank 0, once the checkpoint of ``step`` is published: ``<stop_file>.step`` says the ranks stopped there (read
    by the orchestrator: :func:`kuangchao_core.sched.slurm.time_limit.stopped_step`)."""
    import json
    import time
    from pathlib import Path

    done = Path(f"{stop_file}.step")
    tmp = done.with_name(done.name + ".tmp")
    tmp.write_text(json.dumps({"step": step, "at": time.time()}), encoding="utf-8")
    os.replace(tmp, done)
    log_event(log, "stopped on request", step=step, stop_file=stop_file)
    emit_event("stopped", step=step, reason="stop requested")
