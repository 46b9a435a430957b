"""Kuangchao core engine: the six layers (hal, comm, parallel, sched, perm, config/UI support).

Citations in the code — ``SPEC L2.5``, ``(SPEC L1.1, L1.4)``, ``OPS.4``, ``issue 26 §5`` — name sections of
``docs/architecture.md`` ("Requirement map", "Issue map"); ``tests/test_citations.py`` keeps every one resolvable.
"""

__version__ = "0.1.0"
