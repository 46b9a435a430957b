"""Bounded readers (issue 26 item 4): no file or record an outsider can place breaks a reader.

- Deeply nested JSON (100 000 ``[``) in any checkpoint file — manifest, state, RNG, safetensors header or its
  kuangchao metadata, ``BAD.json``, ``lineage.json`` — makes that step "not intact" with a reason, and the resume
  planner uses the previous step; it used to raise ``RecursionError`` out of ``plan_resume`` (stopping
  ``--resume auto`` for the whole task) or pass verification and fail at load. ``kc debug checkpoint`` and
  ``kc checkpoint convert`` say what is wrong instead of printing a traceback.
- The bounded JSON reader itself: depth and size limits, strings and escapes skipped, never a RecursionError.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kuangchao.cli.main import app
from kuangchao_core.ckpt.integrity import verify_checkpoint
from kuangchao_core.ckpt.layout import LINEAGE_FILE, MANIFEST, META_SLICES, STATE, rng_name, shard_name
from kuangchao_core.ckpt.lineage import create_lineage, plan_resume
from kuangchao_core.ckpt.writer import CheckpointWriter
from kuangchao_core.config.bounded_json import (
    BoundedJSONError,
    loads_bounded,
    max_nesting,
    read_json_file,
    read_json_object,
)
from kuangchao_core.config.settings import lineage_key
from kuangchao_core.errors import DataError, KuangchaoError
from tests.engine_helpers import tiny_job

DEEP = "[" * 100_000 + "]" * 100_000


pytestmark = pytest.mark.usefixtures("trusted")


# ------------------------------------------------------------------------------------------ the reader itself


def test_the_reader_refuses_deep_nesting_without_recursion_and_keeps_strings_apart():
    assert loads_bounded("[" * 64 + "]" * 64, max_depth=64) is not None
    with pytest.raises(BoundedJSONError, match="65 levels deep"):
        loads_bounded("[" * 65 + "]" * 65, max_depth=64)
    for hostile in (DEEP, "[" * 100_000, '{"a":' * 100_000):
        with pytest.raises(BoundedJSONError) as exc:
            loads_bounded(hostile)
        assert isinstance(exc.value, KuangchaoError) and isinstance(exc.value, ValueError)
        assert "levels deep" in exc.value.reason
    # brackets inside strings, escaped quotes and escaped backslashes are not nesting
    value = {"a": '[[[[\\"{{{{', "b": ["x\\"], "c": '"]]]]'}
    assert loads_bounded(json.dumps(value), max_depth=2) == value
    assert max_nesting(json.dumps(value)) == 2
    assert max_nesting(b"[" * (1 << 23)) == 1 << 23  # the long-input path (chunked) counts across chunks


def test_the_reader_refuses_size_bad_utf8_and_bad_json_with_one_error_type(tmp_path):
    with pytest.raises(BoundedJSONError, match="more than the limit of 10"):
        loads_bounded("[" + "1," * 10 + "1]", max_bytes=10)
    with pytest.raises(BoundedJSONError, match="not UTF-8"):
        loads_bounded(b'{"a": "\xff"}')
    with pytest.raises(BoundedJSONError, match="not valid JSON"):
        loads_bounded("{'a': 1}")
    big = tmp_path / "big.json"
    big.write_bytes(b"[" + b"1," * 1000 + b"1]")
    with pytest.raises(BoundedJSONError, match="larger than the limit of 100 bytes") as exc:
        read_json_file(big, max_bytes=100)
    assert str(big) in str(exc.value)
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(BoundedJSONError, match="not an object"):
        read_json_object(tmp_path / "list.json")
    with pytest.raises(FileNotFoundError):
        read_json_file(tmp_path / "missing.json")


# ------------------------------------------------------------------------------------------ checkpoints


def _cfg(tmp_path: Path):
    return tiny_job(str(tmp_path), task={"name": "deep", "seed": 7})


def _save(cfg, lineage: str, step: int) -> Path:
    writer = CheckpointWriter(cfg.checkpoint.dir, cfg.task.name, 0, 1, barrier=lambda: None, lineage=lineage)
    return writer.save(
        step,
        {"param.w": torch.full((4, 4), float(step))},
        rng_state={"seed": step},
        state={"step": step},
        slices={"param.w": {"full_shape": [4, 4], "offsets": [0, 0], "shape": [4, 4]}},
    )


def _replace_listed(step_dir: Path, rel: str, data: bytes) -> None:
    """Replace a listed file and fix its sha256 and size in the manifest, as an attacker with the directory can."""
    (step_dir / rel).write_bytes(data)
    manifest = json.loads((step_dir / MANIFEST).read_text())
    manifest["files"][rel].update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


def _shard_with_header(step_dir: Path, header: bytes) -> bytes:
    """The rank-0 shard with its header JSON replaced by ``header`` (the tensor bytes kept)."""
    raw = (step_dir / shard_name(0)).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return struct.pack("<Q", len(header)) + header + raw[8 + n :]


def _deep_manifest(step_dir: Path) -> None:
    (step_dir / MANIFEST).write_text(DEEP)


def _deep_state(step_dir: Path) -> None:
    _replace_listed(step_dir, STATE, DEEP.encode())


def _deep_rng(step_dir: Path) -> None:
    _replace_listed(step_dir, rng_name(0), ('{"seed": ' + DEEP + "}").encode())


def _deep_header(step_dir: Path) -> None:
    _replace_listed(step_dir, shard_name(0), _shard_with_header(step_dir, DEEP.encode()))


def _deep_slices_metadata(step_dir: Path) -> None:
    raw = (step_dir / shard_name(0)).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"][META_SLICES] = DEEP  # a string in the header, JSON the reader parses later
    _replace_listed(step_dir, shard_name(0), _shard_with_header(step_dir, json.dumps(header).encode()))


def _deep_bad_mark(step_dir: Path) -> None:
    (step_dir / "BAD.json").write_text(DEEP)


ATTACKS = {
    "manifest": (_deep_manifest, "manifest.json refused"),
    "state": (_deep_state, "state.json: refused"),
    "rng": (_deep_rng, f"{rng_name(0)}: refused"),
    "header": (_deep_header, "bad safetensors header (header refused"),
    "slices-metadata": (_deep_slices_metadata, "'kuangchao.slices' refused"),
    "bad-mark": (_deep_bad_mark, "marked bad"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_deep_json_in_any_checkpoint_file_skips_that_step_and_resume_uses_the_previous(tmp_path, attack, caplog):
    cfg = _cfg(tmp_path)
    lineage = plan_resume(lineage_key(cfg), "never").lineage
    create_lineage(lineage_key(cfg), lineage)
    good = _save(cfg, lineage, 2)
    bad = _save(cfg, lineage, 4)
    assert plan_resume(lineage_key(cfg), "auto").step == 4  # the control: the newest step is used before the attack
    change, reason = ATTACKS[attack]
    change(bad)
    problems = verify_checkpoint(bad)
    assert any(reason in p for p in problems), problems
    assert any("levels deep" in p for p in problems) or attack == "bad-mark", problems
    with caplog.at_level(logging.WARNING, logger="kuangchao.ckpt"):
        plan = plan_resume(lineage_key(cfg), "auto")
    assert (plan.lineage, plan.step, plan.step_dir, plan.new) == (lineage, 2, str(good), False)
    assert any("step_00000004" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_deep_json_in_lineage_json_does_not_stop_the_planner(tmp_path):
    cfg = _cfg(tmp_path)
    older = plan_resume(lineage_key(cfg), "never").lineage
    create_lineage(lineage_key(cfg), older)
    _save(cfg, older, 2)
    newer = plan_resume(lineage_key(cfg), "never").lineage
    create_lineage(lineage_key(cfg), newer)
    _save(cfg, newer, 6)
    lineage_file = Path(cfg.checkpoint.dir) / cfg.task.name / newer / LINEAGE_FILE
    lineage_file.write_text(DEEP)  # it used to raise RecursionError out of plan_resume for the whole task
    plan = plan_resume(lineage_key(cfg), "auto")
    assert plan.step in (2, 6) and plan.step_dir is not None
    lineage_file.write_text("[1, 2]")  # valid JSON that is not an object: unreadable, not an AttributeError
    assert plan_resume(lineage_key(cfg), "auto").step_dir is not None


def _cli(args: list[str]):
    return CliRunner().invoke(app, args)


def _no_traceback(res) -> None:
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output and "RecursionError" not in res.output


@pytest.mark.parametrize("attack", ["manifest", "state", "slices-metadata"])
def test_kc_debug_checkpoint_and_convert_report_deep_json_without_a_traceback(tmp_path, attack):
    cfg = _cfg(tmp_path)
    lineage = plan_resume(lineage_key(cfg), "never").lineage
    create_lineage(lineage_key(cfg), lineage)
    step = _save(cfg, lineage, 2)
    change, reason = ATTACKS[attack]
    change(step)
    res = _cli(["debug", "checkpoint", str(step)])
    _no_traceback(res)
    assert res.exit_code == 1 and reason in res.output, res.output
    res = _cli(["checkpoint", "convert", str(step), str(tmp_path / "out"), "--parallel", "tp=1,pp=1"])
    _no_traceback(res)
    assert res.exit_code == 1 and reason in res.output, res.output
    res = _cli(["checkpoint", "list", str(Path(cfg.checkpoint.dir) / cfg.task.name)])
    _no_traceback(res)
    assert "corrupt" in res.output


# ------------------------------------------------------------------------------------------ data records


def _data_cfg(tmp_path: Path, path: Path, fmt: str = "auto", txt_documents: str = "file"):
    from kuangchao_core.config import config_from_dict

    return config_from_dict(
        {
            "task": {"name": "gate"},
            "model": {"preset": "tiny"},
            "data": {"path": str(path), "seq_len": 16, "format": fmt, "txt_documents": txt_documents},
            "train": {"steps": 1},
            "checkpoint": {"dir": str(tmp_path / "ckpt")},
        }
    )


@pytest.mark.parametrize("fmt", ["auto", "sft"])
def test_a_deeply_nested_json_lines_record_is_refused_by_the_gate_naming_file_and_line(tmp_path, fmt):
    from kuangchao_core.data import validation as V

    path = tmp_path / "d.jsonl"
    good = {"text": "a fine record"} if fmt == "auto" else {"prompt": "2+2?", "completion": "4"}
    deep = '{"text": "x", "meta": ' + DEEP + "}"
    path.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n" + deep + "\n")
    with pytest.raises(DataError) as exc:  # it used to raise RecursionError out of the gate
        V.validate_dataset(_data_cfg(tmp_path, path, fmt))
    assert "d.jsonl:3" in str(exc.value) and "levels deep" in str(exc.value)


def test_text_documents_are_split_as_before_and_named_by_file_and_line(tmp_path):
    import re

    from kuangchao_core.data.files import read_documents, read_txt

    def reference(data: bytes) -> list[bytes]:  # the splitting read_txt always had, on the whole file
        blocks = (b.strip(b"\r\n") for b in re.split(rb"\r?\n(?:[ \t]*\r?\n)+", data))
        return [b for b in blocks if b.strip()]

    samples = [
        b"first doc\nline two\n\n  \nsecond doc\n",
        b"\n\nlead\r\n\r\n\t \r\nafter crlf\r\n",
        b"  \nleading spaces line\n\n\n",
        b"A\r\r\n\nB",
        b"one\n \n",
        b"no newline at all",
        b"doc\n   ",
        b"x" * 3_000_000 + b"\n\n" + b"y",
    ]
    for i, data in enumerate(samples):
        path = tmp_path / f"s{i}.txt"
        path.write_bytes(data)
        assert [raw for raw, _ in read_txt(path, txt_documents="blank_lines")] == reference(data), data[:40]
    path = tmp_path / "named.txt"
    path.write_bytes(b"one\n\ntwo\nlines\n\n\n" + b"z" * 5000 + b"\n\nlast\n")
    blank = {"txt_documents": "blank_lines"}  # the blank-line rule (before issue 39); a whole file is never refused
    assert [where for _, where in read_txt(path, **blank)] == [f"{path}:1", f"{path}:3", f"{path}:7", f"{path}:9"]
    with pytest.raises(DataError, match=r"named\.txt:7: a record of 5000 bytes, more than the limit of 4096"):
        list(read_documents(path, max_record_bytes=4096, **blank))
    jl = tmp_path / "big.jsonl"
    jl.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": "q" * 100_000}) + "\n")
    with pytest.raises(DataError, match=r"big\.jsonl:2: a record of"):
        list(read_documents(jl, max_record_bytes=1000))


_GATE_READ = """
import json, resource, sys, time
from kuangchao_core.config import config_from_dict
from kuangchao_core.data import validation as V
cfg = config_from_dict({"task": {"name": "big"}, "model": {"preset": "tiny"},
                        "data": {"path": sys.argv[1], "seq_len": 16, "txt_documents": "blank_lines"},
                        "train": {"steps": 1}})
