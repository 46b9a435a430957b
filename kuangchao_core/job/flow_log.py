"""What the flow run's own Prefect log says (``prefect flow-run logs <id>``, the UI's log tab), issue 27 §5.

- :class:`ProgressLog`: a listener of the ranks' events that writes the training progress into the run's log — one
  line per ``step`` event (the ranks emit those every ``train.log_interval`` steps and at the last one), one per
  held-out evaluation, the anomaly tally when the attempt ends;
- :class:`TaskRunNameFormatter`: the records a task run sends to the Prefect API carry its name in the message
  (``Task run 'launch-0ab' - Finished in state Completed()``). Prefect's console formatter adds that prefix, but the
  API handler stores the bare message, and ``prefect flow-run logs`` prefixes every line with the *flow* run's name
  only, so the task runs' state lines could not be told apart.

Nothing here imports Prefect (issue 43 item 6): ``tasks/prefect_logs.py`` gives the API handlers this formatter and
makes the run's logger, which reaches the launch as ``RunHooks.run_logger``.
"""

from __future__ import annotations

import logging
from typing import Any

from kuangchao_core.obs.console import anomaly_lines, format_step


class TaskRunNameFormatter(logging.Formatter):
    """The API handler's formatter: a task run's record gets ``Task run '<name>' - `` before its message."""

    def format(self, record: logging.LogRecord) -> str:
        """The message, named after its task run when it comes from one (and does not name it already)."""
        message = super().format(record)
        name = getattr(record, "task_run_name", None)
        if name and not message.startswith("Task run "):
            return f"Task run {name!r} - {message}"
        return message


class ProgressLog:
    """Listener of one attempt's events (``LiveView.listeners``) that writes the progress into ``logger``."""

    def __init__(self, logger: Any):
        self.logger = logger
        self.anomalies: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        """Log a ``step``, ``eval_loss`` or ``eval`` event as one line; count anomalies; the tally at ``done``."""
        kind = event.get("event")
        if kind == "step":
            self.logger.info(format_step(event))
        elif kind == "eval_loss":
            match = event.get("eval_exact_match")
            self.logger.info(
                "eval at step %s: held-out loss %.4f%s",
                event.get("step"),
                event.get("eval_loss", float("nan")),
                f", exact match {match:.3f}" if isinstance(match, (int, float)) else "",
            )
        elif kind == "eval":
            acc = event.get("heldout_accuracy")
            self.logger.info(
                "held-out exact-match accuracy %s at the end",
                f"{acc:.3f}" if isinstance(acc, (int, float)) else "n/a",
            )
        elif kind == "anomaly":
            self.anomalies.append(event)
        elif kind == "done" and self.anomalies:
            for line in anomaly_lines(self.anomalies):
                self.logger.warning("anomaly %s", line)
