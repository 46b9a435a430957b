"""Every lifecycle task retries a transient failure and passes, and fails a permanent one at once (issue 44 item 4),
on the session's real Prefect server, with the task run's state, run count and log read back through the API.

The fault is real (``tests/real_faults.py``: a refused connection, a held port, a locked SQLite store, S3 and HTTP
endpoints that refuse or never answer; the config loader's ``ConfigError``, the guard's ``PermissionDenied``, the
publishing gate's ``NotPublishable``) and is put in front of the task's core function by a one-shot script (the
function the task module calls: its first call raises the fault, the next returns a result the task accepts); the
doctor's faults are real failed checks, its data refusal the real ``record_validation``. Retry delays are shortened
with ``with_options`` (the tasks' own backoff is asserted on the task objects). ``launch`` retries only before its
workers start: a transient failure once the attempt's directory exists is not retried (the flow's recovery owns it).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import pytest

from kuangchao_core.data.validation import ExpectationResult, ValidationReport
from kuangchao_core.job.launch_attempt import LaunchSummary
from kuangchao_core.sched import service_checks
from kuangchao_core.sched.doctor_report import Check, DoctorReport
from kuangchao_core.sched.topology import TopologyReport
from tests import real_faults as F

QUICK = [0.1, 0.1, 0.1]  # seconds before each retry here (the tasks' own: tasks.retry_policy.RETRY_DELAYS_S)


class Script:
    """Stands in for a task's core function: call n takes ``outcomes[n]`` (the last one repeats): an exception is
    raised, a zero-argument function's value returned."""

    def __init__(self, *outcomes: Any):
        self.outcomes, self.calls = list(outcomes), 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.outcomes[min(self.calls, len(self.outcomes) - 1)]
        self.calls += 1
        if isinstance(out, BaseException):
            raise out
        return out()


def _report(check: Check) -> DoctorReport:
    return DoctorReport(checks=[check])


def _mlflow_down() -> DoctorReport:  # the real probe of an MLflow server on a closed port
    return _report(service_checks.check_mlflow({"tracking": {"uri": f"http://127.0.0.1:{F.free_port()}"}}, timeout=2))


def _storage_refused(tmp) -> DoctorReport:  # the real probe of a checkpoint dir under a file
    (tmp / "file").write_text("x")
    return _report(service_checks.check_checkpoint_storage({"checkpoint": {"dir": str(tmp / "file" / "ckpt")}}))


def _validation(ok: bool) -> ValidationReport:
    result = ExpectationResult("enough_tokens", ok, "total tokens >= required", observed=10, expected=">= 500")
    return ValidationReport(ok, [result], num_records=2, total_tokens=10, required_tokens=500)


def _topology() -> TopologyReport:
    return TopologyReport(
        2, ["n0", "n0"], "gloo", (1, 2), 1, 1.0, 1.0, 1.0, [[None, 1.0], [1.0, None]], [[None, 1.0], [1.0, None]]
    )


@dataclass
class Case:
    """A task, the name its module calls its core function by, its arguments, and its script's outcomes."""

    module: str
    task: str
    core: str
    kwargs: Any  # tmp_path -> the task's keyword arguments
    ok: Any  # () -> what the core returns when it passes
    transient: Any  # tmp_path -> the transient fault (an exception, or a failing value for the task to refuse)
    permanent: Any  # tmp_path -> the permanent one
    says: str  # in the permanent line's reason


def _uniq() -> int:  # a parameter no other test uses: a cached task's key is this test's own
    return random.randint(10_000, 99_999)


def _run_dir(tmp) -> dict[str, Any]:
    return {"cfg": None, "run_dir": str(tmp), "attempt": 0}


CASES = [
    Case(
        "doctor",
        "doctor",
        "run_doctor",
        lambda t: {},
        lambda: DoctorReport(checks=[Check("versions", True, "ok")]),
        lambda t: _mlflow_down,
        lambda t: lambda: _storage_refused(t),
        "a retry cannot mend: checkpoint_storage",
    ),
    Case(
        "issue_tokens",
        "issue_tokens",
        "issue_tokens_for_run",
        _run_dir,
        lambda: {"KC_TOKEN": "t"},
        lambda t: F.sqlite_locked(t / "pins.db"),
        lambda t: F.config_error(),
        "a bad config",
    ),
    Case(
        "launch",
        "launch",
        "launch_workers",
        lambda t: {**_run_dir(t), "config_path": str(t / "job.yaml")},
        lambda: LaunchSummary(0, 1, 1.0, 1.0, 1.0, None, None),
        lambda t: F.address_in_use(),
        lambda t: F.config_error(),
        "a bad config",
    ),
    Case(
        "place_attempt",
        "place_attempt",
        "place_and_record",
        lambda t: {**_run_dir(t), "exclude": [], "topology": None},
        lambda: {"attempt": 0, "placement": {"mode": "packed"}, "links": []},
        lambda t: F.refused_connection(),
        lambda t: F.config_error(),
        "a bad config",
    ),
    Case(
        "probe_topology",
        "probe_topology",
        "measure_topology",
        lambda t: {"iters": _uniq()},
        _topology,
        lambda t: F.socket_timeout(),
        lambda t: F.config_error(),
        "a bad config",
    ),
    Case(
        "probe_topology",
        "probe_cluster",
        "measure_cluster",
        lambda t: {"node_facts": [], "nproc": _uniq(), "run_dir": str(t), "deployment": "kc-node/x"},
        _topology,
        lambda t: F.httpx_refused(),
        lambda t: F.permission_denied(),
        "a denied permission",
    ),
    Case(
        "recover",
        "recover",
        "plan_recovery",
        lambda t: {"cfg": None, "failed_attempt": 0, "cause": "rank 1: exit 1"},
        lambda: {"resume": None},
        lambda t: F.store_locked(t / "mlflow.db"),
        lambda t: F.config_error(),
        "a bad config",
    ),
    Case(
        "validate_data",
        "validate_data",
        "validate_dataset",
        lambda t: {"cfg": None},
        lambda: _validation(True),
        lambda t: F.socket_timeout(),
        lambda t: lambda: _validation(False),
        "refused data",
    ),
    Case(
        "checkpoint",
        "checkpoint",
        "verify_and_record",
        lambda t: {"cfg": None},
        lambda: {"step": 2},
        lambda t: F.s3_refused(),
        lambda t: F.config_error(),
        "a bad config",
    ),
    Case(
        "checkpoint",
        "restore_checkpoint",
        "restore_and_tag",
        lambda t: {"cfg": None},
        lambda: {"restored": None},
        lambda t: F.s3_read_timeout(),
        lambda t: F.config_error(),
        "a bad config",
    ),
    Case(
        "export_model",
        "export_and_register",
        "export_and_register_model",
        lambda t: {"cfg": None, "run_id": "r", "step_dir": str(t), "run_dir": str(t)},
        lambda: {"registered": None},
        lambda t: F.url_refused(),
        lambda t: F.not_publishable(),
        "a model the publishing gate refused",
    ),
]
IDS = [c.task for c in CASES]


