"""The flow run's own Prefect log (issue 27 §5): what ``prefect flow-run logs <id>`` shows of a training run.

- the session's reference flow run (tests/conftest_prefect.py, shared with tests/test_flow.py): its log holds one
  ``step N/12 loss ...`` line per ``train.log_interval`` (2) and the held-out accuracy, and every task run's state
  line names its task run (``Task run 'launch-...' - Finished in state Completed()``), the control being the flow's
  own state line, which the CLI names by the flow run;
- the formatter and the progress listener on their own."""

from __future__ import annotations

import logging
import time

from tests.conftest_prefect import INTERVAL, STEPS


def _flow_run_messages(flow_run_id: str) -> list[str]:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter
    from prefect.client.schemas.sorting import LogSort

    async def read() -> list[str]:
        async with get_client() as client:
            logs = await client.read_logs(
                log_filter=LogFilter(flow_run_id={"any_": [flow_run_id]}), sort=LogSort.TIMESTAMP_ASC
            )
            return [log.message for log in logs]

    return asyncio.run(read())


def test_the_flow_runs_log_has_the_progress_and_names_every_task_run(reference_run):
    flow_run_id = reference_run["summary"]["flow_run_id"]
    deadline, messages = time.time() + 30, []
    while time.time() < deadline:  # the API log handler sends in batches
        messages = _flow_run_messages(flow_run_id)
        if any(f"- step {STEPS}/{STEPS} " in m for m in messages):
            break
        time.sleep(1)
    progress = [m.split(" - ", 1)[1] for m in messages if m.startswith("Task run 'launch-") and " - " in m]
    steps = [int(m.split()[1].split("/")[0]) for m in progress if m.startswith("step ") and " loss " in m]
    assert steps == list(range(INTERVAL, STEPS + 1, INTERVAL)), messages
    assert any(m.startswith("held-out exact-match accuracy") for m in progress), messages
    states = [m for m in messages if "Finished in state" in m]
    unnamed = [m for m in states if not m.startswith("Task run '")]
    assert len(states) >= 5 and len(unnamed) <= 1, states  # at most the flow's own, named by the CLI's prefix
    assert any(m.startswith("Task run 'launch-") for m in states), states


def test_task_run_formatter_and_progress_log():
    from kuangchao_core.job.flow_log import ProgressLog, TaskRunNameFormatter

    record = logging.LogRecord("prefect.task_runs", logging.INFO, __file__, 1, "Finished in state %s", ("X()",), None)
    record.task_run_name = "doctor-348"
    assert TaskRunNameFormatter().format(record) == "Task run 'doctor-348' - Finished in state X()"
    flow = logging.LogRecord("prefect.flow_runs", logging.INFO, __file__, 1, "Finished in state X()", (), None)
    assert TaskRunNameFormatter().format(flow) == "Finished in state X()"  # the control: a flow run's record

    class Sink:
        lines: list[str] = []

        def info(self, msg, *args):
            self.lines.append(msg % args if args else msg)

        warning = info

    sink = Sink()
    log = ProgressLog(sink)
    log({"event": "step", "step": 250, "total_steps": 3000, "loss": 1.25, "lr": 1e-3, "tokens_per_s": 1e4})
    log({"event": "eval_loss", "step": 500, "eval_loss": 0.9, "eval_exact_match": 0.5})
    log({"event": "anomaly", "kind": "grad_norm", "step": 700, "action": "warn"})
    log({"event": "done", "step": 3000})
    assert sink.lines[0].startswith("step 250/3000  loss 1.2500")
    assert sink.lines[1:] == [
        "eval at step 500: held-out loss 0.9000, exact match 0.500",
        "anomaly grad_norm ×1, step 700 (warn)",
    ]
