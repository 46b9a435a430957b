"""L4 task scheduling: the launcher over torch.distributed.run, heartbeats, recovery, doctor, topology probe.

May import: ``errors``, ``config``, ``hal``, ``comm``, ``obs``; the guard interface ``guard_api`` (beside
``errors``).
"""
