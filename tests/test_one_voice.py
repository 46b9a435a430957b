"""One voice on ``kc train``'s console (issue 45 §3).

The attack, as a user met it: four formats on one console — Prefect's ``03:12:20.704 | INFO    | prefect - …``,
MLflow's ``2026/12/07 03:03:59 INFO mlflow…``, torchrun's ``[rank0]:`` prefixes and torch's C++ warnings
(``[W1207 …] The hostname of the client socket cannot be retrieved``, once per rank) — plus Prefect's
``Failed to send telemetry``. Here:

- the parts: :data:`~kuangchao_core.obs.voice.LINE` takes the one format and none of the four others (the control
  that the whole-console check bites); the live view rewrites the ranks' free text, their JSON warnings and torch's
  C++ lines (each said once); Prefect's and MLflow's log records through the handler kc's Prefect logging config
  names; the telemetry switches kc sets unless the user set them;
- a whole ``kc train`` of the tiny model (2 Gloo ranks, Prefect's temporary server, a real MLflow store) with
  ``TORCH_CPP_LOG_LEVEL=INFO``, so that torch's C++ code really speaks in the ranks and torchrun: every non-empty
  line of its console is in the one format, torch's lines among them; and the same with ``-q``: warnings, errors and
  the final ``done:`` line only.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kuangchao_core.obs import voice
from kuangchao_core.obs.console import LiveView
from kuangchao_core.obs.jsonlog import emit_event
from kuangchao_core.obs.voice import LINE, parse

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")

#: the four other voices, as the issue quotes them
RAW = [
    "03:12:20.704 | INFO    | prefect - Starting temporary server on http://127.0.0.1:8000",
    "03:12:21.100 | INFO    | Flow run 'polite-malkoha' - Beginning flow run 'polite-malkoha' for flow 'kuangchao-train'",
    "03:12:25.013 | ERROR   | prefect.server.services.telemetry - Failed to send telemetry: ConnectError",
    "2026/12/07 03:03:59 INFO mlflow.store.db.utils: Creating initial MLflow database tables...",
    "[rank0]:a worker's own line",
    "[rank2]:2026/12/07 18:00:39 INFO mlflow.system_metrics.system_metrics_monitor: Skip logging GPU metrics.",
    "[W1207 03:12:20.704000 123 torch/csrc/distributed/c10d/socket.cpp:45] The hostname of the client socket cannot "
    "be retrieved. err=-3",
]


def _problems(text: str) -> list[str]:
    """The lines of a console that are not in the one voice, or that carry what the issue saw on it."""
    bad = [line for line in text.splitlines() if line.strip() and not LINE.match(line)]
    for noise in ("Failed to send telemetry", "[rank", "[W1", "[I1", "| INFO", "| WARNING", "| ERROR"):
        bad += [line for line in text.splitlines() if noise in line]
    return bad


# --- the parts --------------------------------------------------------------------------------------------------


def test_the_one_format_and_the_control_that_the_check_bites():
    line = voice.render("step 2/6  loss 5.4566", "INFO", "kc", when=1_765_000_000.25)
    assert parse(line)[1:] == ("INFO", "kc", "step 2/6  loss 5.4566") and line.endswith(
        ".250 INFO    kc: step 2/6  loss 5.4566"
    )
    assert [parse(ln)[3] for ln in voice.render("a\n  b", "WARNING", "rank1").splitlines()] == ["a", "  b"]
    assert voice.message_of("not a console line") == "not a console line"
    for raw in RAW:  # the control: the check of a whole console catches each of the other voices
        assert not LINE.match(raw), raw
        assert raw in _problems(raw), raw
    assert _problems("\n".join(voice.render(r, "INFO", "x") for r in ("ok", "fine"))) == []


def test_the_live_view_rewrites_the_ranks_and_torchs_lines_and_says_each_torch_warning_once(monkeypatch):
    monkeypatch.delenv(voice.ENV_LEVEL, raising=False)
    hostname = "The hostname of the client socket cannot be retrieved. err=-3"
    fed = [
        f"[rank0]:[W1207 03:12:20.704000 123 torch/csrc/distributed/c10d/socket.cpp:45] {hostname}",
        f"[rank1]:[W1207 03:12:20.705000 124 torch/csrc/distributed/c10d/socket.cpp:45] {hostname}",
        "[rank0]:[W1207 03:12:21.000000 123 torch/csrc/distributed/c10d/Utils.hpp:9] a warning of torch's",
        "[rank1]:[W1207 03:12:21.001000 124 torch/csrc/distributed/c10d/Utils.hpp:9] a warning of torch's",
        "[I1207 03:12:21.500000000 TCPStoreLibUvBackend.cpp:1364] [c10d] uv_loop cleanup finished.",  # no pid
        "[rank1]:a worker's own line",
        "[rank0]:" + json.dumps({"level": "WARNING", "rank": 0, "msg": "checkpoint.s3 is slow"}),
        "[rank0]:" + voice.render("a record of the rank's own logger", "WARNING", "kc"),
        "[rank2]:2026/12/07 18:00:45 INFO mlflow.system_metrics.system_metrics_monitor: Started monitoring.",
    ]
    events = io.StringIO()
    emit_event("start", stream=events, start_step=0, total_steps=4)
    emit_event("step", stream=events, step=2, total_steps=4, loss=1.5)
    fed += [f"[rank0]:{line}" for line in events.getvalue().splitlines()]

    def shown(level: str | None) -> list[tuple[str, str, str]]:
        if level:
            monkeypatch.setenv(voice.ENV_LEVEL, level)
        out = io.StringIO()
        view = LiveView(stream=out, rich_live=False, task="t")
        for line in fed:
            view.handle_line(line)
        assert _problems(out.getvalue()) == [], out.getvalue()
        return [parse(line)[1:] for line in out.getvalue().splitlines()]

    said = shown(None)
    assert said == [
        ("WARNING", "torch", "a warning of torch's"),  # once for the two ranks; the hostname one is a debug line
        ("INFO", "torch", "[c10d] uv_loop cleanup finished."),
        ("INFO", "rank1", "a worker's own line"),
        ("WARNING", "rank0", "checkpoint.s3 is slow"),
        ("WARNING", "rank0", "a record of the rank's own logger"),
        ("INFO", "mlflow", "Started monitoring."),  # MLflow's own format, on a Slurm node's rank
        ("INFO", "kc", "training t: steps 0→4"),
        ("INFO", "kc", "step 2/4  loss 1.5000  lr 0.00e+00  0 tok/s  grad_norm 0.000  mem -  comm 0.0%  ETA -"),
    ]
    assert ("DEBUG", "torch", hostname) in shown("DEBUG")  # -v: said once, as a debug line
    assert shown("WARNING") == [s for s in said if s[0] == "WARNING"]  # -q: the warnings only
    assert _problems("\n".join(fed)), "the control: the lines as torchrun relays them are not in the one voice"


def test_prefects_and_mlflows_records_through_kcs_handler(monkeypatch):
    monkeypatch.delenv(voice.ENV_LEVEL, raising=False)
    records = [
        logging.LogRecord("prefect.flow_runs", logging.INFO, __file__, 1, "Beginning flow run %r", ("x",), None),
        logging.LogRecord("prefect.task_runs", logging.INFO, __file__, 1, "Finished in state Completed()", (), None),
        logging.LogRecord("prefect", logging.INFO, __file__, 1, "Stopping temporary server", (), None),
        logging.LogRecord("mlflow.store.db.utils", logging.WARNING, __file__, 1, "Creating tables", (), None),
        logging.LogRecord("kuangchao.flow_log", logging.ERROR, __file__, 1, "a kc line", (), None),
        logging.LogRecord("prefect.flow_runs", logging.DEBUG, __file__, 1, "a debug line", (), None),
    ]
    records[1].task_run_name = "launch-3bd"
    try:
        raise ValueError("boom")
    except ValueError:
        records[4].exc_info = sys.exc_info()
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    handler = voice.ConsoleHandler()
    for record in records:
        handler.handle(record)
    assert _problems(err.getvalue()) == [], err.getvalue()
    lines = [parse(line)[1:] for line in err.getvalue().splitlines()]
    assert lines[:5] == [
        ("INFO", "flow", "Beginning flow run 'x'"),
        ("INFO", "task", "launch-3bd: Finished in state Completed()"),
        ("INFO", "prefect", "Stopping temporary server"),
        ("WARNING", "mlflow", "Creating tables"),
        ("ERROR", "kc", "a kc line"),
    ]
    assert lines[5][2] == "Traceback (most recent call last):" and lines[-1][2] == "ValueError: boom"
    assert "a debug line" not in err.getvalue()  # below the threshold


def test_kc_turns_telemetry_off_and_names_its_logging_config_unless_the_user_set_them():
    env: dict[str, str] = {"DO_NOT_TRACK": "0"}
    voice.environment(env)
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false" and env["MLFLOW_DISABLE_TELEMETRY"] == "true"
    assert env["MLFLOW_CONFIGURE_LOGGING"] == "false" and env["DO_NOT_TRACK"] == "0"  # the user's own stays
    assert (
        Path(env["PREFECT_LOGGING_SETTINGS_PATH"]) == voice.PREFECT_LOGGING_YML and voice.PREFECT_LOGGING_YML.is_file()
    )
    mine = {"PREFECT_LOGGING_SETTINGS_PATH": "/etc/my-logging.yml"}
    voice.environment(mine)
    assert mine["PREFECT_LOGGING_SETTINGS_PATH"] == "/etc/my-logging.yml"


# --- a whole kc train -------------------------------------------------------------------------------------------


def _kc_train(tmp_path: Path, *flags: str) -> tuple[int, str]:
    tmp_path.mkdir()
    task = f"kc-voice-{uuid.uuid4().hex[:6]}"
    sets = [
        f"task.name={task}",
        "train.steps=4",
        "train.warmup_steps=0",
        "train.log_interval=2",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.resume=never",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "tracking.system_metrics=false",
        f"permission.audit_log={tmp_path / 'audit'}",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "KC_RUNS_DIR": str(tmp_path / "runs"),
        "TORCH_CPP_LOG_LEVEL": "INFO",  # torch's C++ code speaks in the ranks and in torchrun
    }
    for name in ("PREFECT_API_URL", "PREFECT_PROFILES_PATH", "PREFECT_API_DATABASE_CONNECTION_URL", voice.ENV_LEVEL):
        env.pop(name, None)
    for name in ("PREFECT_LOGGING_SETTINGS_PATH", "MLFLOW_CONFIGURE_LOGGING", "PREFECT_SERVER_ANALYTICS_ENABLED"):
        env.pop(name, None)  # what kc sets itself, not this test's process
    argv = [sys.executable, "-m", "kuangchao.cli.main", "train", *flags, "--config", TINY]
    argv += [a for s in sets for a in ("--set", s)]
    out = subprocess.run(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400
    )
    (tmp_path / "console.txt").write_text(out.stdout)
    return out.returncode, out.stdout


@pytest.mark.e2e
@pytest.mark.slow
def test_a_whole_kc_train_console_speaks_in_one_voice(tmp_path):
    code, text = _kc_train(tmp_path / "default")
    assert code == 0, text[-4000:]
    assert _problems(text) == [], "\n".join(_problems(text)[:20])
    said = [parse(line) for line in text.splitlines() if line.strip()]
    sources = {s[2] for s in said}
    assert {"kc", "flow", "task", "torch"} <= sources, sources  # torch's C++ lines were there, and rewritten
    messages = [s[3] for s in said]
    assert any(m.startswith("step 2/4  loss ") for m in messages) and any(
        m.startswith("step 4/4  loss ") for m in messages
    )
    assert any(m.startswith("done: task kc-voice-") for m in messages)

    code, quiet = _kc_train(tmp_path / "quiet", "-q")
    assert code == 0, quiet[-4000:]
    assert _problems(quiet) == [], "\n".join(_problems(quiet)[:20])
    lines = [parse(line) for line in quiet.splitlines() if line.strip()]
    assert lines[-1][3].startswith("done: task kc-voice-"), quiet  # the result, the last line
    assert [ln for ln in lines[:-1] if ln[1] not in ("WARNING", "ERROR", "CRITICAL")] == [], quiet
    assert len(lines) < len(said) / 4, quiet  # the control: the same run without -q says much more
