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

pytestmark = pytest.mark.usefixtures("trusted")


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


def _sft_records(tmp_path: Path, n: int = 60) -> Path:
    d = tmp_path / "sft"
    d.mkdir(exist_ok=True)
    rows = [{"prompt": f"{i}+{i % 7}=", "completion": str(i + i % 7)} for i in range(n)]
    rows.append({"prompt": "x" * 40, "completion": "too long for seq_len 32"})
    rows += [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(n // 4)
    ]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:12]), encoding="utf-8")
    return d


def _sft_data(tmp_path: Path, **more) -> dict:
    d = tmp_path / "sft"
    base = {"path": str(d / "train.jsonl"), "eval_path": str(d / "eval.jsonl"), "format": "sft", "seq_len": 32}
    return {**base, "cache_dir": str(tmp_path / "cache"), **more}


def _items(ds) -> list[tuple[list[int], list[int]]]:
    return [(ds[i]["input_ids"].tolist(), ds[i]["labels"].tolist()) for i in range(len(ds))]


@pytest.mark.parametrize("packing", ["none", "documents"])
def test_sft_records_are_cached_and_a_warm_start_reads_no_record(tmp_path, monkeypatch, packing):
    _sft_records(tmp_path)
    uncached = {k: v for k, v in _sft_data(tmp_path, packing=packing).items() if k != "cache_dir"}
    plain = build_dataset(uncached, 256)
    first = build_dataset(_sft_data(tmp_path, packing=packing), 256)
    assert _items(first) == _items(plain)  # every row and every -100, token by token
    assert first.report.to_dict() == plain.report.to_dict() and first.report.dropped_too_long == 1
    held_out = build_dataset(_sft_data(tmp_path, packing=packing), 256, split="eval")  # eval_path: its own entry
    plain_held_out = build_dataset(uncached, 256, split="eval")
    assert [(e.ids, e.trained) for e in held_out.examples] == [(e.ids, e.trained) for e in plain_held_out.examples]
    entries = _entries(tmp_path)
    assert len(entries) == 2  # no lock or build directory left behind
    from kuangchao_core.data import cache

    def no_reading(*args, **kwargs):
        raise AssertionError("a raw record was read")

    monkeypatch.setattr(cache, "iter_sft_records", no_reading)
    second = build_dataset(_sft_data(tmp_path, packing=packing), 256)
    assert any(_mapped_from(second.ids.data_ptr(), tmp_path / "cache" / e / "ids.bin") for e in entries)
    assert _items(second) == _items(plain)
    assert second.report.to_dict() == plain.report.to_dict()
    again = build_dataset(_sft_data(tmp_path, packing=packing), 256, split="eval")
    assert [(e.ids, e.trained) for e in again.examples] == [(e.ids, e.trained) for e in plain_held_out.examples]
    assert _entries(tmp_path) == entries


def test_sft_cache_entries_follow_the_records_the_template_and_seq_len(tmp_path):
    d = _sft_records(tmp_path)
    build_dataset(_sft_data(tmp_path), 256)
    build_dataset(_sft_data(tmp_path, seq_len=64), 256)  # the too-long record now fits: another entry
    assert len(_entries(tmp_path)) == 2
    longer = build_dataset(_sft_data(tmp_path, seq_len=64), 256)
    assert longer.report.dropped_too_long == 0
    with open(d / "train.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    grown = build_dataset(_sft_data(tmp_path), 256)
    assert len(_entries(tmp_path)) == 3 and grown.report.records == 60 + 1 + 15 + 1
    tok = tmp_path / "tok"
    tok.mkdir()
    from kuangchao_core.data.tokenizer_export import write_tokenizer_files

    write_tokenizer_files("byte", tok, 64)
    build_dataset(_sft_data(tmp_path, tokenizer=str(tok)), 256)
    assert len(_entries(tmp_path)) == 4
    config = json.loads((tok / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = "### " + config["chat_template"]
    (tok / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    build_dataset(_sft_data(tmp_path, tokenizer=str(tok)), 256)  # a changed chat template: new masks, new entry
    assert len(_entries(tmp_path)) == 5


def test_kc_data_prepare_builds_sft_records_and_their_held_out_file(tmp_path):
    from kuangchao.cli.main import app

    _sft_records(tmp_path)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps({"task": {"name": "prep"}, "data": _sft_data(tmp_path)}), encoding="utf-8")
    out = CliRunner().invoke(app, ["data", "prepare", str(cfg)])
    assert out.exit_code == 0, out.output
    assert "data.path" in out.output and "75 examples" in out.output and "1 too long, dropped" in out.output
    assert "data.eval_path" in out.output and "12 examples" in out.output
    assert len(_entries(tmp_path)) == 2
    with guard_api.thread_guard(guard_api.AllowAll()):
        ds = build_dataset(_sft_data(tmp_path), 256)  # the job finds the prepared entry
    assert len(_entries(tmp_path)) == 2 and ds.report.examples == 60 + 15


def _build_peaks(tmp_path: Path, name: str, mib: int) -> tuple[int, int, dict]:
    """A corpus of one ``mib`` MiB ``.txt`` file (blank lines in it) and a JSON-lines file: the most bytes building its
    cache entry allocated at once, the same for packing it in memory, and the entry's meta (both streams checked
    equal)."""
    import tracemalloc

    from kuangchao_core.data.cache import cached_corpus
    from kuangchao_core.data.files import read_documents
    from kuangchao_core.data.packing import pack_documents_with_starts
    from kuangchao_core.data.tokenizer import ByteTokenizer

    corpus = tmp_path / name
    corpus.mkdir()
    line = "a line of the user's own text, with a blank line after it every so often\n"
    with (corpus / "a.txt").open("w", encoding="utf-8") as f:
        for i in range((mib << 20) // len(line) + 1):
            f.write(line + ("\n" if i % 5 == 0 else ""))
    (corpus / "b.jsonl").write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(50)))
    data = {"path": str(corpus), "format": "auto", "seq_len": 16, "cache_dir": str(tmp_path / "cache")}
    tokenizer = ByteTokenizer()
    tracemalloc.start()
    try:
        tokens, starts, meta = cached_corpus(data, tokenizer, 256, data["cache_dir"])
        built_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        packed, packed_starts = pack_documents_with_starts(read_documents(str(corpus), "auto"), tokenizer)
        packed_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert meta["built"] and meta["num_tokens"] == packed.numel() == tokens.numel() > (mib << 20)
    assert np.array_equal(tokens.numpy(), packed.numpy()) and np.array_equal(starts, packed_starts)
    assert meta["num_documents"] == 51 and meta["max_token"] == int(packed.max())
    return built_peak, packed_peak, meta


def test_a_text_entry_is_written_as_it_is_tokenized_and_holds_no_corpus_in_memory(tmp_path):
    """Building a text entry holds one piece of text (at most 1 MiB) and its tokens, whatever the corpus size: a
    corpus 2 MiB larger raises the build's peak by less than 2 MiB, where a packed stream in memory grows by 4 bytes a
    byte-token, 8 MiB (the negative control packs the same documents in memory and does). The entries equal the
    streams packed in memory."""
    small_built, small_packed, _ = _build_peaks(tmp_path, "small", 2)
    large_built, large_packed, _ = _build_peaks(tmp_path, "large", 4)
    assert large_built - small_built < 2 << 20, (small_built, large_built)
    assert large_packed - small_packed >= 4 * (2 << 20), (small_packed, large_packed)