def _task(case: Case):
    import importlib

    return getattr(importlib.import_module(f"tasks.{case.module}"), case.task)


def _run(case: Case, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The task (short retry delays, its cache refreshed) once in a flow; the flow's state and its one task run."""
    from prefect import flow

    quick = _task(case).with_options(retry_delay_seconds=QUICK, refresh_cache=True)

    @flow(name="kc-task-retries")
    def one() -> Any:
        return quick(**kwargs)

    state = one(return_state=True)
    return state, _task_run(state.state_details.flow_run_id)


def _task_run(flow_run_id) -> Any:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    async def read():
        async with get_client() as c:
            return await c.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))

    (run,) = asyncio.run(read())
    return run


def _log_line(task_run_id, text: str, timeout_s: float = 15.0) -> str:
    """The task run's log line containing ``text`` (the API's log worker sends in batches: polled)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter

    async def read() -> list[str]:
        async with get_client() as c:
            return [lg.message for lg in await c.read_logs(log_filter=LogFilter(task_run_id={"any_": [task_run_id]}))]

    deadline = time.monotonic() + timeout_s
    while True:
        lines = asyncio.run(read())
        hits = [m for m in lines if text in m]
        if hits or time.monotonic() > deadline:
            assert hits, f"no {text!r} in the task run's log: {lines}"
            return hits[0]
        time.sleep(0.25)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_transient_failure_is_retried_and_passes(prefect_api, case, tmp_path, monkeypatch):
    script = Script(case.transient(tmp_path), case.ok)
    monkeypatch.setattr(f"tasks.{case.module}.{case.core}", script)
    state, run = _run(case, case.kwargs(tmp_path))
    assert state.is_completed(), state
    assert script.calls == 2 and run.run_count == 2 and run.state.is_completed(), (script.calls, run)
    line = _log_line(run.id, f"retrying {_task(case).name}: transient (")
    assert "not retried" not in line


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_permanent_failure_fails_at_once(prefect_api, case, tmp_path, monkeypatch):
    script = Script(case.permanent(tmp_path), case.ok)  # control: the same script would pass on a second call
    monkeypatch.setattr(f"tasks.{case.module}.{case.core}", script)
    state, run = _run(case, case.kwargs(tmp_path))
    assert state.is_failed(), state
    assert script.calls == 1 and run.run_count == 1 and run.state.is_failed(), (script.calls, run)
    line = _log_line(run.id, f"{_task(case).name} not retried: permanent (")
    assert case.says in line, line


def test_launch_is_not_retried_once_its_workers_started(prefect_api, tmp_path, monkeypatch):
    """A transient fault after the attempt's directory exists (workers may have run): not retried, and said why."""
    (case,) = [c for c in CASES if c.task == "launch"]
    (tmp_path / "attempt_0").mkdir()
    script = Script(F.refused_connection(), case.ok)
    monkeypatch.setattr("tasks.launch.launch_workers", script)
    state, run = _run(case, case.kwargs(tmp_path))
    assert state.is_failed() and script.calls == 1 and run.run_count == 1, (state, run)
    assert "after the workers' start (attempt_0 exists)" in _log_line(run.id, "launch not retried: permanent (")


def test_every_lifecycle_task_has_the_policy():
    from tasks.retry_policy import RETRIES, RETRY_DELAYS_S, retry_if_transient

    assert RETRIES >= 1 and RETRY_DELAYS_S == sorted(RETRY_DELAYS_S) and sum(RETRY_DELAYS_S) <= 30  # a backoff
    for case in CASES:
        task = _task(case)
        assert task.retries == RETRIES and task.retry_delay_seconds == RETRY_DELAYS_S, task.name
        assert task.retry_condition_fn is retry_if_transient, task.name
