"""Your own text in three commands (issue 39, item 3): ``.txt`` keeps its bytes; ``kc data prepare PATH --out DIR``
splits by a stated rule, trains a BPE tokenizer that transformers loads, tokenizes into the memory-mapped cache and
writes a config that ``kc config validate`` accepts and the engine trains on.

Negative controls: the old blank-line rule (``data.txt_documents: blank_lines``) loses the blank lines and refuses a
long record, so the round-trip and no-refusal assertions would fail if the default fell back to it.
"""

from __future__ import annotations

import io
import math
import random
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from kuangchao_core import guard_api
from kuangchao_core.data.dataset import build_dataset
from kuangchao_core.data.files import iter_records, read_documents
from kuangchao_core.data.heldout_split import split_heldout
from kuangchao_core.data.stream import Oversize, file_pieces
from kuangchao_core.data.tokenizer import ByteTokenizer
from kuangchao_core.errors import DataError

# blank lines (one and several), spaces-only lines, trailing spaces, CRLF, tabs, multi-byte characters
AWKWARD = "Act I\n\n\nScene 1.  \r\n\tEnter KING.\n \n  \nKING. Où est\u2014la reine? 王 😀\n\n"


@pytest.fixture(autouse=True)
def _allow_reads():
    previous = guard_api.install_guard(guard_api.AllowAll())  # these tests read files as an operator's tool would
    yield
    guard_api.install_guard(previous)


def _app() -> typer.Typer:
    from kuangchao.cli.config_cmd import register as register_config
    from kuangchao.cli.data_cmd import register as register_data

    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """Test root."""

    register_config(app)
    register_data(app)
    return app


def _corpus(folder: Path, files: int = 2, lines: int = 500, seed: int = 0) -> Path:
    rng = random.Random(seed)
    words = "the king queen lord speak thou art thy heart love death night day sword crown".split()
    folder.mkdir(parents=True)
    for k in range(files):
        out = []
        for i in range(lines):
            if i % 7 == 0:
                out.append("")  # a blank line every 7 lines: what the old reader dropped
            out.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 10))))
        (folder / f"play{k}.txt").write_text("\n".join(out) + "\n\n", encoding="utf-8")
    return folder


# --- .txt keeps its bytes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cached", [False, True])
def test_the_bytes_of_a_txt_with_blank_lines_survive_tokenize_and_detokenize(tmp_path, cached):
    path = tmp_path / "awkward.txt"
    path.write_bytes(AWKWARD.encode("utf-8") * 3)
    cfg = {"path": str(path), "seq_len": 8, **({"cache_dir": str(tmp_path / "cache")} if cached else {})}
    ds = build_dataset(cfg, 256)
    # the whole file is one document: its bytes as written, then the separator (byte 10 for the byte tokenizer)
    assert ByteTokenizer().decode(ds.tokens.tolist()).encode("utf-8") == path.read_bytes() + b"\n"
    # control: the blank-line rule (before issue 39) loses the blank lines, CRLF and the spaces-only lines
    old = build_dataset({**cfg, "txt_documents": "blank_lines"}, 256)
    assert ByteTokenizer().decode(old.tokens.tolist()).encode("utf-8") != path.read_bytes() + b"\n"
    assert b"\n\n" not in ByteTokenizer().decode(old.tokens.tolist()).encode("utf-8")


def test_file_pieces_join_to_the_file_and_cut_no_character():
    rng = random.Random(3)
    alphabet = ["a", " ", "\n", "\r\n", "é", "王", "😀"]
    for limit in (4, 5, 9, 64):
        for _ in range(100):
            data = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120))).encode("utf-8")
            pieces = list(file_pieces(io.BytesIO(data), limit))
            assert b"".join(p for p, _ in pieces) == data
            offset = 0
            for piece, line in pieces:
                assert len(piece) <= limit and piece.decode("utf-8")  # whole characters only
                assert line == data[:offset].count(b"\n") + 1  # named by the line it starts on
                offset += len(piece)


