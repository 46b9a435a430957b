"""``JobSteps``: the Prefect tasks the job's phases call, handed in by the flow.

The phases (:mod:`kuangchao_core.job.prepare`, :mod:`~kuangchao_core.job.attempts`,
:mod:`~kuangchao_core.job.finish`) live in the core, which never imports ``tasks``; the flow passes its tasks in,
so each still runs as its own Prefect task run (name, retries, caching, result) in the flow run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JobSteps:
    """One callable per step of the job, each normally a Prefect task of ``tasks/`` (same signature)."""

    restore_checkpoint: Callable[..., dict[str, Any]]
    doctor: Callable[..., Any]
    probe_topology: Callable[..., Any]
    start_cluster_probe: Callable[..., Any]
    validate_data: Callable[..., Any]
    place_attempt: Callable[..., dict[str, Any]]
    issue_tokens: Callable[..., dict[str, str]]
    launch: Callable[..., dict[str, Any]]
    recover: Callable[..., dict[str, Any]]
    checkpoint: Callable[..., dict[str, Any]]
    export_and_register: Callable[..., dict[str, Any]]
