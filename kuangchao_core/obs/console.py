"""The live console view of a training job, fed by the workers' ``KC_EVENT`` lines.

On a terminal it draws a progress bar with the latest metrics and ETA (rich); elsewhere (CI, pipes) it prints one
plain line per logged step. Worker lines that are not events are shown when they look like warnings or errors —
but not torchrun's failure reports (its ``ChildFailedError`` traceback and ``====`` block, its elastic agent's
log lines) nor the ranks' Python tracebacks (:class:`FailureNoise`): the cause of a failed attempt is said once
by the orchestrator, and the full output stays in the attempt's ``launcher.log`` and ``logs/``.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any, TextIO

from kuangchao_core.obs import voice
from kuangchao_core.obs.jsonlog import parse_event


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.1f}{unit}" if unit != "B" and abs(n) < 10 else f"{n:.0f}{unit}"
        n /= 1024
    return f"{n:.0f}PiB"


def for_people(value: Any) -> str:
    """A value as people read it: floats to 4 significant digits, large ones with thousands separators (JSON and
    MLflow keep full precision)."""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if _is_anomaly_list(value):
        return "\n".join(anomaly_lines(value)) or "none"
    if isinstance(value, dict) and all(isinstance(v, (int, float, str, type(None))) for v in value.values()):
        return ", ".join(f"{k} {for_people(v)}" for k, v in value.items())  # e.g. the held-out figures
    return str(value)


def _is_anomaly_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(a, dict) and "kind" in a and "step" in a for a in value)
    )


def anomaly_lines(anomalies: list[dict[str, Any]]) -> list[str]:
    """One short line per anomaly kind, in order of first appearance: ``comm_share ×3, steps 134–2917 (warn)``
    (the run summary's anomaly row and the console's tally; every flag stays in the JSON summary and MLflow)."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for a in anomalies:
        kinds.setdefault(str(a.get("kind")), []).append(a)
    lines = []
    for kind, seen in kinds.items():
        first, last = seen[0].get("step"), seen[-1].get("step")
        steps = f"step {first}" if len(seen) == 1 else f"steps {first}–{last}"
        lines.append(f"{kind} ×{len(seen)}, {steps} ({seen[-1].get('action', 'warn')})")
    return lines


def format_step(ev: dict[str, Any]) -> str:
    """One human line for a step event."""
    eta = ev.get("eta_s")
    eta_s = f"{eta:.0f}s" if isinstance(eta, (int, float)) else "-"
    return (
        f"step {ev.get('step')}/{ev.get('total_steps')}  loss {ev.get('loss', float('nan')):.4f}  "
        f"lr {ev.get('lr', 0.0):.2e}  {ev.get('tokens_per_s', 0.0):,.0f} tok/s  "
        f"grad_norm {ev.get('grad_norm', 0.0):.3f}  {ev.get('mem_kind', 'mem')} {_fmt_bytes(ev.get('mem_bytes'))}  "
        f"comm {100 * ev.get('comm_share', 0.0):.1f}%  ETA {eta_s}"
    )


def format_memory(ev: dict[str, Any]) -> str:
    """One human line for the memory event: measured tensor bytes vs the plan's estimate, and process memory."""
    est = ev.get("plan_estimate_bytes")
    kind = "process RSS (runtime and libraries included)" if ev.get("mem_kind") == "rss" else "CUDA peak allocated"
    return (
        f"memory of rank 0: tensors {_fmt_bytes(ev.get('tensor_bytes'))} measured (params + grads + optimizer), "
        f"kc plan estimated {_fmt_bytes(est) if est is not None else 'n/a'}; {kind} {_fmt_bytes(ev.get('mem_bytes'))}"
    )


def _noteworthy(line: str, notes: voice.RelayedLines) -> tuple[str, str, str] | None:
    """What the console shows of a non-event line, as ``(level, source, message)``: free text as it is (under its
    rank, or torchrun; torch's C++ warnings rewritten once, :class:`~kuangchao_core.obs.voice.RelayedLines`), a JSON
    log record of level WARNING or above as its message (the JSON stays in ``launcher.log`` and the JSON log
    files), and nothing for other records, nor for an anomaly's own log record (the anomaly events are tallied)."""
    text = line.strip()
    if not text:
        return None
    body = text[text.find("{") :] if "{" in text else text
    try:
        record = json.loads(body)
    except (json.JSONDecodeError, ValueError):
        return notes(line)  # free text (torchrun messages, prints) is always shown
    if not isinstance(record, dict) or record.get("level") not in ("WARNING", "ERROR", "CRITICAL"):
        return None
    if "anomaly" in record:
        return None
    who = f"rank{record['rank']}" if record.get("rank") is not None else str(record.get("module_id") or "worker")
    return str(record["level"]), who.replace(" ", "_"), str(record.get("msg", ""))


