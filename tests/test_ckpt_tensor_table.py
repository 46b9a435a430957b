"""Shard headers against the manifest's tensor table (issue 16, "Checkpoints"): the writer records each shard's
tensor names, dtypes and shapes; ``verify_checkpoint`` reads every shard's safetensors header (bounded, parsed by
hand) and reports each difference — even when whoever changed the shard also fixed its sha256 in the manifest —
so the step is not intact, ``find_latest_intact`` uses the previous one and ``kc checkpoint verify`` exits 1."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from kuangchao.cli.main import app
from kuangchao_core.ckpt.header import MAX_HEADER_BYTES, HeaderError, parse_header
from kuangchao_core.ckpt.integrity import find_latest_intact, read_manifest, verify_checkpoint
from kuangchao_core.ckpt.rng import capture_rng_state
from kuangchao_core.ckpt.writer import CheckpointWriter

TASK = "tabled"
SHARD = "shards/rank_00000.safetensors"


pytestmark = pytest.mark.usefixtures("trusted")


def _save(root: Path, step: int) -> Path:
    """A real one-rank step through the engine's writer: a 64x32 fp32 weight, an int64 counter."""
    writer = CheckpointWriter(root, TASK, 0, 1, barrier=lambda: None)
    return writer.save(
        step,
        {"param.w": torch.full((64, 32), float(step)), "optim.w.step": torch.tensor([step], dtype=torch.int64)},
        capture_rng_state(),
        state={},
        meta={"model": {}, "parallel": {}},
    )


def _fix_hash(step_dir: Path, data: bytes, drop_table: bool = False) -> None:
    """Record the shard's new sha256 and size in the manifest, as a converter bug or an attacker would."""
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"][SHARD] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    if drop_table:  # what a version-1 manifest looks like
        manifest["format_version"] = 1
        del manifest["tensor_table"]
    path.write_text(json.dumps(manifest))


def _resave(step_dir: Path, change, drop_table: bool = False) -> None:
    """Re-save the shard with ``change(tensors)`` applied (metadata kept) and fix its hash in the manifest."""
    shard = step_dir / SHARD
    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    change(tensors)
    save_file(tensors, str(shard), metadata=meta)
    _fix_hash(step_dir, shard.read_bytes(), drop_table)


def _raw(step_dir: Path, header_len: int, header: bytes, body: bytes) -> None:
    """Replace the shard by hand-made bytes (length prefix, header, data) and fix its hash."""
    data = struct.pack("<Q", header_len) + header + body
    (step_dir / SHARD).write_bytes(data)
    _fix_hash(step_dir, data)


def _as_f64(t):
    t["param.w"] = t["param.w"].to(torch.float64)


def _reshaped(t):
    t["param.w"] = t["param.w"][:, :16].contiguous()


def _extra(t):
    t["param.smuggled"] = torch.zeros(2)


def _missing(t):
    del t["optim.w.step"]


def test_the_writer_records_each_tensor_dtype_and_shape_and_an_untouched_step_verifies(tmp_path):
    step = _save(tmp_path, 2)
    manifest = read_manifest(step)
    assert manifest["format_version"] == 2
    assert manifest["tensor_table"] == {
        SHARD: {"optim.w.step": {"dtype": "I64", "shape": [1]}, "param.w": {"dtype": "F32", "shape": [64, 32]}}
    }
    assert verify_checkpoint(step) == []  # the control of every test below
    out = CliRunner().invoke(app, ["checkpoint", "verify", str(step)])
    assert out.exit_code == 0 and out.output.startswith("OK"), out.output


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (_as_f64, "tensor 'param.w' has dtype F64, the manifest says F32"),
        (_reshaped, "tensor 'param.w' has shape [64, 16], the manifest says [64, 32]"),
        (_extra, "tensor 'param.smuggled' is in the file but not in the manifest's tensor table"),
        (_missing, "tensor 'optim.w.step' is in the manifest's tensor table but not in the file"),
    ],
)
def test_a_shard_unlike_its_tensor_table_is_not_intact_even_with_its_hash_fixed(tmp_path, change, needle):
    previous = _save(tmp_path, 2)
    newest = _save(tmp_path, 4)
    _resave(newest, change)
    problems = verify_checkpoint(newest)
    assert not any("sha256" in p or "size" in p for p in problems), problems  # the hash check alone passes
    assert f"{SHARD}: {needle}" in problems, problems
    assert find_latest_intact(newest.parent) == previous
    out = CliRunner().invoke(app, ["checkpoint", "verify", str(newest)])
    assert out.exit_code == 1 and needle in out.output and "CORRUPT" in out.output, out.output
    assert out.exception is None or isinstance(out.exception, SystemExit)


@pytest.mark.parametrize(
    ("header_len", "header", "needle"),
    [
        (2**63, b"{}", f"header length {2**63} exceeds the limit {MAX_HEADER_BYTES}"),
        (1 << 20, b"{}", "runs past the end"),
        (2, b"[]", "header is a JSON list, not an object"),
        (3, b"{x}", "not valid JSON"),
    ],
)
def test_a_malformed_header_is_a_problem_never_an_exception(tmp_path, header_len, header, needle):
    step = _save(tmp_path, 2)
    _raw(step, header_len, header, b"\0" * 64)
    problems = verify_checkpoint(step)
    assert any(p.startswith(f"{SHARD}: bad safetensors header") and needle in p for p in problems), problems


def test_data_offsets_outside_the_file_are_a_problem_naming_the_tensor(tmp_path):
    step = _save(tmp_path, 2)
    table = {
        "param.w": {"dtype": "F32", "shape": [64, 32], "data_offsets": [0, 64 * 32 * 4]},
        "optim.w.step": {"dtype": "I64", "shape": [1], "data_offsets": [64 * 32 * 4, 64 * 32 * 4 + 8]},
    }
    header = json.dumps(table).encode()
    _raw(step, len(header), header, b"\0" * 100)  # the header promises 8200 data bytes; the file has 100
    problems = verify_checkpoint(step)
    assert any("'param.w'" in p and "outside the 100 data bytes" in p for p in problems), problems
    _raw(step, len(header), header, b"\0" * (64 * 32 * 4 + 8))  # the control: the same header, bytes all there
    assert verify_checkpoint(step) == []


def test_a_version_1_manifest_still_verifies_by_hash_only(tmp_path):
    step = _save(tmp_path, 2)
    _resave(step, _as_f64, drop_table=True)  # no table to compare with: the fixed hash is all there is
    assert read_manifest(step)["format_version"] == 1
    assert verify_checkpoint(step) == []
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["format_version"] = 2  # the control: a version-2 manifest must have its table
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert any("no 'tensor_table'" in p for p in verify_checkpoint(step))


def test_parse_header_bounds():
    good = json.dumps({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}, "__metadata__": {}}).encode()
    prefix = struct.pack("<Q", len(good)) + good
    assert parse_header(prefix, len(prefix) + 4) == {"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}
    wide = json.dumps({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 6]}}).encode()
    with pytest.raises(HeaderError, match="span 6 bytes, but F16 \\[2\\] needs 4"):  # span unlike dtype x shape
        parse_header(struct.pack("<Q", len(wide)) + wide, len(wide) + 8 + 6)
    with pytest.raises(HeaderError, match="too short"):
        parse_header(b"\1\0", 2)
    bad = json.dumps({"a": {"dtype": "F16", "shape": [-2], "data_offsets": [0, 4]}}).encode()
    with pytest.raises(HeaderError, match="non-negative"):
        parse_header(struct.pack("<Q", len(bad)) + bad, len(bad) + 12)
