"""A wrong ``data.path`` is refused before any server starts (issue 45 §2).

The attack, as a user met it: ``kc train`` with a ``data.path`` that does not exist reported it after 35–90 s, once
Prefect's temporary server, the doctor and MLflow had started, and left a FAILED MLflow run behind. Here the real
command fails in at most 5 s with one line naming the field and the path, exit 1, and nothing started: no MLflow
store, no Prefect database, no run directory. The fast tests check
:func:`kuangchao_core.data.early_check.check_data_early` on real files, each refusal beside the same data made right
(the control: the check passes what training reads).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kuangchao_core.config import load_config
from kuangchao_core.data.early_check import check_data_early
from kuangchao_core.errors import DataError
from kuangchao_core.obs.voice import message_of

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")


def _data(tmp_path: Path, **data):
    sets = [f"data.{k}={v}" for k, v in data.items()]
    return load_config(TINY, ["data.synthetic.num_train=64", *sets]).data


def test_a_missing_path_or_eval_path_is_refused_naming_its_field(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one document\n\nanother\n")
    check_data_early(_data(tmp_path, format="txt", path=corpus))  # the control
    with pytest.raises(DataError, match=r"^data\.path: .*missing\.txt does not exist"):
        check_data_early(_data(tmp_path, format="txt", path=tmp_path / "missing.txt"))
    with pytest.raises(DataError, match=r"^data\.eval_path: .*held-out\.txt does not exist"):
        check_data_early(_data(tmp_path, format="txt", path=corpus, eval_path=tmp_path / "held-out.txt"))
    with pytest.raises(DataError, match=r"^data\.path: no data files found in glob"):
        check_data_early(_data(tmp_path, format="txt", path=tmp_path / "shards-*.txt"))
    check_data_early(_data(tmp_path))  # the synthetic corpus: nothing to look at


def test_the_first_records_are_read_as_training_reads_them(tmp_path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text('{"text": "a"}\n{"text": "b"}\n')
    bad.write_text('{"text": "a"}\n{"text": "b"\n')  # the second line is cut short
    check_data_early(_data(tmp_path, format="jsonl", path=good))
    with pytest.raises(DataError, match=r"^data\.path: .*bad\.jsonl:2"):
        check_data_early(_data(tmp_path, format="jsonl", path=bad))
    with pytest.raises(DataError, match="body"):  # the field training would read is not there
        check_data_early(_data(tmp_path, format="jsonl", path=good, text_field="body"))
    odd = tmp_path / "corpus.csv"
    odd.write_text("a,b\n")
    with pytest.raises(DataError, match=r"^data\.format: cannot tell the format"):
        check_data_early(_data(tmp_path, format="auto", path=odd))


@pytest.mark.serial  # a 5 s bound from the command's start: the cores to itself
def test_kc_train_with_a_wrong_data_path_fails_in_seconds_with_one_line_and_starts_nothing(tmp_path):
    missing = tmp_path / "no-such-corpus.txt"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "KC_RUNS_DIR": str(tmp_path / "runs"),
    }
    env.pop("PREFECT_API_URL", None)
    sets = {
        "data.format": "txt",
        "data.path": missing,
        "tracking.uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "checkpoint.dir": tmp_path / "ckpt",
        "checkpoint.resume": "never",
        "permission.audit_log": tmp_path / "audit",
    }
    argv = [sys.executable, "-m", "kuangchao.cli.main", "train", "--config", TINY]
    argv += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    started = time.monotonic()
    out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    assert out.returncode == 1 and took <= 5.0, (out.returncode, took, lines)
    assert len(lines) == 1, lines
    assert message_of(lines[0]) == (
        f"kc train failed: data.path: {missing} does not exist; give an existing file, directory or glob pattern"
    )
    assert not (tmp_path / "mlflow.db").exists()  # no MLflow run, not even the store
    assert not (tmp_path / "prefect-home" / "prefect.db").exists()  # no Prefect server was started
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ckpt").exists()
