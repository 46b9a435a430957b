"""L5 permission: tokens, authority, guard, roles, audit log.

May import: every layer below (``errors``, ``config``, ``hal``, ``comm``, ``parallel``, ``models``, ``data``,
``ckpt``, ``obs``, ``sched``). Lower layers reach it only through ``perm.guard_api``.
"""
