"""The engine: the worker process and its step loop, wiring every layer together (below only
``kuangchao_core.job``, the orchestrator's core).

May import: every ``kuangchao_core`` package except ``job``; never ``tasks``, ``flows``, ``blocks`` or ``kuangchao``.
"""
