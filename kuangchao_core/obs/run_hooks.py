"""What the engine asks of the orchestrator it runs under, given by the caller (issue 43 item 6).

The core imports no Prefect: the few things a job hands its orchestrator — is this a flow or task run, a markdown
artifact, an event, a logger into the run's own log — are the callables of a :class:`RunHooks` that the
orchestration layer builds (``tasks/prefect_hooks.py`` ``PREFECT_HOOKS``) and passes down. :data:`NO_HOOKS`, the
default, is a process outside any run: nothing to attach an artifact, an event or a log line to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


@dataclass(frozen=True)
class RunHooks:
    """The orchestrator's side of a job: each callable may raise (the callers log it and go on).

    - ``in_run()``: True inside a flow or task run;
    - ``artifact(markdown, key, description)``: a markdown artifact of the run;
    - ``event(name, resource, payload)``: an event (``resource`` names what it is about);
    - ``run_logger()``: a logger into the run's own log (not the console), or None outside a run;
    - ``api_url()``: the API the orchestrator's in-process settings name (a test harness's), or None;
    - ``auth_headers()``: the headers its client sends the API to authenticate;
    - ``flow_run_id()``: the id of the flow run this code runs in, or None;
    - ``client_fails_fast(on)``: its client stops (``on``) or resumes retrying refused connections.
    """

    in_run: Callable[[], bool] = lambda: False
    artifact: Callable[[str, str, str], Any] = _nothing
    event: Callable[[str, dict[str, str], dict[str, Any]], Any] = _nothing
    run_logger: Callable[[], Any] = _nothing
    api_url: Callable[[], str | None] = _nothing
    auth_headers: Callable[[], dict[str, str]] = dict
    flow_run_id: Callable[[], str | None] = _nothing
    client_fails_fast: Callable[[bool], None] = _nothing


NO_HOOKS = RunHooks()
