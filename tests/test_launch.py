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
    # nothing of this process's own stores: an MLflow URI set by an earlier test in this process (mlflow's
    # set_tracking_uri exports MLFLOW_TRACKING_URI) would send `kc audit` to another store
    dropped = ("KC_TOKEN", "KC_TRACKING_URI", "MLFLOW_TRACKING_URI")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
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
    _pins_outside_the_run_and_a_sealed_tail(kc, tmp_path, run_dir, log, records)


def _pins_outside_the_run_and_a_sealed_tail(kc, tmp_path: Path, run_dir: Path, log: Path, records: list) -> None:
    """Issue 26: `kc launch` pins its job where `kc audit --verify` looks by default (an MLflow run of its own in the
    config's tracking.uri, here ./mlflow.db) and seals the log as its last act, so the run verifies without --pins
    and a forged tail fails. Before, its pins were only in the run directory: the verdict was no_pins, unsealed."""
    import json

    from mlflow.tracking import MlflowClient

    from kuangchao_core.perm.audit import AuditLog
    from kuangchao_core.perm.audit_chain import record_hash
    from kuangchao_core.perm.audit_pins import MLFLOW_PIN_TAG
    from kuangchao_core.perm.tokens import canonical_json

    job_id = (run_dir / "job_id").read_text().strip()
    assert records[-1]["action"] == "audit_seal", "the job sealed its log as its last act"
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [pin_run] = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert pin_run.data.tags["kuangchao.job_id"] == job_id and pin_run.info.status == "FINISHED"
    pin = json.loads(pin_run.data.tags[MLFLOW_PIN_TAG])
    assert pin["sealed"] and pin["seq"] == len(records) and pin["run_dir"] == str(run_dir.resolve())

    def verify() -> subprocess.CompletedProcess:
        return subprocess.run(
            [*kc, "audit", "--verify", "--run", str(run_dir)],
            cwd=tmp_path,
            env=_env(tmp_path),
            capture_output=True,
            text=True,
        )

    check = verify()
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"OK {log}" in check.stdout and "pinned head seq" in check.stdout, check.stdout
    original = log.read_text()
    forger = AuditLog(log, job_id)  # the chain is unkeyed: anyone who can write the log can extend it
    forger.append("all_reduce", actor="worker-1", decision="allow", resource="group:world", reason="first_use")
    forger.close()
    appended = verify()
    assert appended.returncode == 1 and "after_seal" in appended.stdout, appended.stdout
    lines = original.splitlines(keepends=True)
    i = len(lines) - 2  # the last record before the seal, its decision flipped and the chain re-hashed from it
    prev = json.loads(lines[i - 1])["hash"]
    for j in range(i, len(lines)):
        rec = json.loads(lines[j])
        if j == i:
            rec["decision"] = "deny" if rec["decision"] != "deny" else "allow"
        rec["prev_hash"] = prev
        rec["hash"] = prev = record_hash(prev, {k: v for k, v in rec.items() if k != "hash"})
        lines[j] = canonical_json(rec).decode() + "\n"
    log.write_text("".join(lines))
    edited = verify()
    assert edited.returncode == 1 and "TAMPERED" in edited.stdout, edited.stdout


def test_without_a_launcher_the_denial_says_how_to_run_and_trusted_runs_loudly(tmp_path, free_port):
    # one rank, the environment torchrun would give it
    env = {**_env(tmp_path), "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port)}
    bare = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert bare.returncode != 0
    assert "PermissionDenied" in bare.stderr and "kc launch" in bare.stderr and "trusted=True" in bare.stderr
    trusted = subprocess.run(
        [sys.executable, str(SCRIPT), "--trusted"], env=env, capture_output=True, text=True, timeout=120
    )
    assert trusted.returncode == 0, trusted.stderr[-2000:]
    assert "rank 0: [1.0, 1.0, 1.0, 1.0]" in trusted.stdout and "capability checks are OFF" in trusted.stderr
