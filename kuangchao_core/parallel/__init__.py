"""L3 parallel strategy: the mesh, data parallel, tensor-parallel layers, pipeline schedules, ZeRO, the
gradient-sync interface and the step's forward/backward.

May import: ``errors``, ``config``, ``hal``, ``comm``; the guard interface ``guard_api`` (beside ``errors``).
Importing the package imports none of its modules: ``state_memory``, which ``kc plan`` and a refused ``kc train``
read, is arithmetic only (the package importing torch through ``data`` cost them 2 s).
"""