#: the launcher's ``[rank<r>]:`` prefix, and torch's own ``[rank<r>]: `` on a rank's traceback after it
_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:(?:\[rank\d+\]: ?)*")
#: torchrun's elastic agent's own log lines (glog style: ``E1203 00:41:11.000000 123 torch/distributed/...] ...``)
_ELASTIC_LOG = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ .*torch/(csrc/)?distributed/")
#: a rank's own c10d error lines (``[E1203 ... ProcessGroupGloo.cpp:...] ... Connection closed by peer``)
_C10D_ERROR = re.compile(r"^\[?[EF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ .*torch/csrc/distributed/")
_BANNER = re.compile(r"^\s*={20,}\s*$")
_CHAINED = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)


class FailureNoise:
    """Tells the lines of a failure's reports apart from what the workers say: Python tracebacks (of any rank, or
    torchrun's own ``ChildFailedError``), torchrun's ``====`` failure block and its elastic agent's log lines.

    Stateful per source (each rank, and torchrun itself): a ``Traceback (most recent call last):`` line starts a
    traceback, which runs through its indented frames, chained-exception headers, the exception's line and that
    message's indented continuation lines; a ``====`` banner opens a report that the next banner closes."""

    def __init__(self) -> None:
        self._state: dict[str, str] = {}  # source -> "frames" | "message"
        self._in_report = False

    def __call__(self, line: str) -> bool:
        """Whether ``line`` is part of a failure report (to be left out of the console view)."""
        m = _RANK_PREFIX.match(line)
        source, body = (m.group(1), line[m.end() :]) if m else ("torchrun", line)
        text = body.rstrip()
        bare = text.strip()
        if not m and _BANNER.match(text):
            self._in_report = not self._in_report
            return True
        if not m and (self._in_report or _ELASTIC_LOG.match(text)):
            return True
        if m and _C10D_ERROR.match(bare):
            return True
        if bare == "Traceback (most recent call last):":
            self._state[source] = "frames"
            return True
        if bare in _CHAINED:
            return True
        state = self._state.get(source)
        if state is None:
            return False
        if not bare or text.startswith((" ", "\t")):
            return True  # a frame, or the exception message's next line
        if state == "frames":
            self._state[source] = "message"  # the exception's own line
            return True
        del self._state[source]  # the worker speaks again
        return False


def format_eval(event: dict[str, Any]) -> str:
    """One evaluation's line: the held-out loss, what it covered and what it took."""
    line = f"held-out loss {event.get('eval_loss', float('nan')):.4f} at step {event.get('step')}"
    if event.get("eval_tokens") is not None:
        line += f" over {event['eval_tokens']} tokens ({event.get('eval_windows')} windows)"
    if event.get("eval_nats_per_char") is not None:  # the text those tokens spell (issue 39 item 5)
        line += f" = {event['eval_nats_per_char']:.4f} nats/char, {event['eval_bits_per_byte']:.4f} bits/byte"
    if event.get("eval_exact_match") is not None:
        line += f", exact match {event['eval_exact_match']:.3f} on {event.get('samples')} samples"
    if event.get("eval_time_s") is not None:
        line += f", {event['eval_time_s']:.2f} s"
    return line


