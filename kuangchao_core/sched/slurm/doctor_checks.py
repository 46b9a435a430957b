"""``kc doctor``'s checks of the Slurm path (issue 32 §7), one :class:`Check` each, in the order a job needs them:

- ``slurm_commands``: Slurm's client commands are on ``PATH`` (``sbatch``, ``srun``, ``squeue``, ``scontrol``,
  ``sacct``, ``scancel``, ``sinfo``);
- ``slurm_controller``: ``scontrol ping`` says the controller of the ``slurm.conf`` in use (``cluster.slurm.
  slurm_conf``, else ``SLURM_CONF`` or the machine's) is UP, within :data:`CONTROLLER_TIMEOUT_S`;
- ``slurm_partition``: ``cluster.slurm.partition`` (else the default partition) exists and is UP;
- ``slurm_nodes``: how many of its nodes are idle against ``cluster.slurm.nodes``, and Slurm's own estimate of the
  job's start (``sbatch --test-only`` with the job's request: nodes, partition, account, qos, time …), or Slurm's
  reason when it would refuse the job. A wait is not a failure: the report says how long;
- ``slurm_node_facts``: the partition's nodes as Slurm describes them (idle ones by CPUs and GPUs, the others by
  state; :mod:`.facts`) and its tree topology's leaf switches; with ``cluster.slurm.switches``, whether enough idle
  nodes sit under that many leaf switches now (else the job waits up to ``switches_wait`` for them). Asking for
  switches of a cluster without a tree topology fails: Slurm would ignore the request.

A check that fails stops the later ones (they need what it checks); its ``fix`` says what to do. Nothing is
submitted: ``--test-only`` asks the scheduler without queueing a job.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from datetime import datetime
from pathlib import Path
from typing import Any

from kuangchao_core.config.access import setting
from kuangchao_core.sched.doctor_report import Check
from kuangchao_core.sched.slurm import facts
from kuangchao_core.sched.slurm.commands import SlurmRefused, parse_record, slurm_env
from kuangchao_core.sched.slurm.script import request_options

#: the client commands the Slurm path runs
COMMANDS = ("sbatch", "srun", "squeue", "scontrol", "sacct", "scancel", "sinfo")
#: how long a Slurm command may take before the controller counts as not answering
CONTROLLER_TIMEOUT_S = 15.0
_DEFAULT_CONF = "/etc/slurm/slurm.conf"
_START = re.compile(r"to start at (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?: using .* on nodes (\S+))?")


class _Settings:
    """``cluster.slurm``'s fields with their defaults where the config has none (``kc doctor --slurm``)."""

    partition = account = qos = constraint = time_limit = slurm_conf = switches = switches_wait = None
    nodes, gpus_per_node, exclusive, extra_sbatch_args = 1, 0, False, ()

    def __init__(self, section: Any):
        for name in dir(self):
            if not name.startswith("_") and section is not None and hasattr(section, name):
                setattr(self, name, getattr(section, name))


def _call(argv: list[str], env: dict[str, str], timeout_s: float = CONTROLLER_TIMEOUT_S) -> tuple[int, str]:
    """``argv``'s exit code and its output (stdout then stderr, stripped); -1 with a sentence when it hangs."""
    try:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return -1, f"`{' '.join(argv)}` did not answer within {timeout_s:g} s"
    except OSError as exc:
        return -1, f"`{argv[0]}` could not run: {exc}"
    return out.returncode, " ".join((out.stdout.strip() + "\n" + out.stderr.strip()).split())


def _conf_path(env: dict[str, str]) -> str:
    return env.get("SLURM_CONF") or _DEFAULT_CONF


def controller_of(conf: str) -> str:
    """``host (address):port`` of the primary controller a ``slurm.conf`` names (what a failing check names)."""
    try:
        text = Path(conf).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "the controller"
    found = dict(re.findall(r"^\s*(SlurmctldHost|ControlMachine|SlurmctldPort)\s*=\s*(\S+)", text, re.M | re.I))
    found = {k.lower(): v for k, v in found.items()}
    host = found.get("slurmctldhost") or found.get("controlmachine") or "?"
    return f"{host}:{found.get('slurmctldport', '6817')}"


