"""Quiet by default (issue 27 §7): what a healthy run prints to people.

- the live view says each anomaly kind once, with its count and steps, when it closes (not one line per flag), and
  shows a worker's JSON warning as one human line (the JSON stays in launcher.log and the JSON log files); an
  anomaly's own log record is left to the tally; the run summary's anomaly row is one short line per kind;
- ``kc checkpoint list`` on real checkpoints fits 80 columns and names every lineage in full;
- ``kc node list`` shows a CPU node's slots, not ``0 cpu``.
(Thresholds that do not fire on a healthy run, and still fire on a real spike: tests/test_anomaly.py.)"""

from __future__ import annotations

import io
import json

from typer.testing import CliRunner

from kuangchao_core.obs.console import LiveView, for_people
from kuangchao_core.obs.jsonlog import emit_event
from kuangchao_core.obs.voice import message_of, parse


def _feed(view: LiveView, emit) -> None:
    lines = io.StringIO()
    emit(lines)
    for line in lines.getvalue().splitlines():
        view.handle_line(f"[rank0]:{line}")  # as the launcher relays them


def test_each_anomaly_kind_is_one_console_line_with_its_count():
    out = io.StringIO()
    view = LiveView(stream=out, rich_live=False, task="t")
    flags = [("comm_share", 134), ("grad_norm", 200), ("comm_share", 619), ("comm_share", 2917), ("grad_norm", 900)]

    def emit(stream):
        emit_event("start", stream=stream, start_step=0, total_steps=3000)
        for kind, step in flags:
            emit_event(
                "anomaly", stream=stream, kind=kind, step=step, value=1.0, threshold=0.5, action="warn", message="m"
            )
            record = {"level": "WARNING", "rank": 0, "msg": f"anomaly {kind} at step {step}", "anomaly": kind}
            stream.write(json.dumps(record) + "\n")  # the rank's own log record of it
        stream.write(json.dumps({"level": "WARNING", "rank": 1, "msg": "checkpoint.s3 is slow"}) + "\n")
        stream.write(json.dumps({"level": "INFO", "rank": 0, "msg": "step"}) + "\n")
        emit_event("step", stream=stream, step=3000, total_steps=3000, loss=0.9, comm_share=0.2)
        emit_event("done", stream=stream, step=3000)

    _feed(view, emit)
    view.close()  # idempotent: the launch task closes the view again
    text = out.getvalue()
    anomaly_lines = [message_of(line) for line in text.splitlines() if message_of(line).startswith("anomaly")]
    assert anomaly_lines == [
        "anomaly comm_share ×3, steps 134–2917 (warn)",
        "anomaly grad_norm ×2, steps 200–900 (warn)",
    ], text
    assert ("WARNING", "rank1", "checkpoint.s3 is slow") in [parse(line)[1:] for line in text.splitlines()]
    assert "{" not in text  # no raw JSON on the console
    assert "anomalies comm_share×3 grad_norm×2" in text  # the step line carries the counts so far
    # the control: the raw lines the view was fed hold every flag, twice
    assert sum(1 for _ in flags) == 5


def test_a_stop_anomaly_is_said_at_once():
    out = io.StringIO()
    view = LiveView(stream=out, rich_live=False)
    _feed(
        view,
        lambda s: emit_event(
            "anomaly", stream=s, kind="loss_nan", step=8, value=0.0, threshold=0.0, action="stop", message="loss nan"
        ),
    )
    assert [parse(line)[1:] for line in out.getvalue().splitlines()] == [
        ("ERROR", "kc", "anomaly loss_nan at step 8: loss nan")
    ]


def test_the_summary_anomaly_row_is_one_short_line_per_kind():
    msg = "communication 80% of step time for 5 steps (> 60%)"
    anomalies = [{"kind": "comm_share", "step": s, "action": "warn", "message": msg} for s in (134, 619, 1491, 2917)]
    anomalies.append({"kind": "grad_norm", "step": 896, "action": "checkpoint", "message": "x"})
    text = for_people(anomalies)
    assert text.splitlines() == ["comm_share ×4, steps 134–2917 (warn)", "grad_norm ×1, step 896 (checkpoint)"]
    assert for_people([]) == "[]" and for_people([1, 2]) == "[1, 2]"  # other lists as they were


def _cli(args):
    from kuangchao.cli.main import app

    return CliRunner().invoke(app, args)


def test_checkpoint_list_fits_80_columns_with_full_lineage_names(tmp_path):
    import torch

    from kuangchao_core.ckpt.rng import capture_rng_state
    from kuangchao_core.ckpt.writer import CheckpointWriter
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    task = "kc-finetune-demo-with-a-long-name"
    lineages = ["run-20261203T005728Z-7af19f", "run-20261204T101010Z-0a1b2c"]
    previous = install_guard(AllowAll())
    try:
        for lineage in lineages:
            writer = CheckpointWriter(tmp_path, task, 0, 1, barrier=lambda: None, lineage=lineage)
            for step in (500, 1000):
                writer.save(step, {"param.w": torch.ones(8, 8)}, capture_rng_state(), state={}, meta={"model": {}})
    finally:
        install_guard(previous)
    (tmp_path / task / lineages[1] / "step_00001500.tmp-9f8e7d").mkdir()
    res = _cli(["checkpoint", "list", str(tmp_path)])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert all(len(line) <= 80 for line in lines), res.output
    for lineage in lineages:
        assert f"{task}/{lineage}" in lines  # the lineage's header line, in full
    assert sum("intact" in line for line in lines) == 4 and any("incomplete" in line for line in lines)
    assert "    directory step_00001500.tmp-9f8e7d" in lines
    assert "…" not in res.output  # nothing truncated
    # the control: --json keeps every field
    rows = [json.loads(line) for line in _cli(["checkpoint", "list", "--json", str(tmp_path)]).output.splitlines()]
    assert {r["lineage"] for r in rows} == set(lineages) and len(rows) == 5


def test_node_list_shows_cpu_slots(monkeypatch):
    from kuangchao.cli.node import devices_text
    from kuangchao_core.sched import node_registry, nodes

    cpu = nodes.NodeFacts(name="h0", address="10.0.0.1", device_kind="cpu", device_count=0, cpu_count=4)
    gpu = nodes.NodeFacts(name="g0", address="10.0.0.2", device_kind="cuda", device_count=8, cpu_count=64)
    one = nodes.NodeFacts(name="h1", address="10.0.0.3", cpu_count=1)
    assert (devices_text(cpu), devices_text(gpu), devices_text(one)) == ("4 cpu slots", "8 cuda", "1 cpu slot")

    class Found:
        name, live, last_heartbeat, facts = "h0", True, "now", cpu

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    monkeypatch.setattr(node_registry, "list_nodes", lambda pool: [Found()])
    res = _cli(["node", "list", "--pool", "p"])
    assert res.exit_code == 0 and "4 cpu slots" in res.output and "0 cpu" not in res.output, res.output
