"""The step loop reads in one screen (issue 43 item 4): ``Trainer.run`` is at most 60 lines and decides no cadence
itself — the checkpointer, evaluations, anomaly monitor, metrics report and live config each decide whether a step
is theirs (``after_step``). Each measure has its control: a 61-line function and a loop with ``step % interval``
arithmetic are caught by the same helpers. The observers' own decisions are checked here on real objects; what the
loop does with them is checked by the engine tests (``test_engine_3d``, ``test_anomaly``, ``test_ckpt_async`` …)."""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
from pathlib import Path

import torch

from kuangchao_core.config import config_from_dict
from kuangchao_core.engine.anomaly import AnomalyDetector
from kuangchao_core.engine.metrics import StepReport
from kuangchao_core.engine.trainer import StepResult, Trainer
from kuangchao_core.obs.jsonlog import parse_event

TRAINER = Path(__file__).resolve().parent.parent / "kuangchao_core" / "engine" / "trainer.py"
MAX_LINES = 60


def _lines(source: str) -> int:
    return len(source.rstrip("\n").splitlines())


def _cadence_arithmetic(source: str) -> list[str]:
    """The ``a % b`` expressions of ``source``: a step count's remainder is a cadence decided in place."""
    tree = ast.parse(textwrap.dedent(source))
    return [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod)]


def test_the_loop_fits_one_screen_and_leaves_each_cadence_to_its_owner():
    source = inspect.getsource(Trainer.run)
    assert _lines(source) <= MAX_LINES, f"Trainer.run is {_lines(source)} lines (at most {MAX_LINES})"
    assert _cadence_arithmetic(source) == []
    assert "fmt: skip" not in TRAINER.read_text(encoding="utf-8")
    # the controls: a longer function and the old inline checkpoint cadence are caught
    longer = "def f():\n" + "    x = 1\n" * MAX_LINES
    assert _lines(longer) == MAX_LINES + 1
    inline = "def run(self):\n    if interval and result.step % interval == 0:\n        self.save_checkpoint()\n"
    assert _cadence_arithmetic(inline) == ["result.step % interval"]


def _result(step: int) -> StepResult:
    return StepResult(step, 2.0, 1e-3, 1.0, 100.0, 1, 0.1, 0.01)


class _Sink:
    """A metric sink that keeps what it is given (the interface of the MLflow sink: ``log_step``)."""

    def __init__(self):
        self.steps: list[int] = []

    def log_step(self, step, metrics):
        self.steps.append(step)


def _report_steps(rank: int, capsys) -> tuple[list[int], list[int], dict]:
    sink = _Sink()
    report = StepReport(rank, torch.device("cpu"), sink, 10, 0, 5)
    report.start(world_size=2, lineage="L")
    for step in range(1, 6):
        report.after_step(_result(step), {"loss": 2.0}, log_interval=2)
    report.close()
    events = [e for e in map(parse_event, capsys.readouterr().out.splitlines()) if e is not None]
    lines = [e["step"] for e in events if e["event"] == "step"]
    fed = [t for e in events if e["event"] == "steps" for t in e["step_times"]]
    start = next((e for e in events if e["event"] == "start"), {})
    return sink.steps, lines, {"fed": len(fed), "start": start}


def test_the_metrics_report_logs_at_its_interval_and_the_last_step_on_rank_0_only(capsys):
    logged, lines, more = _report_steps(0, capsys)
    assert logged == [1, 2, 3, 4, 5]  # MLflow: every step
    assert lines == [2, 4, 5]  # the console: every log_interval steps and the last
    assert more["fed"] == 5  # the orchestrator's feed: every step
    assert more["start"].get("total_steps") == 10 and more["start"].get("lineage") == "L"
    assert _report_steps(1, capsys) == ([], [], {"fed": 0, "start": {}})  # other ranks report nothing


def test_the_anomaly_monitor_acts_on_its_flags():
    chosen = {"task": {"name": "a"}, "train": {"anomaly": {"actions": {"loss_nan": "checkpoint"}}}}
    saves: list[int] = []
    base = {"loss": 2.0, "grad_norm": 1.0, "comm_share": 0.1, "mem_bytes": 1e8}
    nan = {**base, "loss": math.nan}
    det = AnomalyDetector(config_from_dict(chosen).train.anomaly)
    assert det.after_step(1, dict(base), 0, lambda: saves.append(1)) is None and saves == []  # the control
    assert det.after_step(2, dict(nan), 0, lambda: saves.append(2)) is None and saves == [2]  # checkpoint action
    det = AnomalyDetector(config_from_dict({"task": {"name": "a"}}).train.anomaly)
    counted = dict(nan)
    assert det.after_step(1, counted, 0, lambda: saves.append(3)) == "loss_nan"  # stop (the default): the loop ends
    assert counted["anomalies_loss_nan"] == 1.0 and saves == [2]  # rank 0 counts it for MLflow; nothing saved
    assert det.after_step(2, nan, 1, lambda: saves.append(4)) == "loss_nan"  # every rank gets the same answer
    assert "anomalies_loss_nan" not in nan  # ... and only rank 0 adds the counts
