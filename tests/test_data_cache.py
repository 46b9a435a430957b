"""Tokenize once (``data.cache_dir``): the first start builds the cache, later ones read no raw file, a changed file or
tokenizer gives a new entry, ranks racing to build it share one, and ``kc data prepare`` builds it ahead."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kuangchao_core.data import build_dataset
from kuangchao_core.perm import guard_api
from tests.mp import run_distributed


@pytest.fixture(autouse=True)
def _trusted():
    with guard_api.thread_guard(guard_api.AllowAll()):
        yield


def _corpus(tmp_path: Path, n: int = 200) -> Path:
    d = tmp_path / "corpus"
    d.mkdir(exist_ok=True)
    for part in range(2):
        lines = [json.dumps({"text": f"document {part}-{i}: {'abc' * (i % 7)}"}) for i in range(n)]
        (d / f"part{part}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return d


def _data(tmp_path: Path, **more) -> dict:
    base = {"path": str(tmp_path / "corpus"), "format": "jsonl", "seq_len": 16, "cache_dir": str(tmp_path / "cache")}
    return {**base, **more}


def _entries(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "cache").iterdir())


def _mapped_from(address: int, path: Path) -> bool:
    """Whether ``address`` lies in a mapping of ``path`` in this process (``/proc/self/maps``)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_the_second_start_reads_the_cache_and_no_raw_file(tmp_path, monkeypatch):
    _corpus(tmp_path)
    uncached = {k: v for k, v in _data(tmp_path).items() if k != "cache_dir"}
    plain = build_dataset(uncached, 256)
    plain_docs = build_dataset({**uncached, "packing": "documents"}, 256)
    first = build_dataset(_data(tmp_path), 256)
    assert np.array_equal(first.tokens.numpy(), plain.tokens.numpy())
    assert [first[i]["labels"].tolist() for i in (0, 5)] == [plain[i]["labels"].tolist() for i in (0, 5)]
    (entry,) = _entries(tmp_path)  # one entry, no lock or build directory left behind
    from kuangchao_core.data import cache

    def no_reading(*args, **kwargs):
        raise AssertionError("a raw data file was read")

    monkeypatch.setattr(cache, "read_documents", no_reading)
    second = build_dataset(_data(tmp_path), 256)
    assert _mapped_from(second.tokens.data_ptr(), tmp_path / "cache" / entry / "tokens.bin")  # not a copy per rank
    assert np.array_equal(second.tokens.numpy(), plain.tokens.numpy())
    docs = build_dataset(_data(tmp_path, packing="documents"), 256)  # the document starts are cached too
    for i in (0, 7):
        assert docs[i]["segment_ids"].tolist() == plain_docs[i]["segment_ids"].tolist()
        assert docs[i]["position_ids"].tolist() == plain_docs[i]["position_ids"].tolist()
    assert _entries(tmp_path) == [entry]


def test_a_changed_file_or_tokenizer_makes_a_new_entry(tmp_path):
    corpus = _corpus(tmp_path)
    build_dataset(_data(tmp_path), 256)
    first = _entries(tmp_path)
    with open(corpus / "part1.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    grown = build_dataset(_data(tmp_path), 256)
    second = _entries(tmp_path)
    assert len(second) == 2 and set(first) < set(second)
    assert grown.tokenizer.decode(grown.tokens.numpy()[-18:].tolist()) == "one more document\n"
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "document": 1, "</s>": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["</s>"])
    tok.save(str(tmp_path / "tok.json"))
    build_dataset(_data(tmp_path, tokenizer=str(tmp_path / "tok.json")), 256)
    assert len(_entries(tmp_path)) == 3


def _race(rank: int, world_size: int, data: dict):
    with guard_api.thread_guard(guard_api.AllowAll()):
        ds = build_dataset(data, 256)
    return ds.tokens.numpy().tolist()


def test_ranks_racing_to_build_share_one_entry(tmp_path):
    _corpus(tmp_path, n=2000)
    a, b = run_distributed(_race, 2, args=(_data(tmp_path),), init_pg=False)
    assert a == b and len(a) > 10_000
    assert len(_entries(tmp_path)) == 1  # one builder, no leftover lock or build directory


def test_kc_data_prepare_builds_ahead_and_says_so(tmp_path):
    from kuangchao.cli.main import app

    _corpus(tmp_path)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps({"task": {"name": "prep"}, "data": _data(tmp_path)}), encoding="utf-8")
    runner = CliRunner()
    first = runner.invoke(app, ["data", "prepare", str(cfg)])
    assert first.exit_code == 0, first.output
    assert "built" in first.output and "400 documents" in first.output
    again = runner.invoke(app, ["data", "prepare", str(cfg)])
    assert again.exit_code == 0 and "already there" in again.output
    bare = tmp_path / "bare.yaml"
    bare.write_text(json.dumps({"task": {"name": "prep"}, "data": {**_data(tmp_path), "cache_dir": None}}))
    refused = runner.invoke(app, ["data", "prepare", str(bare)])
    assert refused.exit_code == 2 and "data.cache_dir" in refused.output
    assert not os.environ.get("KC_TOKEN")  # nothing of a job was needed