class LiveView:
    """Consumes launcher output lines; keeps the latest step event for the run summary."""

    def __init__(
        self, stream: TextIO | None = None, rich_live: bool | None = None, task: str = "train", quiet: bool = False
    ):
        self.stream = stream or sys.stdout
        self.quiet = quiet  # logging.console: false — events are still collected, nothing is printed
        self.rich_live = False if quiet else (self.stream.isatty() if rich_live is None else rich_live)
        self.task = task
        self.last_step: dict[str, Any] | None = None
        self.events: list[dict[str, Any]] = []
        self._progress = None
        self._task_id = None
        self._noise = FailureNoise()
        self._notes = voice.RelayedLines()
        #: the ranks' anomaly events, in order (rank 0 reports for the job); tallied per kind by :meth:`close`
        self.anomalies: list[dict[str, Any]] = []
        self._tallied = False
        #: called with every event of the ranks (the Prometheus metrics, anomaly reactions of the orchestrator)
        self.listeners: list = []

    def __call__(self, line: str) -> None:
        self.handle_line(line)

    def handle_line(self, line: str) -> None:
        """Render one line of worker/launcher output."""
        event = parse_event(line)
        if event is None:
            if self._noise(line):
                return  # a failure report: in launcher.log, and its cause is said once by the orchestrator
            shown = _noteworthy(line, self._notes)
            if shown is not None:
                level, source, text = shown
                self._print(text, always=True, level=level, source=source)  # even without the console view
            return
        kind = event.get("event")
        for listener in self.listeners:
            try:
                listener(event)
            except Exception as exc:  # a listener's failure never stops the view of the run
                self._print(f"event listener failed: {exc}", always=True, level="WARNING")
        if kind == "steps":
            return  # every step's metrics, for the listeners (Prometheus); the console speaks at log_interval
        if kind == "step":
            self.last_step = event
            self._on_step(event)
        else:
            self.events.append(event)
            if kind == "start":
                self._start_bar(event)
            elif kind == "checkpoint":
                self._print(f"checkpoint saved at step {event.get('step')}")
            elif kind == "eval":
                floor = event.get("loss_floor")
                floor_s = f"{floor:.4f}" if isinstance(floor, (int, float)) else "n/a"
                acc = event.get("heldout_accuracy")
                acc_s = f"{acc:.3f}" if isinstance(acc, (int, float)) else "n/a (no answers in the held-out data)"
                self._print(f"held-out exact-match accuracy {acc_s} (loss floor {floor_s} nats/token)")
                if event.get("samples"):
                    self._print("sample answers of the final model:\n" + str(event["samples"]).rstrip())
            elif kind == "memory":
                self._print(format_memory(event))
            elif kind == "eval_loss":
                self._print(format_eval(event))
            elif kind == "anomaly":
                self._on_anomaly(event)
            elif kind == "done":
                self.close()

    def _on_anomaly(self, event: dict[str, Any]) -> None:
        """Count it; the console says each kind once, with its count, when the view closes (the step lines and
        the progress bar show the counts so far). An anomaly that ends the run (``stop``) is said at once."""
        self.anomalies.append(event)
        if event.get("action") == "stop":
            stop = f"anomaly {event.get('kind')} at step {event.get('step')}: {event.get('message')}"
            self._print(stop, always=True, level="ERROR")

    def anomaly_counts(self) -> str:
        """The anomalies so far, for a step line: ``anomalies comm_share×2 grad_norm×1`` (empty when none)."""
        counts: dict[str, int] = {}
        for a in self.anomalies:
            counts[str(a.get("kind"))] = counts.get(str(a.get("kind")), 0) + 1
        return ("anomalies " + " ".join(f"{k}×{n}" for k, n in counts.items())) if counts else ""

    def _start_bar(self, event: dict[str, Any]) -> None:
        if not self.rich_live or self._progress is not None:
            self._print(f"training {self.task}: steps {event.get('start_step')}→{event.get('total_steps')}")
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
            console=Console(file=self.stream),
            transient=False,
        )
        self._progress.start()
        self._task_id = self._progress.add_task(
            self.task, total=event.get("total_steps"), completed=event.get("start_step", 0), metrics=""
        )

    def _on_step(self, event: dict[str, Any]) -> None:
        if self._progress is not None:
            metrics = (
                f"loss {event.get('loss', 0):.4f} lr {event.get('lr', 0):.1e} "
                f"{event.get('tokens_per_s', 0):,.0f} tok/s comm {100 * event.get('comm_share', 0):.0f}%"
            )
            counts = self.anomaly_counts()
            metrics += f" {counts}" if counts else ""
            self._progress.update(self._task_id, completed=event.get("step"), metrics=metrics)
        else:
            counts = self.anomaly_counts()
            self._print(format_step(event) + (f"  {counts}" if counts else ""))

    def note(self, text: str, level: str = "INFO", source: str = "kc") -> None:
        """Say a line of the orchestrator's about the attempt (a Slurm job's state) beside the workers' lines."""
        self._print(text, level=level, source=source)

    def _print(self, text: str, always: bool = False, level: str = "INFO", source: str = "kc") -> None:
        """``text`` as console lines (:func:`~kuangchao_core.obs.voice.render`); ``always`` even when the view is
        quiet (``logging.console: false``), if ``level`` reaches the console's threshold (``kc train -q``)."""
        if (self.quiet and not always) or logging.getLevelName(level) < voice.threshold():
            return
        text = voice.render(text, level, source)
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        """Stop the progress bar and say each anomaly kind once, with its count and steps (idempotent)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if not self._tallied and self.anomalies:
            self._tallied = True
            for line in anomaly_lines(self.anomalies):
                self._print(f"anomaly {line}", always=True, level="WARNING")
