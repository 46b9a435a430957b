"""Fail once, say why (issue 39 item 4): a fault that repeats identically in the next attempt — the same error at the
same step, as its rank reported it — is not retried a third time, and says so in one line.

The launch is the part replaced here (a function that fails as an attempt would); the restart policy, the failure's
fault taken from the ranks' own ``fault`` events (``note_fault`` on a real ``LiveView``) and the message are the
real ones. Controls: a fault at another step, and a rank that reported nothing (killed), are retried to the limit.
A real flow whose ranks raise at the same step in every attempt (a ``sitecustomize`` hook in the workers only: the
test's stand-in for a deterministic bug) stops after two attempts of the four ``cluster.max_restarts`` allows.
"""

from __future__ import annotations

import io

import pytest

from kuangchao_core.errors import WorkerFailed
from kuangchao_core.job.launch_attempt import note_fault
from kuangchao_core.obs.console import LiveView
from kuangchao_core.obs.jsonlog import emit_event
from kuangchao_core.sched.recovery import RestartPolicy, supervise

POLICY = RestartPolicy(max_restarts=4, setting="cluster.max_restarts")


def _failing(faults):
    calls = []

    def launch(attempt):
        calls.append(attempt)
        raise WorkerFailed(0, "RuntimeError: boom", 1, fault=faults(attempt))

    return launch, calls


def test_an_identical_fault_is_not_retried_a_third_time():
    launch, calls = _failing(lambda attempt: "at step 3: RuntimeError: boom")
    with pytest.raises(WorkerFailed) as info:
        supervise(launch, POLICY)
    assert calls == [0, 1], "two attempts: the second showed the fault is deterministic"
    message = str(info.value)
    assert "\n" not in message and "repeated attempt 0's fault identically" in message, message
    assert "at step 3: RuntimeError: boom" in message and info.value.fault == "at step 3: RuntimeError: boom"


@pytest.mark.parametrize(
    "faults",
    [lambda attempt: f"at step {3 + attempt}: RuntimeError: boom", lambda attempt: None],
    ids=["another_step_each_time", "rank_reported_nothing"],
)
def test_control_a_fault_that_is_not_the_same_is_retried_to_the_limit(faults):
    launch, calls = _failing(faults)
    with pytest.raises(WorkerFailed, match="gave up after 5 attempts"):
        supervise(launch, POLICY)
    assert calls == [0, 1, 2, 3, 4]


def test_a_failure_gets_the_fault_its_rank_reported():
    view, out = LiveView(stream=io.StringIO(), quiet=True), io.StringIO()
    emit_event("fault", stream=out, rank=1, step=7, error="ValueError: bad")
    emit_event("fault", stream=out, rank=0, step=7, error="CommError: peer 1 gone")
    for line in out.getvalue().splitlines():
        view.handle_line(f"[default1]:{line}")
    failed = WorkerFailed(1, "ValueError: bad", 1)
    note_fault(view, WorkerFailed, failed, None)
    assert failed.fault == "at step 7: ValueError: bad"
    killed = WorkerFailed(2, "killed by SIGKILL", -9)
    note_fault(view, WorkerFailed, killed, None)
    assert killed.fault is None, "a rank that said nothing has no fault to compare"


SITECUSTOMIZE = """
import os

if os.environ.get("KC_TEST_FAULT_AT_STEP"):  # a deterministic bug: every rank raises before this step + 1
    from kuangchao_core.engine.trainer import Trainer

    _step = Trainer.train_step

    def train_step(self, micro_batches):
        if self.state.step == int(os.environ["KC_TEST_FAULT_AT_STEP"]):
            raise RuntimeError("an injected deterministic fault")
        return _step(self, micro_batches)

    Trainer.train_step = train_step
"""


def test_a_job_whose_fault_repeats_stops_after_two_attempts(prefect_api, session_store, tmp_path):
    """A real flow: both attempts fail at step 5 (the second resumed from step 4's checkpoint) with the same error;
    ``cluster.max_restarts: 3`` would allow four, the flow stops after two, saying it repeated."""
    import glob
    import os

    from tests.conftest_prefect import run_flow, tiny_overrides

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {"KC_TEST_FAULT_AT_STEP": "5", "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}
    overrides = tiny_overrides(tmp_path, session_store, **{"cluster.max_restarts": 3})
    with pytest.raises(WorkerFailed) as info:
        run_flow(tmp_path, overrides, env=env)
    message = str(info.value)
    assert "repeated attempt 0's fault identically" in message, message
    assert "at step 5: RuntimeError: an injected deterministic fault" in message and "\n" not in message
    attempts = sorted(p.rsplit("/", 1)[1] for p in glob.glob(str(tmp_path / "runs" / "*" / "*" / "attempt_*")))
    assert attempts == ["attempt_0", "attempt_1"], attempts
