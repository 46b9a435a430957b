"""L3 parallel strategy: the mesh, data parallel, tensor-parallel layers, pipeline schedules, ZeRO, the
gradient-sync interface and the step's forward/backward.

May import: ``errors``, ``config``, ``hal``, ``comm``; the guard interface ``guard_api`` (beside ``errors``).
"""

from kuangchao_core.parallel.data import DataParallel

__all__ = ["DataParallel"]
