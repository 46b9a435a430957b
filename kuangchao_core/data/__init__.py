"""L3 data: datasets, tokenizers, file readers shared with data validation, resumable sampler, prefetching loader.

May import: ``errors``, ``config``; the guard interface ``guard_api`` (beside ``errors``).
"""

from kuangchao_core.data.dataset import TokenDataset, build_dataset, dataset_name
from kuangchao_core.data.loader import PrefetchLoader, collate
from kuangchao_core.data.sampler import ResumableBatchSampler
from kuangchao_core.data.synthetic import ArithmeticCorpus
from kuangchao_core.data.tokenizer import ByteTokenizer, HFTokenizer, get_tokenizer

__all__ = [
    "ArithmeticCorpus",
    "ByteTokenizer",
    "HFTokenizer",
    "PrefetchLoader",
    "ResumableBatchSampler",
    "TokenDataset",
    "build_dataset",
    "collate",
    "dataset_name",
    "get_tokenizer",
]
