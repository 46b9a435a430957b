"""Issue 38 §6: bounded models and checkpoints. A plan past any machine (> 1 PiB per rank) is refused naming the
fields; ``weight_map`` entries stay inside the model directory and are regular files; ``extends:`` through a loop of
symbolic links is a one-line error; a file that several ``extends:`` routes reach is read once.

Each test carries the attack of the review as its negative control: the pre-fix behaviour (the config accepted,
the file outside read, the FIFO opened, the shared base read once per route) is shown to fail the assertion."""

from __future__ import annotations

import pytest

from kuangchao_core.config import loader
from kuangchao_core.config.loader import MAX_EXTENDS_DEPTH, load_config
from kuangchao_core.errors import ConfigError


# ------------------------------------------------------------------------------------------------------ extends
def _counting_reads(monkeypatch) -> dict[str, int]:
    """Count the files ``extends:`` resolution reads, by name (the real reader, counted)."""
    reads: dict[str, int] = {}
    real = loader.read_text

    def counted(path):
        reads[path.name] = reads.get(path.name, 0) + 1
        return real(path)

    monkeypatch.setattr(loader, "read_text", counted)
    return reads


def test_an_extends_symlink_loop_is_a_one_line_error_naming_the_file(tmp_path):
    (tmp_path / "a.yaml").symlink_to("b.yaml")
    (tmp_path / "b.yaml").symlink_to("a.yaml")
    (tmp_path / "job.yaml").write_text("extends: a.yaml\ntask: {name: x}\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "job.yaml")
    [(field, message)] = info.value.errors
    assert field == "extends" and "a.yaml" in message and "loop of symbolic links" in message
    assert "\n" not in message
    with pytest.raises(ConfigError) as info:  # the loop named as the config itself
        load_config(tmp_path / "a.yaml")
    [(field, message)] = info.value.errors
    assert field == "(file)" and "a.yaml" in message and "loop of symbolic links" in message


def _fan_out(tmp_path, levels: int) -> None:
    """``top`` extends [l1a, l1b]; every level's two files extend both of the next level's: 2**(levels - 1) routes to
    the last file, 2 * levels + 1 files in all."""
    (tmp_path / f"l{levels}a.yaml").write_text("optimizer: {lr: 1.0e-3}\n")
    (tmp_path / f"l{levels}b.yaml").write_text("train: {steps: 7}\n")
    for level in range(levels - 1, 0, -1):
        bases = f"[l{level + 1}a.yaml, l{level + 1}b.yaml]"
        for side in "ab":
            (tmp_path / f"l{level}{side}.yaml").write_text(f"extends: {bases}\n")
    (tmp_path / "top.yaml").write_text("extends: [l1a.yaml, l1b.yaml]\ntask: {name: fan}\n")


def test_an_exponential_extends_fan_out_reads_each_file_once(tmp_path, monkeypatch):
    levels = MAX_EXTENDS_DEPTH - 1  # the deepest the chain limit allows: 2**14 routes to the last level
    _fan_out(tmp_path, levels)
    reads = _counting_reads(monkeypatch)
    cfg = load_config(tmp_path / "top.yaml")
    assert (cfg.task.name, cfg.train.steps, cfg.optimizer.lr) == ("fan", 7, 1.0e-3)
    assert len(reads) == 2 * levels + 1 and set(reads.values()) == {1}


def test_negative_control_without_the_cache_a_diamond_reads_its_shared_base_once_per_route(tmp_path, monkeypatch):
    levels = 3
    _fan_out(tmp_path, levels)
    reads = _counting_reads(monkeypatch)
    top = (tmp_path / "top.yaml").resolve()
    tree, errors = loader._load_tree(top, [top], top, None)  # the resolution of before: no cache
    assert not errors and tree["train"] == {"steps": 7}
    assert reads[f"l{levels}a.yaml"] == 2 ** (levels - 1)  # what the cache removes (the test above: once)


# ------------------------------------------------------------------------------------------- weight_map entries
def _sharded(d):
    """A tiny Llama as an HF directory of two shards and an index; returns (its LlamaConfig, its state dict)."""
    import torch
    from safetensors.torch import save_file

    from kuangchao_core.models.llama import LlamaForCausalLM
    from tests.fixtures import tiny_llama

    cfg = tiny_llama(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2)
    torch.manual_seed(0)
    state = {k: v.detach().clone().contiguous() for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    names = sorted(state)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    d.mkdir(parents=True)
    for fname, part in shards.items():
        save_file({n: state[n] for n in part}, str(d / fname))
    _write_index(d, {n: f for f, part in shards.items() for n in part})
    return cfg, state


def _write_index(d, weight_map):
    import json

    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _repoint(d, to):
    """Point every ``b.safetensors`` entry of the index at ``to``."""
    import json

    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    _write_index(d, {n: (to if f == "b.safetensors" else f) for n, f in index.items()})


def _outside(tmp_path, d):
    """``b.safetensors`` moved out of the model directory: a real file that the old ``d / name`` read."""
    (d / "b.safetensors").rename(tmp_path / "outside.safetensors")
    return tmp_path / "outside.safetensors"


def test_a_normal_sharded_directory_loads(tmp_path):
    import torch

    from kuangchao_core.ckpt.hf import load_hf_weights_for_layout

    cfg, state = _sharded(tmp_path / "model")
    (tmp_path / "model" / "sub").mkdir()  # a link that stays inside the directory is followed
    (tmp_path / "model" / "b.safetensors").rename(tmp_path / "model" / "sub" / "b.safetensors")
    (tmp_path / "model" / "b.safetensors").symlink_to("sub/b.safetensors")
    got = load_hf_weights_for_layout(tmp_path / "model", cfg)
    assert sorted(got) == sorted(state) and all(torch.equal(got[n], state[n]) for n in state)


@pytest.mark.parametrize("attack", ["dotdot", "absolute", "symlink_out"])
def test_a_weight_map_entry_leading_out_of_the_model_directory_is_refused(tmp_path, attack):
    from safetensors import safe_open

    from kuangchao_core.ckpt.hf import hf_weight_files
    from kuangchao_core.errors import CheckpointError

    d = tmp_path / "model"
    _sharded(d)
    outside = _outside(tmp_path, d)
    entry = {"dotdot": "../outside.safetensors", "absolute": str(outside), "symlink_out": "b.safetensors"}[attack]
    if attack == "symlink_out":
        (d / "b.safetensors").symlink_to(outside)
    else:
        _repoint(d, entry)
    with safe_open(str(d / entry), framework="pt", device="cpu") as h:  # the control: the path of before reads it
        assert len(list(h.keys())) > 0
    with pytest.raises(CheckpointError) as info:
        hf_weight_files(d)
    message = str(info.value)
    assert "weight_map[" in message and "model.safetensors.index.json" in message
    assert ("leads outside the model directory" if attack == "symlink_out" else "not a file inside") in message


def test_a_weight_map_entry_naming_a_fifo_is_refused_without_opening_it(tmp_path):
    import faulthandler
    import os
    import subprocess
    import sys

    from kuangchao_core.ckpt.hf import hf_weight_files
    from kuangchao_core.errors import CheckpointError

    d = tmp_path / "model"
    _sharded(d)
    (d / "b.safetensors").unlink()
    os.mkfifo(d / "b.safetensors")
    # the control, bounded in a process of its own: the reader of before blocks on the FIFO (holding the GIL)
    opener = f"from safetensors import safe_open; safe_open({str(d / 'b.safetensors')!r}, framework='pt')"
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", opener], timeout=1.0, stdin=subprocess.DEVNULL, capture_output=True)
    faulthandler.dump_traceback_later(30, exit=True)  # a regression that opens the FIFO ends the run, never hangs it
    try:
        with pytest.raises(CheckpointError, match="is not a regular file"):
            hf_weight_files(d)
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_a_hub_cache_snapshot_may_link_into_its_own_blobs_only(tmp_path):
    from kuangchao_core.ckpt.hf import hf_weight_files
    from kuangchao_core.errors import CheckpointError

    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "rev1"
    _sharded(snap)
    (repo / "blobs").mkdir()
    for name in ("a.safetensors", "b.safetensors"):  # the Hub's layout: the snapshot's files link to ../../blobs
        (snap / name).rename(repo / "blobs" / f"sha-{name}")
        (snap / name).symlink_to(f"../../blobs/sha-{name}")
    assert {p.name for p in hf_weight_files(snap).values()} == {"sha-a.safetensors", "sha-b.safetensors"}
    (repo / "blobs" / "sha-b.safetensors").rename(tmp_path / "elsewhere.safetensors")  # out of the repository
    (snap / "b.safetensors").unlink()
    (snap / "b.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(CheckpointError, match="leads outside the model directory"):
        hf_weight_files(snap)


# ------------------------------------------------------------------------------------------ a plan past any machine
HUGE = [  # each field within its own cap; together 1.6 PiB per rank (the review's 3.4e9 MiB LLaVA shape is alike)
    "model.preset=null",
    "model.vocab_size=4000000",
    "model.hidden_size=65536",
    "model.intermediate_size=524288",
    "model.num_layers=1000",
    "model.num_heads=512",
    "model.num_kv_heads=8",
]


def test_a_plan_past_any_machine_is_refused_by_kc_plan_and_kc_train_naming_the_fields(tmp_path):
    from typer.testing import CliRunner

    from kuangchao.cli.main import app
    from kuangchao_core.engine.plan import check_plan, raise_for_plan
    from kuangchao_core.engine.plan_bounds import MAX_RANK_BYTES, largest_rank, size_problems
    from kuangchao_core.errors import PlanError
    from tests.conftest_prefect import TINY

    cfg = load_config(TINY, HUGE)
    need = largest_rank(cfg)["memory_bytes"]["total"]
    assert need > MAX_RANK_BYTES
    assert size_problems(cfg, limit=need) == []  # the control: without the bound this plan passed every check
    [(field, message)] = check_plan(cfg)
    assert field == "model"
    for name in ("model.hidden_size 65536", "model.num_layers 1000", "model.vocab_size 4000000", "1 PiB"):
        assert name in message
    with pytest.raises(PlanError) as info:  # kc train's check before launch (job/prepare.py, the worker)
        raise_for_plan(cfg, device_memory=2.0**70)  # refused whatever memory the devices are said to have
    assert [f for f, _ in info.value.errors] == ["model"]
    result = CliRunner().invoke(app, ["plan", "--config", TINY, *[a for s in HUGE for a in ("--set", s)]])
    assert result.exit_code == 2 and "model: rank 0 needs an estimated" in result.output
    ok = load_config(TINY)  # the normal config: accepted and explained
    assert check_plan(ok) == [] and CliRunner().invoke(app, ["plan", "--config", TINY]).exit_code == 0


def test_activations_past_any_machine_are_refused_under_the_sequence_length():
    from kuangchao_core.engine.plan import check_plan
    from tests.conftest_prefect import TINY

    long = ["data.seq_len=4194304", "model.max_seq_len=4194304", "parallel.micro_batch_size=32768"]
    [(field, message)] = check_plan(load_config(TINY, long))
    assert field == "data.seq_len" and "parallel.micro_batch_size 32768" in message
