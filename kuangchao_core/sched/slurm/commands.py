"""Slurm's own commands, as a user runs them: ``sbatch --parsable``, ``scontrol show job|node|hostnames``,
``sinfo``, ``scancel``. Slurm's REST API needs a newer Slurm than many sites run, so the CLI is the interface.

Every call gets ``SLURM_CONF`` from ``cluster.slurm.slurm_conf`` when set (:func:`slurm_env`); a command that fails
raises :class:`SlurmRefused` with Slurm's own message.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

from kuangchao_core.errors import KuangchaoError

#: job states after which a job runs no more (``scontrol show job`` / ``squeue`` spellings)
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "REVOKED",
    "SPECIAL_EXIT",
}
#: pending reasons that never resolve by waiting (the job can never run as submitted)
HOPELESS = {
    "BadConstraints",
    "PartitionConfig",
    "PartitionDown",
    "PartitionInactive",
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "InvalidAccount",
    "InvalidQOS",
    "QOSMaxNodePerJobLimit",
    "AccountNotAllowed",
    "ReqNodeNotAvail, UnavailableNodes",
    "NodeDown",
}


#: ``sinfo`` node states (``%t``) a job may be given: the rest are down, drained, failing or in maintenance
USABLE_STATES = {"idle", "mix", "alloc", "comp", "plnd"}


class SlurmRefused(KuangchaoError):
    """Slurm refused or could not run what was asked (the job cannot be scheduled, a command failed): its words."""


def slurm_env(slurm: Any = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for Slurm's commands: ``base`` (default this process's) with ``SLURM_CONF`` from
    ``cluster.slurm.slurm_conf`` when set."""
    env = dict(os.environ if base is None else base)
    conf = getattr(slurm, "slurm_conf", None)
    if conf:
        env["SLURM_CONF"] = os.path.abspath(conf)
    return env


def run(argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 60) -> str:
    """``argv``'s standard output; :class:`SlurmRefused` with its error output when it fails."""
    try:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError as exc:
        raise SlurmRefused(f"{argv[0]} not found: is Slurm's client installed here? ({exc})") from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmRefused(f"{' '.join(argv[:3])} did not answer within {timeout_s:g} s") from exc
    if out.returncode != 0:
        said = (out.stderr.strip() or out.stdout.strip() or f"exit code {out.returncode}").splitlines()
        raise SlurmRefused(f"{' '.join(argv[:2])}: {' '.join(said)[:2000]}")
    return out.stdout


def parse_record(text: str) -> dict[str, str]:
    """``Key=Value Key2=Value …`` (``scontrol show``'s one-record output) as a dict. Values run to the next
    ``Key=``; ``Reason=`` and ``Comment=`` may hold spaces."""
    out: dict[str, str] = {}
    key = None
    for token in text.split():
        name, sep, value = token.partition("=")
        if sep and name and (name[0].isupper() or name[0] == "_") and "/" not in name:
            key = name
            out[key] = value
        elif key is not None:
            out[key] += " " + token
    return out


def submit(argv: list[str], env: dict[str, str]) -> str:
    """Run ``sbatch --parsable …`` and return the job id (``123`` or ``123;cluster``'s ``123``)."""
    return run(argv, env).strip().split(";", 1)[0]


def show_job(job_id: str, env: dict[str, str]) -> dict[str, str] | None:
    """``scontrol show job -d <id>`` as a dict; once the controller has forgotten the job, what ``sacct`` keeps
    (``JobState``, ``Reason``, ``NodeList``); None when neither knows it."""
    try:
        return parse_record(run(["scontrol", "show", "job", "-d", "-o", str(job_id)], env))
    except SlurmRefused as exc:
        if "Invalid job id" not in str(exc):
            raise
    try:
        rows = run(["sacct", "-j", str(job_id), "-X", "-n", "-P", "-o", "State,Reason,NodeList"], env).splitlines()
    except SlurmRefused:
        return None
    if not rows or rows[0].count("|") != 2:
        return None
    state, reason, nodes = rows[0].split("|")
    return {"JobState": state.split()[0], "Reason": reason, "NodeList": nodes}


def hostnames(nodelist: str, env: dict[str, str]) -> list[str]:
    """``n[1-3]`` → ``["n1", "n2", "n3"]`` (``scontrol show hostnames``)."""
    if not nodelist or nodelist in ("(null)", "None"):
        return []
    return run(["scontrol", "show", "hostnames", nodelist], env).split()


def node_addr(node: str, env: dict[str, str]) -> str:
    """A node's ``NodeAddr`` as Slurm knows it (not DNS)."""
    return parse_record(run(["scontrol", "show", "node", "-o", node], env)).get("NodeAddr") or node


def node_order(nodes: list[str], env: dict[str, str]) -> list[tuple[str, str]]:
    """``(node, address)`` in the order torchrun's c10d rendezvous ranks them: by the address each node's torchrun
    announces (``--local-addr``, its ``NodeAddr``), as strings."""
    return sorted(((n, node_addr(n, env)) for n in nodes), key=lambda pair: pair[1])


def partition_address(partition: str | None, env: dict[str, str]) -> str | None:
    """The ``NodeAddr`` of a node of ``partition`` (the default one when None): where this machine's route to
    the compute nodes starts."""
    argv = ["sinfo", "-h", "-N", "-o", "%o"] + (["-p", partition] if partition else [])
    try:
        addrs = run(argv, env).split()
    except SlurmRefused:
        return None
    return addrs[0] if addrs else None


def cancel(job_id: str, env: dict[str, str]) -> None:
    """``scancel <id>`` (a job already gone is fine)."""
    try:
        run(["scancel", str(job_id)], env)
    except SlurmRefused:
        pass


def usable_nodes(partition: str | None, env: dict[str, str]) -> list[str]:
    """The nodes of ``partition`` (the default one when None) that a job may be given now: responding, neither
    down nor drained (``sinfo -N``; a ``*`` after the state means not responding)."""
    argv = ["sinfo", "-h", "-N", "-o", "%N %t"] + (["-p", partition] if partition else [])
    out = []
    for line in run(argv, env).splitlines():
        name, _, state = line.strip().partition(" ")
        if name and state.strip() in USABLE_STATES and name not in out:
            out.append(name)
    return out
