"""Data pipeline: synthetic corpus, files, tokenizers, packing, resumable sampler and prefetching loader."""

from __future__ import annotations

import json
import math
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from kuangchao_core.data import (
    ArithmeticCorpus,
    ByteTokenizer,
    HFTokenizer,
    PrefetchLoader,
    ResumableBatchSampler,
    build_dataset,
)
from kuangchao_core.data.files import read_documents
from kuangchao_core.errors import DataError, PermissionDenied
from kuangchao_core.perm import guard_api


@pytest.fixture(autouse=True)
def _allow_all():
    previous = guard_api.install_guard(guard_api.AllowAll())
    yield
    guard_api.install_guard(previous)


SYN = {"seq_len": 32, "synthetic": {"task": "arithmetic", "num_train": 3000, "num_eval": 200, "seed": 11}}


# --- synthetic corpus ---------------------------------------------------------------------------------------------


def test_synthetic_corpus_is_deterministic_and_splits_are_disjoint():
    a, b, c = ArithmeticCorpus(500, 50, 1), ArithmeticCorpus(500, 50, 1), ArithmeticCorpus(500, 50, 2)
    assert a.documents("train") == b.documents("train") and a.documents("eval") == b.documents("eval")
    assert a.documents("train") != c.documents("train")
    assert not set(a.documents("train")) & set(a.documents("eval"))
    assert len(set(a.documents("eval"))) == 50
    for doc in a.documents("train")[:50]:
        lhs, rhs = doc.split("=")
        x, y = lhs.split("+")
        assert int(x) + int(y) == int(rhs) and int(x) < 100 and int(y) < 100
    t1, t2 = build_dataset(SYN, 256), build_dataset(SYN, 256)
    assert torch.equal(t1.tokens, t2.tokens)


def test_loss_floor_equals_the_entropy_of_the_packed_stream():
    corpus = ArithmeticCorpus(20000, 100, 3)
    tok = ByteTokenizer()
    docs = corpus.documents("train")
    num_tokens = sum(len(tok.encode(d)) + 1 for d in docs)
    # each line is one of len(pool) equally likely outcomes: ln(pool) nats per line, spread over its tokens
    empirical = len(docs) * math.log(len(corpus.pool_pairs)) / num_tokens
    floor = corpus.loss_floor()
    assert abs(empirical - floor) / floor < 0.01
    assert 0.8 < floor < 1.3


class _Oracle(nn.Module):
    """Predicts the next byte of ``<sep>a+b=answer<sep>`` from the prompt, optionally off by ``delta``."""

    def __init__(self, delta: int = 0):
        super().__init__()
        self.delta = delta

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(ids.shape[0], ids.shape[1], 256)
        for row in range(ids.shape[0]):
            text = bytes(ids[row].tolist()).decode().split("\n")[-1]
            if "=" not in text:  # this row's answer is complete; decoding keeps feeding it
                logits[row, -1, 10] = 1.0
                continue
            lhs, partial = text.split("=")
            x, y = lhs.split("+")
            answer = str(int(x) + int(y) + self.delta) + "\n"
            logits[row, -1, ord(answer[len(partial)])] = 1.0
        return logits


def test_heldout_accuracy_scores_greedy_decoding():
    corpus = ArithmeticCorpus(100, 40, 4)
    assert corpus.heldout_accuracy(_Oracle(), n=40) == 1.0
    assert corpus.heldout_accuracy(_Oracle(delta=1), n=40) == 0.0


def test_synthetic_dataset_windows_and_eval_split():
    ds = build_dataset(SYN, 256)
    item = ds[3]
    assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (32,)
    assert torch.equal(item["labels"][:-1], item["input_ids"][1:])
    assert torch.equal(ds[4]["input_ids"][0], item["labels"][-1])
    assert len(ds) == (ds.num_tokens - 1) // 32
    text = ByteTokenizer().decode(ds.tokens[:60].tolist())
    assert text.startswith(ds.corpus.documents("train")[0] + "\n")
    ev = build_dataset(SYN, 256, split="eval")
    assert ByteTokenizer().decode(ev.tokens.tolist()).split("\n")[:-1] == ds.corpus.documents("eval")


def test_dataset_read_is_checked_once_by_the_guard():
    calls = []

    class Recording:
        def check(self, interface, resource):
            calls.append((interface, resource))

    guard_api.install_guard(Recording())
    ds = build_dataset(SYN, 256)
    for i in range(5):
        ds[i]
    assert calls == [("dataset_read", "dataset:synthetic")]
    guard_api.install_guard(guard_api.DenyAll())
    with pytest.raises(PermissionDenied):
        build_dataset(SYN, 256)


# --- user files and tokenizers ------------------------------------------------------------------------------------


