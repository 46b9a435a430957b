"""Instruction data (``data.format: sft``): the loss falls on completions and assistant turns only, token by token.

Negative controls are built into each check: the masked positions are asserted to be exactly the prompt/user/system
positions, so a mask shifted by one token, or one that also covers the prompt, fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kuangchao_core.data.sft import SFTDataset, build_examples, build_sft_dataset, chat_spans
from kuangchao_core.data.tokenizer import ByteTokenizer, get_tokenizer
from kuangchao_core.errors import DataError


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _labels_text(tok, item) -> tuple[str, list[int]]:
    """The trained label tokens decoded, and the positions whose labels are -100."""
    labels = item["labels"].tolist()
    return tok.decode([t for t in labels if t != -100]), [i for i, t in enumerate(labels) if t == -100]


def test_prompt_completion_trains_the_completion_and_its_end_token_only(tmp_path):
    tok = ByteTokenizer()
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "2+3=", "completion": "5"}, {"prompt": "Q", "completion": "AB"}])
    ds = build_sft_dataset(str(path), tok, seq_len=8, packing="none", truncation="drop")
    first = ds[0]
    ids = first["input_ids"].tolist()
    assert tok.decode(ids[:5]) == "2+3=5"
    labels = first["labels"].tolist()
    # position t predicts token t+1: "2","+","3" predict prompt tokens (masked); "=" predicts "5"; "5" predicts "\n"
    assert labels[:3] == [-100, -100, -100]
    assert labels[3] == ord("5") and labels[4] == tok.sep_id
    assert all(x == -100 for x in labels[5:])  # padding is never trained
    assert _labels_text(tok, ds[1])[0] == "AB\n"
    assert ds.report.examples == 2 and ds.report.trained_tokens == 2 + 3


def test_messages_with_the_builtin_template_train_assistant_turns_only(tmp_path):
    tok = ByteTokenizer()
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ok"},
    ]
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
    ds = build_sft_dataset(str(path), tok, seq_len=96, packing="none", truncation="drop")
    item = ds[0]
    text = tok.decode(item["input_ids"].tolist())
    assert text.startswith("<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\nyo\n<|user|>\nbye\n<|assistant|>\nok\n")
    trained, _ = _labels_text(tok, item)
    assert trained == "yo\nok\n"
    labels = item["labels"].tolist()
    yo = text.index("yo")  # label position yo-1 predicts "y"
    assert labels[yo - 1] == ord("y") and labels[yo - 2] == -100 and labels[yo + 1] == ord("\n")


def _hf_tokenizer_dir(tmp_path: Path) -> Path:
    """A local Hugging Face tokenizer directory: a word-level tokenizer.json and a tokenizer_config.json whose
    chat_template wraps each turn in role tokens and ends it with the eos token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "[UNK]", "hi", "yo", "bye", "ok", "two", "2"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"])
    d = tmp_path / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {{ eos_token }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    config = {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return d


def test_messages_with_a_tokenizer_directorys_chat_template(tmp_path):
    tok = get_tokenizer(str(_hf_tokenizer_dir(tmp_path)), vocab_size=64)
    assert tok.sep_id == tok.encode("</s>")[0]
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ok two"},
    ]
    spans = chat_spans(msgs, tok)
    assert [t for t, on in spans if on] == ["yo </s> ", "ok two </s> "]
    assert (
        "".join(t for t, _ in spans)
        == "<s><|user|> hi </s> <|assistant|> yo </s> <|user|> bye </s> <|assistant|> ok two </s> "
    )
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
    ds = build_sft_dataset(str(path), tok, seq_len=16, packing="none", truncation="drop")
    labels = ds[0]["labels"].tolist()
    trained = [t for t in labels if t != -100]
    assert trained == tok.encode("yo </s> ok two </s>")
    ids = ds[0]["input_ids"].tolist()
    # every trained label is the next input token, and each trained run starts right after <|assistant|>
    for i, t in enumerate(labels):
        if t != -100 and i + 1 < len(ids):
            assert ids[i + 1] == t
    starts = [i for i in range(len(labels)) if labels[i] != -100 and (i == 0 or labels[i - 1] == -100)]
    assert [ids[i] for i in starts] == tok.encode("<|assistant|> <|assistant|>")


def test_too_long_examples_are_dropped_or_truncated_by_rule_and_counted(tmp_path):
    tok = ByteTokenizer()
    records = [({"prompt": "p", "completion": "x" * 30}, "r1"), ({"prompt": "q", "completion": "ab"}, "r2")]
    kept, report = build_examples(iter(records), tok, seq_len=8, truncation="drop")
    assert len(kept) == 1 and report.dropped_too_long == 1 and report.where_dropped == ["r1"]
    kept, report = build_examples(iter(records), tok, seq_len=8, truncation="truncate")
    assert len(kept) == 2 and report.truncated == 1 and len(kept[0].ids) == 9
    long_prompt = [({"prompt": "p" * 20, "completion": "a"}, "r3")]
    with pytest.raises(DataError, match="none of 1 sft records fits data.seq_len 8"):
        build_examples(iter(long_prompt), tok, seq_len=8, truncation="truncate")  # nothing trained would be left


def test_concat_packing_keeps_the_masks_across_window_cuts(tmp_path):
    tok = ByteTokenizer()
    records = [({"prompt": f"q{i}", "completion": f"a{i}"}, f"r{i}") for i in range(6)]
    examples, report = build_examples(iter(records), tok, seq_len=64, truncation="drop")
    ds = SFTDataset.from_examples(examples, 5, "concat", "x", tok, report)
    stream = torch.cat([ds[i]["labels"] for i in range(len(ds))])
    trained = tok.decode([t for t in stream.tolist() if t != -100])
    # window i covers stream tokens [5i, 5i+5]; labels are tokens 1.. of the stream: a0\n a1\n ... as far as it goes
    assert trained.startswith("a0\na1\na2\n")
    assert "q" not in trained


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"text": "x"}, "needs string fields 'prompt' and 'completion', or 'messages'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
        ({"messages": [{"role": "bot", "content": "hi"}]}, "messages[0] must be"),
    ],
)
def test_bad_records_name_the_record(tmp_path, record, message):
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": "b"}, record])
    with pytest.raises(DataError, match=rf"bad.jsonl:2: .*{message.replace('[', '.').replace(']', '.')}"):
        build_sft_dataset(str(path), ByteTokenizer(), seq_len=16, packing="none", truncation="drop")


