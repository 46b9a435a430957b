"""L3 parallelism: data parallel (bucketed, overlapped gradient all-reduce) and, in later issues, TP/PP/ZeRO."""

from kuangchao_core.parallel.data import DataParallel

__all__ = ["DataParallel"]