def test_txt_jsonl_parquet_directory_and_glob(tmp_path):
    (tmp_path / "a.txt").write_text("first doc\nline two\n\n  \nsecond doc\n", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"body": "json one", "id": 1}) + "\n\n" + json.dumps({"body": "json two"}) + "\n"
    )
    pq.write_table(pa.table({"body": ["pq one", "pq two"], "n": [1, 2]}), tmp_path / "c.parquet")
    blank = {"txt_documents": "blank_lines"}  # the rule before issue 39: blank lines separate documents, dropped
    assert list(read_documents(tmp_path / "a.txt", **blank)) == ["first doc\nline two", "second doc"]
    whole = list(read_documents(tmp_path / "a.txt"))  # the default: the file is one document, as written
    assert ["".join(doc) for doc in whole] == ["first doc\nline two\n\n  \nsecond doc\n"]
    assert list(read_documents(tmp_path / "b.jsonl", text_field="body")) == ["json one", "json two"]
    assert list(read_documents(tmp_path / "c.parquet", text_field="body")) == ["pq one", "pq two"]
    (tmp_path / "c.parquet").unlink()
    (tmp_path / "b.jsonl").unlink()
    sub = tmp_path / "more"
    sub.mkdir()
    (sub / "x.txt").write_text("third", encoding="utf-8")
    assert list(read_documents(tmp_path, **blank)) == ["first doc\nline two", "second doc", "third"]
    three = ["first doc\nline two", "second doc", "third"]
    assert list(read_documents(str(tmp_path / "**" / "*.txt"), **blank)) == three
    ds = build_dataset({"path": str(tmp_path), "seq_len": 8, "format": "auto", **blank}, 256)
    assert ByteTokenizer().decode(ds.tokens.tolist()) == "first doc\nline two\nsecond doc\nthird\n"
    ds = build_dataset({"path": str(tmp_path), "seq_len": 8, "format": "auto"}, 256)  # each file as written + sep
    assert ByteTokenizer().decode(ds.tokens.tolist()) == "first doc\nline two\n\n  \nsecond doc\n\nthird\n"
    assert ds.name == str(tmp_path) and ds.corpus is None


