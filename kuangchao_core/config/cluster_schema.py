"""The ``cluster`` section: where a job's workers run, and the Slurm job that runs them (``mode: slurm``)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator

from kuangchao_core.config.section import Float, Int, Section
from kuangchao_core.config.slurm_options import reserved_option

#: what a Slurm name or option value may hold: it is written into ``#SBATCH`` lines, so no spaces or newlines
_SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,:@+=%/\[\]&|!*()-]+$")
#: Slurm's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or UNLIMITED
_SLURM_TIME = re.compile(r"^(UNLIMITED|INFINITE|\d+(-\d+)?(:\d+){0,2})$")


def slurm_time_s(value: str | None) -> int | None:
    """A Slurm time (``_SLURM_TIME``) in seconds; None for unset or unlimited."""
    if not value or not value[0].isdigit():
        return None
    days, _, rest = value.rpartition("-") if "-" in value else ("0", "", value)
    parts = [int(x) for x in rest.split(":")]
    if "-" in value:  # D-HH, D-HH:MM, D-HH:MM:SS
        parts += [0] * (3 - len(parts))
        h, m, sec = parts
    else:  # MM, MM:SS, HH:MM:SS
        h, m, sec = ([0, *parts, 0] if len(parts) == 1 else [0, *parts] if len(parts) == 2 else parts)[:3]
    return ((int(days) * 24 + h) * 60 + m) * 60 + sec


def _word(value: str | None) -> str | None:
    if value is not None and not _SLURM_WORD.match(value):
        raise ValueError(f"{value!r} is not a Slurm name (letters, digits and _.,:@+=%/[]&|!*()- only)")
    return value


def _sbatch_arg(arg: str) -> str:
    """One ``extra_sbatch_args`` item: one option, none that the Slurm path sets itself (by any abbreviation)."""
    if not arg.startswith("-") or arg in ("-", "--") or any(c in arg for c in "\n\r\0"):
        raise ValueError(f"{arg!r} is not one sbatch option (--name=value)")
    reserved = reserved_option(arg)
    if reserved:
        raise ValueError(
            f"{arg.split('=', 1)[0]} is {reserved} as sbatch reads it (a prefix of a long option is that option), "
            "which the Slurm path sets itself (see cluster.slurm's other fields)"
        )
    return arg


def _env_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"{name!r} is not an environment variable name")
    if name.startswith("KC_"):
        raise ValueError(f"{name} holds the job's own settings or tokens; the nodes get those otherwise")
    return name


SbatchArg = Annotated[str, AfterValidator(_sbatch_arg)]
EnvName = Annotated[str, AfterValidator(_env_name)]


class SlurmSection(Section):
    """The Slurm job of ``cluster.mode: slurm`` (``sbatch``; inside an allocation the job's own nodes via ``srun``).

    Unset names (partition, account, qos …) are left to the site's defaults.
    """

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    #: the job's wall-clock limit in a Slurm time format (``30``, ``01:30:00``, ``2-00:00:00``); unset: the partition's
    time_limit: str | None = None
    nodes: Int = Field(default=1, ge=1, le=4096)
    #: ranks (torchrun processes) per node
    tasks_per_node: Int = Field(default=1, ge=1, le=1024)
    #: GPUs asked of every node (``--gpus-per-node``); 0: none asked
    gpus_per_node: Int = Field(default=0, ge=0, le=64)
    constraint: str | None = None
    exclusive: bool = False
    #: further ``sbatch`` options, one per item (``--mem=64G``, ``--reservation=r1``); never secrets: Slurm stores them
    extra_sbatch_args: list[SbatchArg] = Field(default_factory=list, max_length=64)
    #: the ``slurm.conf`` the Slurm commands read (``SLURM_CONF``); unset: the machine's
    slurm_conf: str | None = None
    #: ask for nodes under at most this many leaf switches (``--switches``, Slurm's tree topology)
    switches: Int | None = Field(default=None, ge=1, le=64)
    #: how long the job may wait for ``switches`` (a Slurm time; Slurm caps it at the cluster's ``max_switch_wait``,
    #: 5 minutes unless its admins set more); only with ``switches``
    switches_wait: str | None = None
    #: seconds before the time limit at which Slurm signals the batch script (``--signal=B:USR1@<s>``; Slurm may
    #: signal up to a minute earlier): every rank checkpoints the same step and stops; 0: off
    checkpoint_before_limit_s: Int = Field(default=120, ge=0, le=65535)
    #: names of further environment variables the nodes get from ``kc train``'s (never secrets: Slurm stores them);
    #: a name that looks like a credential (``*_TOKEN``, ``*_KEY``, ``*SECRET*``, ``*PASSWORD*``, ``HF_TOKEN`` …)
    #: is refused unless ``export_env_allow_secrets`` lists it too
    export_env: list[EnvName] = Field(default_factory=list, max_length=64)
    #: names of ``export_env`` that look like credentials and are exported all the same (each one warned about at
    #: submission): Slurm keeps the job's environment where its administrators and accounting can read it
    export_env_allow_secrets: list[EnvName] = Field(default_factory=list, max_length=64)

    @field_validator("partition", "account", "qos", "constraint")
    @classmethod
    def _names(cls, value: str | None) -> str | None:
        return _word(value)

    @field_validator("time_limit", "switches_wait")
    @classmethod
    def _time(cls, value: str | None) -> str | None:
        if value is not None and not _SLURM_TIME.match(value):
            raise ValueError(f"{value!r} is not a Slurm time (minutes, HH:MM:SS, D-HH:MM:SS or UNLIMITED)")
        return value


class NodeSpec(Section):
    """One machine of a static cluster."""

    host: str = Field(min_length=1)
    gpus: Int = Field(default=0, ge=0)
    role: Literal["worker", "parameter_server", "coordinator"] = "worker"


class ClusterSection(Section):
    """Where the workers run: this machine (``local``), a fixed node list (``static``), a registry (``dynamic``) or
    the nodes a Slurm job is granted (``slurm``, settings under ``slurm``).

    Recovery: a failed attempt is restarted at most ``max_restarts`` times; a worker silent for longer than
    ``heartbeat_timeout_s`` (``None``: never) is treated as hung. ``elastic``: when a lost node leaves too few
    nodes for the layout, resume with a smaller data-parallel size (same tp×pp and global batch) instead of failing.
    """

    mode: Literal["local", "static", "dynamic", "slurm"] = "local"
    nodes: list[NodeSpec] = Field(default_factory=list)
    nproc_per_node: Int | None = Field(default=None, ge=1)
    registry: str | None = None
    elastic: bool = False
    placement: Literal["topology", "blind"] = "topology"
    max_restarts: Int = Field(default=2, ge=0, le=1000)
    heartbeat_interval_s: Float = Field(default=1.0, gt=0)
    heartbeat_timeout_s: Float | None = Field(default=60.0, gt=0)
    #: the Slurm job of ``mode: slurm`` (``sbatch``, or ``srun`` inside an allocation): partition, nodes, ranks …
    slurm: SlurmSection | None = None

    @property
    def worker_nodes(self) -> list[NodeSpec]:
        """The nodes that run training processes."""
        return [node for node in self.nodes if node.role == "worker"]

    @property
    def devices(self) -> int | None:
        """Training processes the cluster provides, or None when it does not say."""
        if self.mode == "local":
            return self.nproc_per_node
        if self.mode == "slurm":
            return self.slurm.nodes * self.slurm.tasks_per_node if self.slurm else None
        if self.mode == "static":
            workers = self.worker_nodes
            if self.nproc_per_node is not None:
                return self.nproc_per_node * len(workers)
            return sum(node.gpus for node in workers)
        return None