def _sft_job(tmp_path: Path, **data):
    from tests.engine_helpers import tiny_job

    rng = __import__("random").Random(0)
    pairs = [(rng.randrange(50), rng.randrange(50)) for _ in range(300)]
    path = _jsonl(tmp_path / "add.jsonl", [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in pairs])
    return tiny_job(
        str(tmp_path),
        data={"format": "sft", "path": str(path), "seq_len": 12, **data},
        train={"steps": 30, "warmup_steps": 2},
        optimizer={"lr": 1e-2},
    )


def test_the_engine_trains_on_sft_data_and_the_gate_reads_the_same_records(tmp_path):
    from kuangchao_core.data import build_dataset
    from kuangchao_core.data.validation import validate_dataset
    from kuangchao_core.perm import guard_api
    from tests.engine_helpers import run_trainer
    from tests.mp import run_distributed

    cfg = _sft_job(tmp_path)
    with guard_api.thread_guard(guard_api.AllowAll()):  # trusted, as a job without permissions
        ds = build_dataset(cfg.data, 256)
    assert isinstance(ds, SFTDataset) and ds.packing == "none" and len(ds) == 300
    report = validate_dataset(cfg)
    assert report.to_dict()  # the great-expectations gate ran over the 300 records
    losses = run_distributed(run_trainer, 1, args=(cfg,), timeout=240)[0]["losses"]
    assert len(losses) == 30 and losses[-1] < 0.6 * losses[0], losses  # only answer tokens: it learns fast
    bad = tmp_path / "bad"
    bad.mkdir()
    broken = _sft_job(bad)
    Path(broken.data.path).write_text('{"prompt": "1+1="}\n', encoding="utf-8")
    with pytest.raises(DataError, match="needs string fields"):
        validate_dataset(broken)


def test_packing_none_is_refused_for_text_data(tmp_path):
    from kuangchao_core.errors import ConfigError
    from tests.engine_helpers import tiny_job

    with pytest.raises(ConfigError, match="data.packing"):
        tiny_job(str(tmp_path), data={"format": "jsonl", "path": str(tmp_path), "packing": "none"})


def test_documents_packing_trains_answers_and_never_across_examples():
    tok = ByteTokenizer()
    records = [({"prompt": f"q{i}=", "completion": f"a{i}"}, f"r{i}") for i in range(5)]
    examples, report = build_examples(iter(records), tok, seq_len=64, truncation="drop")
    ds = SFTDataset.from_examples(examples, 24, "documents", "x", tok, report)
    item = ds[0]
    assert item["segment_ids"].tolist()[:6] == [0] * 6 and item["segment_ids"].tolist()[6] == 1
    assert item["position_ids"].tolist()[6] == 0  # the second example starts at position 0
    assert _labels_text(tok, item)[0] == "a0\na1\na2\na3\n"  # answers; no label crosses into the next example
