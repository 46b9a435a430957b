"""The ``slurm_cluster`` fixture: a real 3-node Slurm cluster on this machine (``tests/cluster/slurm_lab.py``), and
``slurm_tree_cluster``: the same with Slurm's tree topology (leaf switches ``s1: n1, n2`` and ``s2: n3``)."""

from __future__ import annotations

import os

import pytest

from tests.cluster.slurm_lab import SlurmLab, default_topology, slurm_unavailable


def _lab(**kw):
    why = slurm_unavailable()
    if why:
        reason = os.environ.get("KC_SLURM_UNAVAILABLE")
        pytest.skip(f"no Slurm lab here: {why}" + (f" ({reason})" if reason else ""))
    lab = SlurmLab(3, **kw)
    try:
        lab.up()
        yield lab
    finally:
        lab.down()


@pytest.fixture(scope="module")
def slurm_cluster():
    """An up :class:`SlurmLab` of 3 nodes (``n1..n3``, partition ``debug``, ``sacct`` working) for the module;
    removed after it, also when a test or the start failed. Skips only without root or without the Slurm packages
    (``.ci/run`` installs them; ``KC_SLURM_UNAVAILABLE`` carries its reason when it could not)."""
    yield from _lab()


@pytest.fixture(scope="module")
def slurm_tree_cluster():
    """As ``slurm_cluster``, with Slurm's tree topology (``topology/tree``): leaf switches ``s1: n1, n2`` and
    ``s2: n3`` under the spine ``s0``. (Not the default lab: the tree changes where Slurm puts small jobs — a
    1-node job goes to ``n3``, the leaf with the fewest free nodes.)"""
    yield from _lab(topology=default_topology(["n1", "n2", "n3"]))