def check_commands() -> Check:
    """Slurm's client commands are on ``PATH``."""
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return Check(
            "slurm_commands",
            False,
            f"not on PATH: {', '.join(missing)}",
            "run kc from a login node of the cluster, or install Slurm's client commands "
            "(Debian/Ubuntu: apt-get install slurm-client) with the site's slurm.conf",
        )
    where = sorted({str(Path(shutil.which(c)).parent) for c in COMMANDS})
    return Check("slurm_commands", True, f"{', '.join(COMMANDS)} in {', '.join(where)}")


def check_controller(env: dict[str, str], timeout_s: float = CONTROLLER_TIMEOUT_S) -> Check:
    """``scontrol ping`` reaches the controller of the ``slurm.conf`` in ``env`` within ``timeout_s``."""
    conf = _conf_path(env)
    if not Path(conf).is_file():
        return Check(
            "slurm_controller",
            False,
            f"no slurm.conf at {conf}",
            "set cluster.slurm.slurm_conf (or SLURM_CONF) to the cluster's slurm.conf",
        )
    rc, said = _call(["scontrol", "ping"], env, timeout_s)
    if rc == 0 and " is UP" in said:
        return Check("slurm_controller", True, f"{said.split(' is UP')[0]} is UP ({conf})")
    where = controller_of(conf)
    said = " ".join(re.sub(r"\*{3,}|\*\*", " ", said).split())  # scontrol's banner around "RESTORE SLURMCTLD …"
    return Check(
        "slurm_controller",
        False,
        f"the Slurm controller {where} (from {conf}) does not answer: {said[:300]}",
        f"check that slurmctld runs on {where.rsplit(':', 1)[0]} and that its port {where.rsplit(':', 1)[1]} is "
        "reachable from here, and that the slurm.conf (cluster.slurm.slurm_conf / SLURM_CONF) is the cluster's",
    )