def raw_pass():  # one plain pass over the bytes, 1 MiB at a time, keeping nothing
    start = time.monotonic()
    with open(sys.argv[1], "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass
    return time.monotonic() - start
raw_pass()  # the first read of a fresh file fills the page cache (seconds on a VM): both timed passes find it warm
raw = raw_pass()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the interpreter and its imports
start = time.monotonic()
records, _ = V.load_records(cfg.data)  # the gate's reader, with the gate's max_record_bytes
elapsed = time.monotonic() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": elapsed, "raw_seconds": raw, "peak_bytes": peak, "read_bytes": peak - before, "records": [repr(r)[:80] for r in records]}))
"""


def test_a_1_gib_single_line_text_file_is_refused_fast_with_bounded_memory(tmp_path):
    import subprocess
    import sys

    big = tmp_path / "big.txt"  # one 1 GiB line: 64 MiB of text at each end, a sparse hole (NUL bytes) between
    chunk = b"a" * (64 << 20)
    with open(big, "wb") as f:
        f.write(chunk)
        f.seek((1 << 30) - len(chunk))
        f.write(chunk)
    del chunk
    assert big.stat().st_size == 1 << 30
    out = subprocess.run(
        [sys.executable, "-c", _GATE_READ, str(big)], capture_output=True, text=True, timeout=120, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # it used to read the file whole and split it: 6.8 GB and 116 s before the size check
    assert got["records"] == [f"Oversize(n_bytes={1 << 30}, limit={1 << 20})"]
    assert got["read_bytes"] < 500 << 20, got  # what the read added on top of the imports (which vary by machine)
    # one pass in 1 MiB pieces: a few Python calls per MiB on top of a plain read of the same bytes
    assert got["seconds"] < 5 * got["raw_seconds"] + 2, got
    print(
        f"1 GiB one-line file refused in {got['seconds']:.2f} s (a plain read: {got['raw_seconds']:.2f} s), "
        f"peak RSS {got['peak_bytes'] / 2**20:.0f} MiB"
    )


def test_the_gate_refuses_nul_escape_sequences_and_oversize_records_naming_file_and_line(tmp_path):
    from kuangchao_core.data import validation as V

    words = ["tide", "river", "stone", "wind", "lamp", "cloud", "field", "ember", "shore", "quartz"]
    docs = [" ".join(words[(i + j) % 10] for j in range(12)) + f" #{i}" for i in range(60)]
    data = tmp_path / "corpus"
    data.mkdir()
    text = "\n\n".join(docs[:20]) + "\n\nplain start\nred \x1b[31malert\x1b[0m here\n\n" + "\r\n\r\n".join(docs[20:30])
    (data / "a.txt").write_bytes(text.encode())  # the ESC document starts on line 41, the ESC is on line 42
    rows = [json.dumps({"text": d}) for d in docs[30:59]] + [json.dumps({"text": "nul \u0000 inside"})]
    (data / "b.jsonl").write_text("\n".join(rows) + "\n")
    (data / "c.txt").write_text(docs[59] + "\n\n" + "o" * 5000 + "\n")
    cfg = _data_cfg(tmp_path, data, txt_documents="blank_lines")  # whole files (the default) are cut, not refused
    report = V.validate_dataset(cfg, max_record_bytes=4096)
    assert {r.name for r in report.failed} == {"no_control_chars", "no_oversize_records"}, report.summary
    control = report.result("no_control_chars").detail
    assert f"{data / 'a.txt'}:42: U+001B" in control and f"{data / 'b.jsonl'}:30: U+0000" in control, control
    assert report.result("no_control_chars").observed == 2
    assert f"{data / 'c.txt'}:3" in report.result("no_oversize_records").detail
    # CRLF line ends are not control characters; the switch lets data that needs them through
    allowed = V.validate_dataset(cfg, max_record_bytes=1 << 20, allow_control_chars=True)
    assert allowed.success, allowed.summary


# ------------------------------------------------------------------------------------------ other readers


def test_tokens_heartbeats_trust_and_debug_reports_refuse_deep_json_without_recursion_error(tmp_path):
    from kuangchao_core.perm.tokens import TrustStore, strict_json_loads
    from kuangchao_core.sched.heartbeat import read_beat

    with pytest.raises(ValueError):  # a token footer is parsed before its signature is checked
        strict_json_loads(DEEP.encode())
    hostile = tmp_path / "rank_0.json"
    hostile.write_text(DEEP)
    assert read_beat(hostile) is None  # unreadable beat, as a torn one
    with pytest.raises(BoundedJSONError):
        TrustStore.load(hostile)
    res = _cli(["debug", "memory", str(hostile)])
    _no_traceback(res)
    assert res.exit_code == 2 and "levels deep" in res.output, res.output
    res = _cli(["debug", "comm", str(hostile)])
    _no_traceback(res)
    assert res.exit_code == 2 and "levels deep" in res.output, res.output
