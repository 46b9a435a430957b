"""``kc config show|validate``: exit codes, messages `FILE: dotted.path: message`, nothing started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from kuangchao.cli.config_cmd import register
from kuangchao_core.config.safe_yaml import MAX_FILE_BYTES

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"


def make_app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """Test root."""

    register(app)
    return app


def invoke(*args: str):
    return CliRunner().invoke(make_app(), ["config", *args])


def test_validate_ok():
    path = str(CONFIGS / "tiny.yaml")
    result = invoke("validate", path)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"ok: {path} (world size 2)"


def test_validate_with_set_changes_world_size():
    path = str(CONFIGS / "tiny.yaml")
    result = invoke("validate", path, "--set", "parallel.data_parallel_size=1", "--set", "cluster.nproc_per_node=1")
    assert result.exit_code == 0, result.output
    assert "(world size 1)" in result.stdout


def test_show_prints_resolved_yaml():
    result = invoke("show", str(CONFIGS / "finetune-extends.yaml"), "--set", "optimizer.lr=7e-4")
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.stdout)
    assert shown["task"]["name"] == "kc-finetune-extends"
    assert shown["optimizer"]["lr"] == 7e-4
    assert shown["parallel"]["micro_batch_size"] == 8  # from base.yaml
    assert shown["model"]["hidden_size"] == 64  # filled from the tiny preset
    assert "extends" not in shown


def _bomb() -> str:
    lines = ["task: {name: bomb}", "l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 7)]
    return "\n".join(lines) + "\n"


CASES = {
    "unknown_key": (
        {"job.yaml": "task: {name: j}\noptimizer: {lr: 1e-3, momentum: 0.9}\n"},
        "optimizer.momentum",
        "unknown key",
    ),
    "wrong_type": ({"job.yaml": "task: {name: j}\ntrain: {steps: lots}\n"}, "train.steps", "integer"),
    "duplicate_key": (
        {"job.yaml": "task: {name: j}\ntrain:\n  steps: 3\n  steps: 4\n"},
        "train.steps",
        "duplicate key at line 4 (first set at line 3)",
    ),
    "world_size": (
        {
            "job.yaml": "task: {name: j}\nparallel: {data_parallel_size: 2, tensor_parallel_size: 2}\ncluster: {nproc_per_node: 2}\n"
        },
        "parallel.data_parallel_size",
        "2×2×1 = 4",
    ),
    "extends_cycle": (
        {"job.yaml": "extends: other.yaml\ntask: {name: j}\n", "other.yaml": "extends: job.yaml\n"},
        "extends",
        "cycle",
    ),
    "missing_base": ({"job.yaml": "extends: gone.yaml\ntask: {name: j}\n"}, "extends", "'gone.yaml' not found"),
    "oversized": ({"job.yaml": "task: {name: j}\n" + "#" * (MAX_FILE_BYTES + 1) + "\n"}, "(file)", "byte limit"),
    "alias_bomb": ({"job.yaml": _bomb()}, "l4", "aliases expand"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_validate_errors_exit_2_with_dotted_path(tmp_path, case):
    files, where, fragment = CASES[case]
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    path = str(tmp_path / "job.yaml")
    for command in ("validate", "show"):
        result = invoke(command, path)
        assert result.exit_code == 2, result.output
        assert result.stdout == ""
        lines = [line for line in result.stderr.splitlines() if line.startswith(f"{path}: {where}: ")]
        assert lines and fragment in lines[0], result.stderr


def test_missing_file_exit_2(tmp_path):
    path = str(tmp_path / "nope.yaml")
    result = invoke("validate", path)
    assert result.exit_code == 2
    assert f"{path}: (file): file not found" in result.stderr


def test_unknown_set_path_exit_2():
    path = str(CONFIGS / "tiny.yaml")
    result = invoke("validate", path, "--set", "parallel.tensor_parallel=2")
    assert result.exit_code == 2
    assert f"{path}: parallel.tensor_parallel: unknown setting" in result.stderr
    assert "did you mean 'tensor_parallel_size'" in result.stderr


def test_every_error_is_printed(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("task: {name: j}\ntrain: {steps: 0}\noptimizer: {lr: 0}\nlogging: {level: chatty}\n")
    result = invoke("validate", str(path))
    assert result.exit_code == 2
    for where in ("train.steps", "optimizer.lr", "logging.level"):
        assert f"{path}: {where}: " in result.stderr


def test_real_kc_entry_point_starts_nothing(tmp_path):
    """The installed `kc` validates the original example and a broken file; the working directory stays empty."""
    kc = Path(sys.executable).parent / "kc"
    assert kc.exists(), "the kc console script is installed with the package (make setup)"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = subprocess.run(
        [str(kc), "config", "validate", str(CONFIGS / "llama3-8b-finetune.yaml")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert ok.returncode == 0, ok.stderr
    assert "(world size 16)" in ok.stdout
    bad = tmp_path.parent / f"{tmp_path.name}-bad.yaml"
    bad.write_text("task: {name: j}\nparallel: {zero_stage: 5}\n")
    failed = subprocess.run(
        [str(kc), "config", "validate", str(bad)], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
    )
    assert failed.returncode == 2
    assert f"{bad}: parallel.zero_stage: " in failed.stderr
    assert list(tmp_path.iterdir()) == []  # no checkpoints, no mlflow.db, no logs
