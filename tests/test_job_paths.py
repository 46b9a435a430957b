"""Issue 32 §8: every path a job uses is made absolute once, from where ``kc train`` ran, and a process started in
another working directory (a node agent, a Slurm task) finds the run's config and every path in it."""

from __future__ import annotations

import json
import subprocess
import sys

from kuangchao_core.config import load_config
from kuangchao_core.config.paths import make_paths_absolute, relative_paths
from kuangchao_core.job.prepare import make_run_dir
from tests.conftest_prefect import TINY

RELATIVE = [
    "task.name=kc-paths",
    "checkpoint.dir=ckpt",
    "data.path=corpus/train.txt",
    "data.format=txt",
    "data.cache_dir=cache",
    "data.eval_path=corpus/eval.txt",
    "permission.audit_log=audit",
    "logging.json_file=logs/kc.jsonl",
    "tracking.uri=sqlite:///store/mlflow.db",
    "data.tokenizer=tok.json",
]


def test_relative_paths_become_absolute_under_the_submit_directory(tmp_path):
    (tmp_path / "tok.json").write_text("{}")  # a tokenizer file that exists here: resolved too
    cfg = load_config(TINY, RELATIVE)
    assert set(relative_paths(cfg)) >= {"checkpoint.dir", "data.path", "tracking.uri"}
    changed = make_paths_absolute(cfg, tmp_path)
    assert relative_paths(cfg) == []
    assert "data.tokenizer" in changed and cfg.data.tokenizer == str(tmp_path / "tok.json")
    assert cfg.checkpoint.dir == str(tmp_path / "ckpt")
    assert cfg.data.path == str(tmp_path / "corpus/train.txt")
    assert cfg.permission.audit_log == str(tmp_path / "audit")
    assert cfg.tracking.uri == f"sqlite:///{tmp_path}/store/mlflow.db"
    # names that are not paths stay as they are
    other = load_config(TINY, ["tracking.uri=http://mlflow:5000", "checkpoint.dir=/abs/ckpt"])
    make_paths_absolute(other, tmp_path)
    assert other.tracking.uri == "http://mlflow:5000" and other.checkpoint.dir == "/abs/ckpt"
    assert other.data.tokenizer == "byte"


def test_a_process_in_another_directory_finds_the_run_and_its_paths(tmp_path, monkeypatch):
    submit, elsewhere = tmp_path / "submit", tmp_path / "elsewhere"
    (submit / "corpus").mkdir(parents=True)
    elsewhere.mkdir()
    (submit / "corpus" / "train.txt").write_text("hello\n")
    monkeypatch.chdir(submit)
    monkeypatch.setenv("KC_RUNS_DIR", "runs")  # relative, as by default
    cfg = load_config(TINY, RELATIVE)
    make_paths_absolute(cfg)
    run_dir = make_run_dir(cfg, "flowrun1")
    assert run_dir.is_absolute() and run_dir.is_relative_to(submit / "runs")
    resolved = run_dir / "config.yaml"
    resolved.write_text(cfg.to_yaml(), encoding="utf-8")
    probe = (
        "import json, sys; from pathlib import Path; from kuangchao_core.config import load_config\n"
        "cfg = load_config(sys.argv[1])\n"
        "print(json.dumps({'data': Path(cfg.data.path).read_text(), 'ckpt': cfg.checkpoint.dir}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(resolved)], cwd=elsewhere, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"data": "hello\n", "ckpt": str(submit / "ckpt")}
