"""L5 permission: tokens, authority, guard, roles, audit log.

May import: every layer below (``errors``, ``config``, ``hal``, ``comm``, ``parallel``, ``models``, ``data``,
``ckpt``, ``obs``, ``sched``), and ``guard_api``. No lower layer imports it: each asks permission through
``kuangchao_core.guard_api`` (beside ``errors``), whose guard this layer installs.
"""
