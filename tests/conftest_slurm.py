"""The ``slurm_cluster`` fixture: a real 3-node Slurm cluster on this machine (``tests/cluster/slurm_lab.py``)."""

from __future__ import annotations

import os

import pytest

from tests.cluster.slurm_lab import SlurmLab, slurm_unavailable


@pytest.fixture(scope="module")
def slurm_cluster():
    """An up :class:`SlurmLab` of 3 nodes (``n1..n3``, partition ``debug``, ``sacct`` working) for the module;
    removed after it, also when a test or the start failed. Skips only without root or without the Slurm packages
    (``.ci/run`` installs them; ``KC_SLURM_UNAVAILABLE`` carries its reason when it could not)."""
    why = slurm_unavailable()
    if why:
        reason = os.environ.get("KC_SLURM_UNAVAILABLE")
        pytest.skip(f"no Slurm lab here: {why}" + (f" ({reason})" if reason else ""))
    lab = SlurmLab(3)
    try:
        lab.up()
        yield lab
    finally:
        lab.down()
