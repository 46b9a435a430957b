"""The real-text demo (issue 39 item 5), ``examples/shakespeare.sh``, run short on a made-up corpus, and the rule
that restates the held-out loss per character and per byte (:mod:`kuangchao_core.data.token_bytes`).

The demo downloads the plays from the package index; this test never touches the network: it gives the script a
folder of generated plays (ASCII text with blank lines, as the real ones) with ``--corpus`` and runs its commands
as written — ``kc data prepare``, ``kc config validate``, ``kc train`` on the session's Prefect server (8 steps) and
the report. Checked from what the user gets: the tokenizer loads in transformers and gives the held-out files back
byte for byte; the nats per character and bits per byte it prints are recomputed here from the held-out files
themselves (transformers' tokenizer, the windows' rule: window ``i`` labels tokens ``1 + 64i .. 64(i+1)`` of the
held-out stream, each file's tokens followed by the end-of-text token); the final model's samples are printed.
Negative control: dividing by the whole held-out split's characters (not those of the evaluated tokens) gives
another figure, so the check bites on a conversion that does not count exactly the evaluated tokens.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kuangchao_core import guard_api
from kuangchao_core.data.bpe_train import EOS, train_byte_bpe
from kuangchao_core.data.token_bytes import labelled_text_sizes, token_text_sizes
from kuangchao_core.data.tokenizer import ByteTokenizer, HFTokenizer

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "shakespeare.sh"
SEQ = 64  # the script's data.seq_len
AWKWARD = "Où est\u2014la reine? 王 😀\r\n\n\tthe king, the king  \n"


def _plays(folder: Path, files: int = 2, speeches: int = 400) -> Path:
    """Generated 'plays': speaker lines, speeches, blank lines between them (ASCII, as the Gutenberg texts)."""
    rng = random.Random(7)
    words = "the king queen lord speak thou art thy heart love death night day sword crown good my o".split()
    folder.mkdir(parents=True)
    for k in range(files):
        lines = [f"THE TRAGEDY OF PLAY {k}", "", ""]
        for _ in range(speeches):
            lines += [rng.choice(["Ham.", "Hor.", "King.", "Queen."])]
            lines += [" ".join(rng.choices(words, k=rng.randint(3, 9))).capitalize() + "." for _ in range(2)]
            lines += [""]
        (folder / f"play_{k}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def test_token_sizes_count_the_bytes_and_characters_of_the_text(tmp_path):
    """Over any run of tokens the table adds up to the bytes and characters of the text they spell — a character
    split across tokens counts once — and a special token spells nothing."""
    vocab = train_byte_bpe([AWKWARD * 20, "the king and the queen\n\n"] * 10, 320, tmp_path / "tok")
    tok = HFTokenizer(tmp_path / "tok")
    sizes = token_text_sizes(tok, vocab)
    ids = tok.encode(AWKWARD)
    assert sizes[ids].sum(0).tolist() == [len(AWKWARD.encode()), len(AWKWARD)]
    assert sizes[tok.sep_id].tolist() == [0, 0] and tok.decode([tok.sep_id]) == EOS
    unseen = tok.encode("ж")  # a character the tokenizer never saw: its two bytes, one token each
    assert sizes[unseen].tolist() == [[1, 1], [1, 0]]  # the split character counts once, with its first byte
    labels = torch.tensor([ids + [tok.sep_id, -100]])
    assert labelled_text_sizes(sizes, labels, -100).tolist() == [len(AWKWARD.encode()), len(AWKWARD)]
    byte = token_text_sizes(ByteTokenizer(), 256)
    assert byte[list(AWKWARD.encode())].sum(0).tolist() == [len(AWKWARD.encode()), len(AWKWARD)]


def test_a_tokenizer_whose_tokens_are_not_bytes_gives_no_per_byte_figure(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "king": 1, "</s>": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert token_text_sizes(HFTokenizer(tmp_path / "tokenizer.json"), 3) is None


def _ints(text: str) -> int:
    return int(text.replace(",", ""))


@pytest.fixture(scope="module")
def demo(tmp_path_factory, prefect_api):
    work = tmp_path_factory.mktemp("shakespeare")
    corpus = _plays(work / "plays")
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_api,
        "KC_RUNS_DIR": str(work / "runs"),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "KC": f"{sys.executable} -m kuangchao.cli.main",
        "PYTHON": sys.executable,
    }
    argv = ["bash", str(SCRIPT), "--corpus", str(corpus), "--out", str(work / "out"), "--steps", "8"]
    argv += ["--vocab-size", "300", "--set", "tracking.system_metrics=false"]
    out = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout[-4000:], out.stderr[-4000:])
    summary = json.loads(next((work / "runs" / "shakespeare").glob("*/summary.json")).read_text())
    return work, out.stdout, summary


def test_the_demo_trains_and_reports_per_character_and_per_byte(demo):
    from transformers import PreTrainedTokenizerFast

    work, stdout, summary = demo
    prepared = work / "out" / "prepared"
    tok = PreTrainedTokenizerFast(tokenizer_file=str(prepared / "tokenizer" / "tokenizer.json"))
    heldout = sorted((prepared / "heldout").glob("*.txt"))
    texts = [p.read_text(encoding="utf-8") for p in heldout]
    assert len(texts) == 2 and all("\n\n" in t for t in texts)
    assert [tok.decode(tok.encode(t)) for t in texts] == texts  # blank lines and all, byte for byte
    eos = tok.convert_tokens_to_ids(EOS)
    stream = [i for t in texts for i in [*tok.encode(t), eos]]
    h = summary["heldout"]
    assert summary["steps"] == 8 and h["step"] == 8
    windows = (len(stream) - 1) // SEQ
    assert h["eval_windows"] == windows and h["eval_tokens"] == windows * SEQ  # the whole split, every window
    labelled = stream[1 : 1 + windows * SEQ]
    spelled = "".join(tok.decode([i]) for i in labelled if i != eos)  # ASCII: one character per byte
    assert (h["eval_bytes"], h["eval_chars"]) == (len(spelled.encode()), len(spelled))
    nats = h["eval_loss"] * h["eval_tokens"]
    per_char, per_byte = nats / len(spelled), nats / len(spelled.encode()) / math.log(2)
    figures = (
        r"([\d.]+) nats/token over ([\d,]+) tokens .* = ([\d.]+) nats/char \(([\d,]+) characters\) = ([\d.]+) bits"
    )
    line = re.search("held-out loss at step 8: " + figures, stdout)
    assert line, stdout[-3000:]
    assert float(line[1]) == pytest.approx(h["eval_loss"], abs=1e-4) and _ints(line[2]) == h["eval_tokens"]
    assert float(line[3]) == pytest.approx(per_char, abs=1e-4) and _ints(line[4]) == len(spelled)
    assert float(line[5]) == pytest.approx(per_byte, abs=1e-4)
    assert h["eval_nats_per_char"] == pytest.approx(per_char, rel=1e-12)
    # control: the whole held-out split's characters (not the evaluated tokens') give another figure
    assert abs(nats / sum(len(t) for t in texts) - per_char) > 1e-3
    # the final model's samples, printed after the run
    assert "sample answers of the final model:" in stdout and "[1] prompt:" in stdout
    assert f"held-out loss {h['eval_loss']:.4f} at step 8" in stdout and "nats/char" in stdout


def test_the_prepared_cache_streams_the_held_out_tokens(demo):
    """The memory-mapped cache ``kc data prepare`` wrote is what the job read: its held-out stream is the files'
    tokens, each followed by the end-of-text token."""
    from kuangchao_core.data.dataset import build_dataset
    from kuangchao_core.data.tokenizer import get_tokenizer

    work, _, summary = demo
    import yaml

    config = yaml.safe_load((work / "out" / "prepared" / "config.yaml").read_text())
    data = {**config["data"], "path": config["data"]["eval_path"]}
    tok = get_tokenizer(data["tokenizer"])
    with guard_api.thread_guard(guard_api.AllowAll()):
        ds = build_dataset(data, tok.vocab_size, split="train")
    texts = [p.read_text() for p in sorted((work / "out" / "prepared" / "heldout").glob("*.txt"))]
    want = [i for t in texts for i in [*tok.encode(t), tok.sep_id]]
    assert ds.tokens.tolist() == want and len(ds) == summary["heldout"]["eval_windows"]
