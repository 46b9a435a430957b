"""Kuangchao public SDK: ``import kuangchao.distributed as kc``."""

from kuangchao_core import __version__

__all__ = ["__version__"]
