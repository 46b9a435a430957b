"""``build_dataset``: the job's ``data`` section -> a :class:`TokenDataset` of packed windows held in memory."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch

from kuangchao_core import guard_api
from kuangchao_core.config.access import setting
from kuangchao_core.data.cache import cached_corpus, cached_sft
from kuangchao_core.data.files import read_documents
from kuangchao_core.data.packing import document_window, num_windows, pack_documents_with_starts, window
from kuangchao_core.data.sft import SFTDataset, SFTReport, build_examples, build_sft_dataset
from kuangchao_core.data.synthetic import make_corpus
from kuangchao_core.data.tokenizer import get_tokenizer, vocab_padding_note
from kuangchao_core.errors import DataError

log = logging.getLogger("kuangchao.data")

_SYNTHETIC_DEFAULTS = {"task": "arithmetic", "num_train": 20000, "num_eval": 500, "seed": 1234, "instructions": False}


class TokenDataset:
    """Fixed-length windows over one in-memory token stream (see :mod:`kuangchao_core.data.packing`); with document
    ``starts`` each window also carries segment and position ids (``data.packing: documents``).

    ``corpus`` is the :class:`~kuangchao_core.data.synthetic.ArithmeticCorpus` for the synthetic corpus, else None.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, name: str, tokenizer, corpus=None, starts=None):
        if seq_len < 1:
            raise DataError(f"data.seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.name = name
        self.tokenizer = tokenizer
        self.corpus = corpus
        self.starts = starts  # document starts: windows keep documents apart (data.packing documents)
        self._starts_unique: np.ndarray | None = None  # sorted, without repeats (labelled_tokens)
        self._n = num_windows(tokens.numel(), self.seq_len)
        if self._n == 0:
            raise DataError(
                f"dataset {name!r} has {tokens.numel()} tokens, fewer than one window of data.seq_len + 1 = "
                f"{self.seq_len + 1}; add data or lower data.seq_len"
            )

    @property
    def num_tokens(self) -> int:
        """Tokens in the packed stream."""
        return int(self.tokens.numel())

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -self._n <= index < self._n:
            raise IndexError(f"window {index} out of range for {self._n} windows")
        if self.starts is not None:
            return document_window(self.tokens, self.starts, index % self._n, self.seq_len)
        return window(self.tokens, index % self._n, self.seq_len)

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The windows of ``indices`` stacked, as ``torch.stack`` of the items would give them; without document
        starts in one gather of the rows (the prefetch thread's per-step work, issue 39)."""
        if self.starts is not None or not indices:
            items = [self[i] for i in indices]
            return {key: torch.stack([it[key] for it in items]) for key in items[0]}
        for i in indices:
            if not -self._n <= i < self._n:
                raise IndexError(f"window {i} out of range for {self._n} windows")
        rows = torch.as_tensor(indices, dtype=torch.long) % self._n
        chunk = self.tokens[rows[:, None] * self.seq_len + torch.arange(self.seq_len + 1)].long()
        return {"input_ids": chunk[:, :-1], "labels": chunk[:, 1:]}

    def labelled_tokens(self, indices: list[int]) -> int:
        """The labelled tokens (labels not -100) of the windows ``indices``, from the document starts alone: a
        window's label ``j`` is masked where a document starts at its token ``j + 1``."""
        if self.starts is None:
            return len(indices) * self.seq_len
        if self._starts_unique is None:
            self._starts_unique = np.unique(np.asarray(self.starts, dtype=np.int64))
        starts = self._starts_unique
        lo = (np.asarray(indices, dtype=np.int64) % self._n) * self.seq_len
        inside = np.searchsorted(starts, lo + self.seq_len, side="right") - np.searchsorted(starts, lo, side="right")
        return int(len(indices) * self.seq_len - inside.sum())


def synthetic_settings(data_cfg: Any) -> dict[str, Any]:
    """``task``, ``num_train``, ``num_eval`` and ``seed`` of the synthetic corpus (defaults where unset): the one
    reading of them, shared by training and data validation."""
    syn = setting(data_cfg, "synthetic")
    return {k: setting(syn, k, v) for k, v in _SYNTHETIC_DEFAULTS.items()}


def dataset_name(data_cfg: Any) -> str:
    """The name used in the ``dataset:<name>`` permission resource: ``synthetic`` or the configured path."""
    path = setting(data_cfg, "path")
    if path is None or setting(data_cfg, "format", "auto") == "synthetic":
        return "synthetic"
    return str(path)


def _process_rank() -> int:
    """This process's rank: in the default process group when there is one, else ``RANK`` (0 when unset)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def _with_path(data_cfg: Any, path: str) -> Any:
    """The data section with ``path`` replaced (a pydantic section or a plain dict)."""
    if hasattr(data_cfg, "model_copy"):
        return data_cfg.model_copy(update={"path": path})
    return {**data_cfg, "path": path}


def build_dataset(data_cfg: Any, vocab_size: int, split: str = "train") -> TokenDataset | SFTDataset:
    """Open the dataset the ``data`` section describes (object or dict) and pack it into windows of ``seq_len``.

    ``path`` None or ``format: synthetic`` -> the synthetic corpus (``split`` ``train`` or ``eval``, the held-out
    problems); else user files (``split="eval"`` reads ``eval_path`` the same way): text packed into windows, or
    ``format: sft`` instruction records (:mod:`kuangchao_core.data.sft`). Checks ``dataset_read`` on ``dataset:<name>`` once, as the
    process's data loader module when it has one (``guard_api.guard_for("data_loader")``).

    A ``vocab_size`` larger than the tokenizer's is said once per job: a warning on rank 0 when the ``train`` split
    is built (:func:`~kuangchao_core.data.tokenizer.vocab_padding_note`).
    """
    name = dataset_name(data_cfg)
    guard_api.check_as("data_loader", "dataset_read", f"dataset:{name}")  # the rank's data loader token
    seq_len = int(setting(data_cfg, "seq_len", 0))
    tokenizer = get_tokenizer(setting(data_cfg, "tokenizer", "byte"), vocab_size)
    note = vocab_padding_note(tokenizer, vocab_size) if split == "train" else None
    if note is not None and _process_rank() == 0:
        fields = {"model_vocab_size": int(vocab_size), "tokenizer_vocab_size": tokenizer.vocab_size}
        log.warning(note, extra={"fields": fields})
    corpus = None
    if name == "synthetic":
        s = synthetic_settings(data_cfg)
        corpus = make_corpus(s["task"], int(s["num_train"]), int(s["num_eval"]), int(s["seed"]), tokenizer)
        label = f"synthetic:{s['task']}:{split}"
        if s["instructions"]:
            packing = setting(data_cfg, "packing", "auto")
            records = ((r, f"{label}:{i + 1}") for i, r in enumerate(corpus.records(split)))
            examples, report = build_examples(records, tokenizer, seq_len, setting(data_cfg, "truncation", "drop"))
            ds = SFTDataset.from_examples(
                examples, seq_len, "none" if packing == "auto" else packing, label, tokenizer, report
            )
            ds.examples = list(examples) if split == "eval" else None
            return ds
        docs = corpus.documents(split)
    else:
        if split not in ("train", "eval"):
            raise DataError(f"dataset {name!r}: unknown split {split!r}; use 'train' or 'eval'")
        if split == "eval":
            eval_path = setting(data_cfg, "eval_path")
            if not eval_path:
                raise DataError(f"dataset {name!r} has no held-out data: set data.eval_path")
            data_cfg = _with_path(data_cfg, str(eval_path))
            name = str(eval_path)
        packing = setting(data_cfg, "packing", "auto")
        cache_dir = setting(data_cfg, "cache_dir")
        if setting(data_cfg, "format", "auto") == "sft":
            return _sft_dataset(data_cfg, name, tokenizer, vocab_size, "none" if packing == "auto" else packing, split)
        if packing == "none":
            raise DataError("data.packing none applies to sft data (data.format sft); text is packed with concat")
        if cache_dir:
            tokens, starts, meta = cached_corpus(data_cfg, tokenizer, vocab_size, str(cache_dir))
            log.info(
                "data %s: %s tokens cache %s (%s)",
                name,
                "built" if meta["built"] else "read from",
                meta["key"],
                f"{meta['num_tokens']:,} tokens, {meta['num_documents']:,} documents",
            )
            return TokenDataset(tokens, seq_len, name, tokenizer, None, starts if packing == "documents" else None)
        docs = read_documents(
            setting(data_cfg, "path"),
            setting(data_cfg, "format", "auto"),
            setting(data_cfg, "text_field", "text"),
            txt_documents=setting(data_cfg, "txt_documents", "file"),
        )
        label = name
    tokens, starts = pack_documents_with_starts(docs, tokenizer, vocab_size)
    keep_apart = setting(data_cfg, "packing", "auto") == "documents"
    return TokenDataset(tokens, seq_len, label, tokenizer, corpus, starts if keep_apart else None)


def _sft_dataset(data_cfg: Any, name: str, tokenizer, vocab_size: int, packing: str, split: str) -> SFTDataset:
    """Instruction records as an :class:`SFTDataset`, through the data cache when ``cache_dir`` is set."""
    seq_len, truncation = int(setting(data_cfg, "seq_len", 0)), setting(data_cfg, "truncation", "drop")
    cache_dir = setting(data_cfg, "cache_dir")
    if not cache_dir:
        ds = build_sft_dataset(name, tokenizer, seq_len, packing, truncation, keep_examples=split == "eval")
        log.info("sft data %s: %s", name, ds.report.to_dict())
        return ds
    arrays, meta = cached_sft(data_cfg, tokenizer, vocab_size, str(cache_dir))
    counts = dict(meta["report"])
    first_dropped = counts.pop("first_dropped", [])
    report = SFTReport(**counts, where_dropped=list(first_dropped))
    ds = SFTDataset(
        torch.from_numpy(arrays["ids"]),
        torch.from_numpy(arrays["trained"]),
        arrays["starts"],
        seq_len,
        packing,
        name,
        tokenizer,
        report,
    )
    if split == "eval":
        ds.examples = [ds.example(i) for i in range(len(arrays["starts"]))]
    log.info(
        "sft data %s: examples %s cache %s: %s",
        name,
        "built into" if meta["built"] else "read from",
        meta["key"],
        report.to_dict(),
    )
    return ds
