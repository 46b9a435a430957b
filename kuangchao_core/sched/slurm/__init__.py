"""Slurm as the engine of multi-node jobs (issue 32): ``cluster.mode: slurm``.

:mod:`.commands` (Slurm's CLI), :mod:`.script` (the batch script and the sbatch line), :mod:`.job` (the
orchestrator's side of an attempt), :mod:`.node` (one node's task: its ranks under torchrun, tokens over the
lifeline).
"""
