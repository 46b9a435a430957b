"""`kc launch` (issue 13): the original design's SDK example runs on 2 Gloo ranks under its own tokens; run by
plain torchrun it fails with the message that says how to run it; `kc.init(trusted=True)` runs it without checks,
loudly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kuangchao_core.perm.audit_verify import read_records

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "sdk_example.py"


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KC_TOKEN")}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
        KC_RUNS_DIR=str(tmp_path / "runs"),
        KC_OPERATOR_KEY=str(tmp_path / "operator.key"),
    )
    return env


def test_kc_launch_runs_the_sdk_example_under_each_ranks_token(tmp_path):
    kc = [sys.executable, "-m", "kuangchao.cli.main"]
    out = subprocess.run(
        [*kc, "launch", "--nproc-per-node", "2", str(SCRIPT)],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: [3.0, 3.0, 3.0, 3.0]" in out.stdout  # 1 + 2 on every rank
    [run_dir] = list((tmp_path / "runs" / "launch" / "sdk_example").iterdir())
    texts = [p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file()]
    assert not any("kc1.cap." in t for t in texts), "no token is written for the ranks"
    [log] = list((tmp_path / "audit" / "sdk_example").glob("*.jsonl"))
    records = list(read_records(log))
    loaded = {r["actor"] for r in records if r["action"] == "token_loaded"}
    reduced = {(r["actor"], r["resource"]) for r in records if r["action"] == "all_reduce" and r["decision"] == "allow"}
    assert loaded == {"worker-0", "worker-1"}
    assert reduced == {("worker-0", "group:g1[0,1]"), ("worker-1", "group:g1[0,1]")}  # the script's own group
    check = subprocess.run(
        [*kc, "audit", "--verify", "--run", str(run_dir)], cwd=tmp_path, env=_env(tmp_path), capture_output=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_without_a_launcher_the_denial_says_how_to_run_and_trusted_runs_loudly(tmp_path):
    import socket

    with socket.socket() as s:  # one rank, the environment torchrun would give it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**_env(tmp_path), "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    bare = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert bare.returncode != 0
    assert "PermissionDenied" in bare.stderr and "kc launch" in bare.stderr and "trusted=True" in bare.stderr
    trusted = subprocess.run(
        [sys.executable, str(SCRIPT), "--trusted"], env=env, capture_output=True, text=True, timeout=120
    )
    assert trusted.returncode == 0, trusted.stderr[-2000:]
    assert "rank 0: [1.0, 1.0, 1.0, 1.0]" in trusted.stdout and "capability checks are OFF" in trusted.stderr
