"""One voice on the console (issue 45 §3): every line ``kc`` prints is ``HH:MM:SS.mmm LEVEL   source: message``.

The sources: ``kc`` (kc's own lines: progress, refusals, the result), ``flow`` and ``task`` (Prefect's run loggers:
the flow's progress lines and the tasks' states), ``prefect`` (Prefect itself), ``mlflow``, ``rank<r>`` (a worker's
own lines, relayed by the live view), ``torchrun``, ``torch`` (torch's C++ warnings, each said once) and ``slurm``
(a Slurm job's states).

Python loggers in the ``kc`` process reach the console through :class:`ConsoleHandler` (Prefect's logging config,
``prefect_logging.yml`` beside this module, names it; MLflow's loggers propagate to it); the workers' and torchrun's
lines are rewritten by :class:`RelayedLines`. How much is said: :func:`threshold` (``-q`` warnings and errors, ``-v``
debug), kept in the environment so that every process ``kc`` starts agrees.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import TextIO

#: the console's threshold, a level name (``kc train -q`` sets WARNING, ``-v`` DEBUG; INFO when unset)
ENV_LEVEL = "KC_CONSOLE_LEVEL"
#: Prefect's logging config that sends its console lines through :class:`ConsoleHandler`
PREFECT_LOGGING_YML = Path(__file__).with_name("prefect_logging.yml")

#: one console line: the time, the level, the source and the message (the message may be empty)
LINE = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) (DEBUG|INFO|WARNING|ERROR|CRITICAL) +([A-Za-z0-9_.-]+): (.*)$")

#: a worker's line as torchrun relays it: ``[rank<r>]:``, and torch's own ``[rank<r>]: `` repeated after it
_RANK = re.compile(r"^\[rank(\d+)\]:(?:\[rank\d+\]: ?)*")
#: a glog-style line of torch's C++ code: ``[W1207 03:12:20.704000 123 path/file.cpp:45] message`` (the process id
#: is left out by some builds)
_GLOG = re.compile(r"^\[?([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+(?: +\d+)? ([^\]]*)\] ?(.*)$")
_GLOG_LEVELS = {"I": "INFO", "W": "WARNING", "E": "ERROR", "F": "CRITICAL"}
#: MLflow's own log format, where a process configured it (a rank on a Slurm node): ``2026/12/07 03:03:59 INFO
#: mlflow.store.db.utils: message``
_MLFLOW = re.compile(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+): (.*)$")
#: torch C++ warnings that say nothing a user can act on: debug lines (``-v``) instead of warnings
_HARMLESS = ("The hostname of the client socket cannot be retrieved",)


def environment(env: dict[str, str] | None = None) -> None:
    """Set what ``kc`` needs for one voice and no telemetry in ``env`` (default ``os.environ``), where the user has
    not set it: Prefect's logging config (:data:`PREFECT_LOGGING_YML`), MLflow's own log handler off (its lines
    propagate to ours), Prefect's and MLflow's telemetry off."""
    env = os.environ if env is None else env
    env.setdefault("PREFECT_LOGGING_SETTINGS_PATH", str(PREFECT_LOGGING_YML))
    env.setdefault("MLFLOW_CONFIGURE_LOGGING", "false")
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # the server's heartbeat ("Failed to send telemetry")
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    env.setdefault("DO_NOT_TRACK", "true")  # Prefect's client and MLflow both read it


def set_threshold(level: str) -> None:
    """Say lines of ``level`` and above from now on, in this process and those it starts (``-q``, ``-v``)."""
    os.environ[ENV_LEVEL] = level
    if level == "DEBUG":
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "DEBUG")
        os.environ.setdefault("PREFECT_LOGGING_ROOT_LEVEL", "INFO")  # MLflow's and the other libraries' INFO too


def threshold() -> int:
    """The console's threshold as a logging level number (INFO unless :func:`set_threshold` said otherwise)."""
    level = logging.getLevelName(os.environ.get(ENV_LEVEL, "INFO").upper())
    return level if isinstance(level, int) else logging.INFO