def test_file_errors_are_clear(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        build_dataset({"path": str(tmp_path / "missing.txt"), "seq_len": 8}, 256)
    (tmp_path / "d.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:1: no field 'text'"):
        build_dataset({"path": str(tmp_path / "d.jsonl"), "seq_len": 8}, 256)
    (tmp_path / "bad.txt").write_bytes(b"fine text \xff\xfe more")
    with pytest.raises(DataError, match="offset 10"):
        ["".join(doc) for doc in read_documents(tmp_path / "bad.txt")]  # a whole file's pieces decode as read
    with pytest.raises(DataError, match="offset 10"):
        list(read_documents(tmp_path / "bad.txt", txt_documents="blank_lines"))
    pq.write_table(pa.table({"other": ["a"]}), tmp_path / "e.parquet")
    with pytest.raises(DataError, match="no column 'text'"):
        list(read_documents(tmp_path / "e.parquet"))
    (tmp_path / "short.txt").write_text("abc")
    with pytest.raises(DataError, match="fewer than one window"):
        build_dataset({"path": str(tmp_path / "short.txt"), "seq_len": 8}, 256)
    with pytest.raises(DataError, match="no data files"):
        list(read_documents(str(tmp_path / "*.csv")))


def test_local_tokenizers_json(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"])
    texts = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog"] * 20
    tok.train_from_iterator(texts, trainer)
    path = tmp_path / "tok.json"
    tok.save(str(path))

    hf = HFTokenizer(path)
    assert hf.sep_id == tok.token_to_id("<|endoftext|>")
    ids = hf.encode("the cat sat")
    assert len(ids) < len("the cat sat") and hf.decode(ids) == "the cat sat"
    (tmp_path / "docs.txt").write_text("\n\n".join(texts), encoding="utf-8")
    cfg = {"path": str(tmp_path / "docs.txt"), "seq_len": 16, "tokenizer": str(path), "txt_documents": "blank_lines"}
    ds = build_dataset(cfg, hf.vocab_size)
    assert int(ds.tokens.max()) < hf.vocab_size
    assert (ds.tokens == hf.sep_id).sum() == len(texts)
    with pytest.raises(DataError, match="model.vocab_size"):
        build_dataset(cfg, hf.vocab_size - 1)
    with pytest.raises(DataError, match="no tokenizer file"):
        HFTokenizer(tmp_path / "absent.json")


# --- sampler ------------------------------------------------------------------------------------------------------


def _steps(sampler, n):
    return [sampler.next_step() for _ in range(n)]


def test_sampler_is_deterministic_and_covers_each_epoch():
    a = _steps(ResumableBatchSampler(40, 2, 2, 0, 1, seed=9), 10)
    b = _steps(ResumableBatchSampler(40, 2, 2, 0, 1, seed=9), 10)
    c = _steps(ResumableBatchSampler(40, 2, 2, 0, 1, seed=10), 10)
    assert a == b and a != c
    epoch0 = [i for step in a for mb in step for i in mb]
    assert sorted(epoch0) == list(range(40))  # 10 steps x 4 = one epoch, each index once
    s = ResumableBatchSampler(42, 4, 1, 0, 1, seed=0, shuffle=False)
    flat = [i for step in _steps(s, 11) for mb in step for i in mb]
    assert flat[:40] == list(range(40)) and flat[40:] == [0, 1, 2, 3]  # remainder 40, 41 dropped
    assert s.state_dict()["epoch"] == 1
    with pytest.raises(DataError, match="fewer than one global batch"):
        ResumableBatchSampler(7, 2, 2, 0, 2, seed=0)


def test_sampler_resume_equals_uninterrupted():
    full = _steps(ResumableBatchSampler(30, 2, 3, 1, 2, seed=5), 12)
    first = ResumableBatchSampler(30, 2, 3, 1, 2, seed=5)
    head = _steps(first, 7)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = ResumableBatchSampler(30, 2, 3, 1, 2, seed=5)
    resumed.load_state_dict(state)
    assert head + _steps(resumed, 5) == full
    with pytest.raises(DataError, match="seed"):
        ResumableBatchSampler(30, 2, 3, 1, 2, seed=6).load_state_dict(state)


@pytest.mark.parametrize("layout", [(1, 4, 2), (2, 2, 2), (4, 1, 2), (8, 1, 1), (2, 1, 4)])
def test_global_batch_union_is_independent_of_dp_size(layout):
    dp, accum, mbs = layout
    ref = ResumableBatchSampler(100, 8, 1, 0, 1, seed=3)  # one rank, one micro-batch of 8
    ranks = [ResumableBatchSampler(100, mbs, accum, r, dp, seed=3) for r in range(dp)]
    for _ in range(30):
        want = ref.next_step()[0]
        per_rank = [s.next_step() for s in ranks]
        assert all(len(mb) == mbs for steps in per_rank for mb in steps)
        # micro-step m of rank r holds chunk m * dp + r of the global batch
        rebuilt = [per_rank[r][m] for m in range(accum) for r in range(dp)]
        assert [i for mb in rebuilt for i in mb] == want


# --- prefetching loader -------------------------------------------------------------------------------------------


def test_prefetch_loader_matches_direct_indexing_and_tracks_consumption():
    ds = build_dataset(SYN, 256)
    direct_sampler = ResumableBatchSampler(len(ds), 2, 2, 0, 1, seed=1)
    with PrefetchLoader(ds, ResumableBatchSampler(len(ds), 2, 2, 0, 1, seed=1), depth=3) as loader:
        for _ in range(4):
            got = loader.next_step()
            want = direct_sampler.next_step()
            assert len(got) == 2
            for batch, idx in zip(got, want, strict=True):
                assert torch.equal(batch["input_ids"], torch.stack([ds[i]["input_ids"] for i in idx]))
                assert torch.equal(batch["labels"], torch.stack([ds[i]["labels"] for i in idx]))
        deadline = time.time() + 5
        while loader._queue.qsize() < 3 and time.time() < deadline:
            time.sleep(0.01)
        assert loader._queue.qsize() == 3  # the thread did run ahead ...
        assert loader.state_dict() == direct_sampler.state_dict()  # ... but the state is what was consumed
        state = loader.state_dict()
        upcoming = [loader.next_step() for _ in range(3)]

    resumed_sampler = ResumableBatchSampler(len(ds), 2, 2, 0, 1, seed=1)
    resumed_sampler.load_state_dict(state)
    with PrefetchLoader(ds, resumed_sampler, depth=2) as again:
        for want in upcoming:
            got = again.next_step()
            assert all(torch.equal(g["input_ids"], w["input_ids"]) for g, w in zip(got, want, strict=True))
        again.load_state_dict(state)  # rewinding drops the prefetched steps
        assert torch.equal(again.next_step()[0]["input_ids"], upcoming[0][0]["input_ids"])
    assert not again._thread


def test_prefetch_loader_reraises_worker_errors():
    class Broken:
        def __getitem__(self, i):
            raise DataError("boom")

    loader = PrefetchLoader(Broken(), ResumableBatchSampler(8, 2, 1, 0, 1, seed=0))
    with pytest.raises(DataError, match="boom"):
        loader.next_step()
    with pytest.raises(DataError, match="boom"):
        loader.next_step()
    loader.close()


def test_prefetch_depth_zero_is_synchronous_and_equivalent():
    ds = build_dataset(SYN, 256)
    threaded = PrefetchLoader(ds, ResumableBatchSampler(len(ds), 4, 1, 1, 2, seed=2), depth=2)
    inline = PrefetchLoader(ds, ResumableBatchSampler(len(ds), 4, 1, 1, 2, seed=2), depth=0)
    assert inline._thread is None
    for _ in range(3):
        assert torch.equal(threaded.next_step()[0]["input_ids"], inline.next_step()[0]["input_ids"])
        assert threaded.state_dict() == inline.state_dict()
    threaded.close()
    inline.close()
    with pytest.raises(DataError, match="after close"):
        inline.next_step()