def _partitions(env: dict[str, str]) -> list[dict[str, str]]:
    """Every partition as ``scontrol show partition -o`` says it (one line each)."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "partition", "-o"],
            env=env,
            capture_output=True,
            text=True,
            timeout=CONTROLLER_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [parse_record(line) for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def check_partition(name: str | None, env: dict[str, str]) -> tuple[Check, dict[str, str] | None]:
    """The partition (``name``, else the default one) exists and is UP; the check and its ``scontrol`` record."""
    parts = _partitions(env)
    names = ", ".join(p.get("PartitionName", "?") for p in parts) or "none"
    if name is None:
        chosen = next((p for p in parts if p.get("Default") == "YES"), None)
        if chosen is None:
            return Check(
                "slurm_partition",
                False,
                f"cluster.slurm.partition is unset and the cluster has no default partition (partitions: {names})",
                f"set cluster.slurm.partition to one of: {names}",
            ), None
    else:
        chosen = next((p for p in parts if p.get("PartitionName") == name), None)
        if chosen is None:
            return Check(
                "slurm_partition",
                False,
                f"partition {name} (cluster.slurm.partition) not found; partitions here: {names}",
                f"set cluster.slurm.partition to one of: {names}",
            ), None
    label = chosen["PartitionName"] + ("" if name else " (the default)")
    state = chosen.get("State", "?")
    if state != "UP":
        return Check(
            "slurm_partition",
            False,
            f"partition {label} is {state}: Slurm starts no job in it",
            f"choose another partition (cluster.slurm.partition; here: {names}) or ask the cluster's admins",
        ), None
    detail = f"partition {label} is UP: {chosen.get('TotalNodes', '?')} nodes ({chosen.get('Nodes', '?')})"
    return Check("slurm_partition", True, f"{detail}, time limit {chosen.get('MaxTime', '?')}"), chosen


def _wait_text(start: str) -> str:
    try:
        seconds = (datetime.fromisoformat(start) - datetime.now()).total_seconds()
    except ValueError:
        return start
    if seconds < 60:
        return "at once"
    return f"at {start} (in about {seconds / 60:.0f} min)" if seconds < 5400 else f"at {start}"


def check_nodes(slurm: _Settings, partition: dict[str, str], env: dict[str, str]) -> Check:
    """Idle nodes of the partition against ``cluster.slurm.nodes``, and Slurm's estimate of the job's start
    (``sbatch --test-only``), or its reason for refusing the job."""
    name = partition["PartitionName"]
    rc, said = _call(["sinfo", "-h", "-N", "-p", name, "-t", "idle", "-o", "%N"], env)
    idle = sorted(set(said.split())) if rc == 0 else []
    have = f"{len(idle)} of {partition.get('TotalNodes', '?')} nodes of {name} idle, {slurm.nodes} asked"
    argv = ["sbatch", "--test-only", f"--nodes={slurm.nodes}", "--ntasks-per-node=1", "--export=NONE"]
    argv += [*request_options(slurm), "--wrap=true"]
    rc, said = _call(argv, env)
    if rc != 0:
        total = partition.get("TotalNodes", "?")
        fix = f"change cluster.slurm until `{' '.join(argv)}` is accepted"
        if total.isdigit() and slurm.nodes > int(total):
            fix = f"ask for at most {total} nodes (cluster.slurm.nodes) or a partition with more (`sinfo -s`); " + fix
        return Check("slurm_nodes", False, f"Slurm would refuse the job ({have}): {said[:400]}", fix)
    found = _START.search(said)
    if found is None:
        return Check("slurm_nodes", True, f"{have}; Slurm accepts the job: {said[:300]}")
    on = f" on {found.group(2)}" if found.group(2) else ""
    return Check("slurm_nodes", True, f"{have}; Slurm expects to start the job {_wait_text(found.group(1))}{on}")


def check_facts(slurm: _Settings, partition: dict[str, str], env: dict[str, str]) -> Check:
    """The partition's node facts and leaf switches; with ``switches`` asked, whether ``nodes`` idle nodes sit
    under that many leaf switches now."""
    name = partition["PartitionName"]
    try:
        topo = facts.read_topology(env)
        nodes = facts.read_nodes(env, partition=name, topology=topo)
    except SlurmRefused as exc:
        return Check("slurm_node_facts", False, f"cannot read the nodes of {name}: {exc}", "check `scontrol show node`")
    detail = f"{name}: {facts.summary(nodes)}"
    idle = facts.idle_by_switch(nodes)
    leaves = sorted({n.switch for n in nodes if n.switch})
    if leaves:
        detail += f"; tree topology, {len(leaves)} leaf switches: " + ", ".join(
            f"{sw} ({len(idle.get(sw, []))} idle)" for sw in leaves
        )
    else:
        detail += "; no tree topology"
    if not slurm.switches:
        return Check("slurm_node_facts", True, detail)
    asked = f"{slurm.nodes} nodes under {slurm.switches} leaf switch(es) (cluster.slurm.switches)"
    if not leaves:
        return Check(
            "slurm_node_facts",
            False,
            f"{detail}: {asked} asked, but Slurm has no tree topology here and would ignore --switches",
            "unset cluster.slurm.switches, or ask the cluster's admins for TopologyPlugin=topology/tree and a "
            "topology.conf",
        )
    fits, best = facts.switch_fit(nodes, slurm.nodes, slurm.switches)
    if fits:
        return Check("slurm_node_facts", True, f"{detail}; {asked}: idle now under {', '.join(best)}")
    wait = slurm.switches_wait or "Slurm's default wait (MaxSwitchWait)"
    return Check(
        "slurm_node_facts",
        True,
        f"{detail}; {asked}: not idle now (at most {sum(len(idle[sw]) for sw in best)} under {', '.join(best) or '-'})"
        f": the job waits up to {wait} for them, then Slurm places it on any switches",
    )


def slurm_checks(cfg: Any) -> list[Check]:
    """Every Slurm check for ``cfg`` (``cluster.slurm``'s settings; defaults when it has none), stopping at the
    first failure (the later checks need what it checks)."""
    slurm = _Settings(setting(cfg, "cluster.slurm", None))
    env = slurm_env(slurm)
    checks = [check_commands()]
    if checks[-1].ok:
        checks.append(check_controller(env))
    if checks[-1].ok:
        partition_check, partition = check_partition(slurm.partition, env)
        checks.append(partition_check)
        if partition is not None:
            checks.append(check_nodes(slurm, partition, env))
            checks.append(check_facts(slurm, partition, env))
    return checks
