"""Stop-and-resume equals an uninterrupted run, bitwise on CPU (issue 2), with a negative control for RNG."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine_helpers import run_trainer, tiny_job
from tests.mp import run_distributed

STEPS, STOP_AT = 8, 4


def _no_rng_restore():
    import kuangchao_core.engine.checkpointing as checkpointing

    checkpointing.restore_rng_state = lambda state: None


def _job(tmp_path, name):
    # dropout makes the training consume the torch RNG, so a missing RNG restore changes the losses
    return tiny_job(
        str(tmp_path / name),
        model={"preset": "tiny", "dropout": 0.1},
        parallel={"data_parallel_size": 2, "micro_batch_size": 4, "gradient_accumulation_steps": 2, "backend": "gloo"},
        train={"steps": STEPS, "warmup_steps": 2, "device": "cpu"},
        checkpoint={"dir": str(tmp_path / name / "ckpt"), "interval": STOP_AT, "keep_last": 2, "resume": "auto"},
    )


def _interrupted(tmp_path, name, patch=None):
    cfg = _job(tmp_path, name)
    first = run_distributed(run_trainer, 2, args=(cfg, "never", STOP_AT))
    assert len(first[0]["losses"]) == STOP_AT
    return run_distributed(run_trainer, 2, args=(cfg, "auto", None, patch))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run both tests compare with."""
    return run_distributed(run_trainer, 2, args=(_job(tmp_path_factory.mktemp("resume"), "ref"), "never"))


def test_resume_is_bitwise_equal_to_uninterrupted_run(tmp_path, reference):
    resumed = _interrupted(tmp_path, "resumed")
    assert len(reference[0]["losses"]) == STEPS
    assert resumed[0]["losses"] == reference[0]["losses"]  # exact float equality, every step
    for name, value in reference[0]["params"].items():
        assert np.array_equal(resumed[0]["params"][name], value), name
    # both data-parallel replicas agree
    assert resumed[0]["losses"] == resumed[1]["losses"]


def test_negative_control_missing_rng_restore_is_caught(tmp_path, reference):
    broken = _interrupted(tmp_path, "broken", patch=_no_rng_restore)
    assert broken[0]["losses"][:STOP_AT] == reference[0]["losses"][:STOP_AT]
    assert broken[0]["losses"][STOP_AT:] != reference[0]["losses"][STOP_AT:]
