"""What ``cluster.slurm`` may hand to Slurm: sbatch options the Slurm path sets itself, and environment variable
names that look like credentials (Slurm stores a job's script and exported environment where others may read them).

- :func:`reserved_option` says which reserved sbatch option an ``extra_sbatch_args`` item is, as sbatch's
  ``getopt_long`` reads it: a long option by its name or any prefix of it (``--get-user=`` is ``--get-user-env``;
  a prefix shared by several options is ambiguous and sbatch refuses it anyway), a short option also inside a group
  of flags (``-HN2`` is ``-H -N 2``).
- :func:`looks_secret` says whether an ``export_env`` name looks like a credential: ``*_TOKEN``, ``*_KEY``,
  ``*SECRET*``, ``*PASSWORD*``/``*PASSWD*``, ``*CREDENTIAL*`` or one of :data:`KNOWN_SECRETS`.
"""

from __future__ import annotations

import re

#: sbatch long options the Slurm path sets itself (the environment, the script, the node layout)
RESERVED_LONG = ("--export", "--wrap", "--nodes", "--ntasks-per-node", "--parsable", "--get-user-env")
#: their short forms
RESERVED_SHORT = {"N": "--nodes"}
#: sbatch options that are themselves a prefix of a reserved one: an exact name wins over a prefix in getopt_long
EXACT_UNRESERVED = ("--ntasks",)
#: sbatch's short options that take no argument (a group such as ``-HQ`` goes on to the next letter after these)
SHORT_FLAGS = set("hHIOQsuvVW")

#: credentials known by name (the tracking store, Prefect, the Hub, the clouds)
KNOWN_SECRETS = frozenset(
    {
        "PREFECT_API_KEY",
        "MLFLOW_TRACKING_TOKEN",
        "MLFLOW_TRACKING_PASSWORD",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_ACCESS_KEY_ID",
        "WANDB_API_KEY",
        "GITHUB_TOKEN",
    }
)
_SECRET_NAME = re.compile(r"(^|_)(TOKEN|KEY)$|SECRET|PASSWORD|PASSWD|CREDENTIAL")


def looks_secret(name: str) -> bool:
    """Whether environment variable ``name`` looks like it holds a credential (module docstring)."""
    upper = name.upper()
    return upper in KNOWN_SECRETS or bool(_SECRET_NAME.search(upper))


def reserved_option(arg: str) -> str | None:
    """The reserved sbatch option that ``arg`` (one ``extra_sbatch_args`` item) sets, or None."""
    if arg.startswith("--"):
        name = arg.split("=", 1)[0]
        if name in EXACT_UNRESERVED:
            return None
        stem = name[2:]
        hits = [opt for opt in RESERVED_LONG if stem and opt[2:].startswith(stem)]
        return " or ".join(hits) or None
    for letter in arg[1:]:
        if letter in RESERVED_SHORT:
            return f"-{letter} ({RESERVED_SHORT[letter]})"
        if letter not in SHORT_FLAGS:  # an option taking a value: the rest of the item is that value
            return None
    return None


def export_env_errors(slurm: object) -> list[tuple[str, str]]:
    """``(dotted_path, message)`` for each ``cluster.slurm.export_env`` name that looks like a credential and that
    ``export_env_allow_secrets`` does not list, and each allowed name that ``export_env`` does not export."""
    names = list(getattr(slurm, "export_env", []))
    allowed = list(getattr(slurm, "export_env_allow_secrets", []))
    errors = [
        (
            f"cluster.slurm.export_env.{i}",
            f"{name} looks like a credential and Slurm keeps a job's exported environment where others can read it; "
            f"give it to the job another way, or list it in cluster.slurm.export_env_allow_secrets to export it "
            "anyway (warned about at submission)",
        )
        for i, name in enumerate(names)
        if looks_secret(name) and name not in allowed
    ]
    errors += [
        (f"cluster.slurm.export_env_allow_secrets.{i}", f"{name} is not in cluster.slurm.export_env")
        for i, name in enumerate(allowed)
        if name not in names
    ]
    return errors


def exported_secrets(slurm: object) -> list[str]:
    """The ``export_env`` names that look like credentials and are exported because the config allows it."""
    allowed = set(getattr(slurm, "export_env_allow_secrets", []))
    return [name for name in getattr(slurm, "export_env", []) if looks_secret(name) and name in allowed]
