"""The engine: the worker process and its step loop, wiring every layer together (top of ``kuangchao_core``).

May import: every ``kuangchao_core`` package; never ``tasks``, ``flows``, ``blocks`` or ``kuangchao``.
"""