def render(message: object, level: str = "INFO", source: str = "kc", when: float | None = None) -> str:
    """``message`` as console lines, each with the time, level and source (a message of several lines gives as
    many lines, each prefixed)."""
    when = time.time() if when is None else when
    stamp = time.strftime("%H:%M:%S", time.localtime(when)) + f".{int(when % 1 * 1000):03d}"
    lines = str(message).splitlines() or [""]
    return "\n".join(f"{stamp} {level:<7} {source}: {line}" for line in lines)


def say(message: object, level: str = "INFO", source: str = "kc", stream: TextIO | None = None) -> None:
    """Print ``message`` as console lines (standard error unless ``stream``) when ``level`` reaches the threshold."""
    if logging.getLevelName(level) < threshold():
        return
    stream = stream or sys.stderr
    stream.write(render(message, level, source) + "\n")
    stream.flush()


def result(message: object, level: str = "INFO", stream: TextIO | None = None) -> None:
    """Print the command's final line (its result, or why it ended) whatever the threshold (``-q`` keeps it)."""
    stream = stream or sys.stderr
    stream.write(render(message, level, "kc") + "\n")
    stream.flush()


def parse(line: str) -> tuple[str, str, str, str] | None:
    """A console line's (time, level, source, message), or None when ``line`` is not one."""
    m = LINE.match(line.rstrip("\n"))
    return (m.group(1), m.group(2), m.group(3), m.group(4)) if m else None


def message_of(line: str) -> str:
    """What a console line says, without its time, level and source (``line`` itself when it is not one)."""
    parsed = parse(line)
    return parsed[3] if parsed else line


class RelayedLines:
    """Rewrites the lines of workers and torchrun: ``(level, source, message)`` per line — a rank's own under
    ``rank<r>``, torch's C++ lines under ``torch``, MLflow's (its own format, where a rank configured it) under
    ``mlflow`` — or None for a line to leave out (a torch C++ warning already said: each once, not once per rank)."""

    def __init__(self) -> None:
        self._said: set[str] = set()

    def __call__(self, line: str) -> tuple[str, str, str] | None:
        m = _RANK.match(line)
        source, body = (f"rank{m.group(1)}", line[m.end() :]) if m else ("torchrun", line)
        body = body.rstrip()
        parsed = parse(body)
        if parsed:  # a worker that speaks in this voice already (its Prefect or kc logger)
            return parsed[1], source, parsed[3]
        mlflow = _MLFLOW.match(body.strip())
        if mlflow:
            return mlflow.group(1), mlflow.group(2).split(".", 1)[0], mlflow.group(3)
        glog = _GLOG.match(body.strip())
        if not glog:
            return "INFO", source, body
        message = glog.group(3).strip()
        if message in self._said:
            return None
        self._said.add(message)
        level = "DEBUG" if any(h in message for h in _HARMLESS) else _GLOG_LEVELS[glog.group(1)]
        return level, "torch", message


def source_of(record: logging.LogRecord) -> tuple[str, str]:
    """The source a log record is said under, and its message (a task run's name before the message)."""
    name, message = record.name, record.getMessage()
    if name.startswith("prefect.task_runs"):
        run = getattr(record, "task_run_name", None)
        return "task", f"{run}: {message}" if run else message
    if name.startswith("prefect.flow_runs"):
        return "flow", message
    top = name.split(".", 1)[0]
    if top == "kuangchao_core" or top == "kuangchao" or top == "flows" or top == "tasks":
        return "kc", message
    if top in ("root", "py"):  # the root logger, warnings.warn captured
        return "python", message
    return top, message


class VoiceFormatter(logging.Formatter):
    """A log record as console lines (:func:`render`), its exception's traceback, if any, on lines of its own."""

    def format(self, record: logging.LogRecord) -> str:
        source, message = source_of(record)
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        return render(message, record.levelname, source, record.created)


class ConsoleHandler(logging.StreamHandler):
    """Python log records on standard error in the one voice, from the threshold up (:func:`threshold`)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(VoiceFormatter())

    @property
    def stream(self) -> TextIO:  # the stderr of now (a test's capture, a redirected one), not of set-up time
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= threshold():
            super().emit(record)