def test_a_record_over_the_limit_is_cut_into_pieces_not_refused(tmp_path):
    from kuangchao_core.config import config_from_dict
    from kuangchao_core.data import validation as V

    path = tmp_path / "one_line.txt"
    path.write_text("word " * 4000, encoding="utf-8")  # one 20 000-byte line
    body = {"task": {"name": "t"}, "model": {"preset": "tiny"}, "train": {"steps": 1}}
    cfg = config_from_dict({**body, "data": {"path": str(path), "seq_len": 16}})
    report = V.validate_dataset(cfg, max_record_bytes=4096)
    assert report.result("no_oversize_records").success, report.summary
    docs = list(read_documents(path))
    assert len(docs) == 1 and "".join(docs[0]) == path.read_text(encoding="utf-8")
    pieces = [raw for raw, _ in iter_records(path, max_record_bytes=4096)]
    assert [len(p) for p in pieces] == [4096] * 4 + [20000 - 4 * 4096]
    old = [raw for raw, _ in iter_records(path, max_record_bytes=4096, txt_documents="blank_lines")]
    assert old == [Oversize(20000, 4096)]  # control: the blank-line rule refuses the record (the gate fails on it)
    with pytest.raises(DataError, match="more than the limit of 4096"):
        list(read_documents(path, max_record_bytes=4096, txt_documents="blank_lines"))


# --- the split rule -----------------------------------------------------------------------------------------------


def test_the_heldout_split_keeps_every_byte_and_starts_at_the_first_line_past_the_share(tmp_path):
    src = _corpus(tmp_path / "corpus")
    (src / "sub").mkdir()
    (src / "sub" / "one_line.txt").write_text("é" * 1000, encoding="utf-8")  # no line start in its tail
    report = split_heldout(src, tmp_path / "out", 0.1)
    assert sorted(report.files) == ["play0.txt", "play1.txt", "sub/one_line.txt"]
    total = 0
    for name in report.files:
        whole = (src / name).read_bytes()
        train, held = (report.train_dir / name).read_bytes(), (report.heldout_dir / name).read_bytes()
        assert train + held == whole  # nothing dropped, nothing repeated
        target = math.floor(len(whole) * 0.9)
        if name.endswith("one_line.txt"):  # cut at the byte, moved back to a character start
            assert len(train) <= target and len(train) % 2 == 0 and held.decode("utf-8")
        else:
            assert train.endswith(b"\n") and b"\n" not in whole[target - 1 : len(train) - 1]
        total += len(whole)
    assert report.train_bytes + report.heldout_bytes == total
    with pytest.raises(DataError, match="--heldout"):
        split_heldout(src, tmp_path / "bad", 1.5)
    with pytest.raises(DataError, match="--out: .* is inside"):
        split_heldout(src, src / "prepared", 0.1)


# --- the three commands -------------------------------------------------------------------------------------------


def test_three_commands_prepare_validate_and_the_tokenizer_loads_in_transformers(tmp_path):
    import yaml
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from kuangchao_core.config import load_config
    from kuangchao_core.data.cache import cached_corpus
    from kuangchao_core.data.tokenizer import HFTokenizer

    src = _corpus(tmp_path / "corpus")
    (src / "awkward.txt").write_text(AWKWARD * 40, encoding="utf-8")
    out = tmp_path / "prep"
    runner = CliRunner()
    args = ["data", "prepare", str(src), "--out", str(out), "--heldout", "0.1", "--vocab-size", "300"]
    result = runner.invoke(_app(), args)
    assert result.exit_code == 0, result.output
    assert "held-out: the last 0.1 of each file's bytes" in result.output and "model.preset tiny" in result.output
    config = out / "config.yaml"
    result = runner.invoke(_app(), ["config", "validate", str(config)])
    assert result.exit_code == 0 and "ok:" in result.output, result.output

    cfg = load_config(config)
    body = yaml.safe_load(config.read_text(encoding="utf-8"))
    assert body["model"] == {"preset": "tiny", "vocab_size": cfg.model.vocab_size}
    assert cfg.data.tokenizer == str(out / "tokenizer") and cfg.data.txt_documents == "file"
    assert cfg.model.vocab_size <= 300 and cfg.data.seq_len * 2 == cfg.model.max_seq_len

    text = AWKWARD + "the king speaks, thou art\n\n\nlove"
    bare = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer" / "tokenizer.json"))
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")  # tokenizer_config.json names the end-of-text token
    for t in (bare, tok):
        ids = t.encode(text, add_special_tokens=False)
        assert t.decode(ids) == text and len(ids) < len(text.encode("utf-8"))  # exact, and merges were learnt
    assert tok.eos_token == "<|endoftext|>"
    ours = HFTokenizer(out / "tokenizer")
    assert ours.encode(text) == tok.encode(text, add_special_tokens=False) and ours.sep_id == tok.eos_token_id

    # the parts were tokenized into memory-mapped arrays: a job maps them (no build), and decoding gives the bytes
    tokens, _, meta = cached_corpus(cfg.data, ours, cfg.model.vocab_size, cfg.data.cache_dir)
    assert not meta["built"]  # prepared by the command: a job maps the arrays (data.cache), never re-tokenizes
    on_disk = np.fromfile(Path(cfg.data.cache_dir) / meta["key"] / "tokens.bin", dtype=np.int32)
    assert np.array_equal(on_disk, tokens.numpy())
    stream = tokens.tolist()
    eos = [i for i, t in enumerate(stream) if t == ours.sep_id]
    first = ours.decode(stream[: eos[0]])  # the first training file (sorted: awkward.txt), as written
    assert first.encode("utf-8") == (out / "train" / "awkward.txt").read_bytes()
    assert len(eos) == 3  # one document per file
    ds = build_dataset(cfg.data, cfg.model.vocab_size)
    held = build_dataset(cfg.data, cfg.model.vocab_size, split="eval")
    assert len(ds) > 0 and len(held) > 0 and ds.num_tokens == len(stream)


def test_prepare_refuses_bad_options_in_one_line(tmp_path):
    src = _corpus(tmp_path / "corpus", files=1, lines=50)
    runner = CliRunner()
    result = runner.invoke(_app(), ["data", "prepare", str(src)])
    assert result.exit_code == 2 and "--out" in result.output
    result = runner.invoke(_app(), ["data", "prepare", str(src), "--out", str(tmp_path / "o"), "--vocab-size", "200"])
    assert result.exit_code == 1 and "--vocab-size: 200 is below 257" in result.output
    result = runner.invoke(_app(), ["data", "prepare", str(src), "--out", str(tmp_path / "p"), "--preset", "huge"])
    assert result.exit_code == 1 and "--preset: unknown preset 'huge'" in result.output


# --- a few steps on the written config ----------------------------------------------------------------------------


def test_the_written_config_trains_a_few_steps_through_the_engine(tmp_path):
    from kuangchao_core.config import load_config
    from kuangchao_core.data.prepare_corpus import prepare_corpus
    from tests.engine_helpers import run_trainer
    from tests.mp import run_distributed

    report = prepare_corpus(_corpus(tmp_path / "corpus"), tmp_path / "prep", heldout=0.1, vocab_size=300)
    overrides = [
        "train.steps=3",
        "train.eval_interval=2",
        "train.device=cpu",
        "parallel.backend=gloo",
        "permission.mode=trusted",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.resume=never",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ]
    cfg = load_config(report["config"], overrides)
    [out] = run_distributed(run_trainer, 1, (cfg,))
    assert len(out["losses"]) == 3 and all(math.isfinite(x) for x in out["losses"])
    assert out["params"]["model.embed_tokens.weight"].shape[0] == report["vocab_size"]


def test_the_preset_grows_with_the_training_text_at_about_seven_bytes_a_parameter():
    """``kc data prepare`` picks tiny → small → 125m → 1b as the training text grows, each from about 7 bytes of text
    a parameter (small's 20 MiB for its 3 M); one byte under a threshold keeps the smaller preset; 8b only by flag."""
    from kuangchao_core.data.prepare_corpus import PRESET_BY_SIZE, choose_preset
    from kuangchao_core.models.llama import PRESETS

    assert [name for name, _ in PRESET_BY_SIZE] == ["tiny", "small", "125m", "1b"]
    for name, least in PRESET_BY_SIZE[1:]:
        assert choose_preset(least) == name and choose_preset(least - 1) != name
        assert 5 <= least / PRESETS[name].num_params() <= 9, name
    assert choose_preset(1 << 50) == "1b" and choose_preset(0) == "tiny"
    assert PRESETS["1b"].num_params() == 1_235_814_400  # Llama-3.2-1B's published count
