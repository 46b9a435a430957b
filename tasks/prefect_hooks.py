"""The Prefect side of a job (issue 43 item 6): :data:`PREFECT_HOOKS`, the core's
:class:`~kuangchao_core.obs.run_hooks.RunHooks` answered by Prefect, which the tasks pass down to the core."""

from __future__ import annotations

from typing import Any

from kuangchao_core.obs.run_hooks import RunHooks
from tasks.prefect_client import auth_headers, client_fails_fast, flow_run_id_here, settings_api_url
from tasks.prefect_logs import run_logger_or_none


def in_prefect_run() -> bool:
    """True inside a Prefect flow or task run."""
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def markdown_artifact(markdown: str, key: str, description: str) -> Any:
    """A Prefect markdown artifact (of the current run, when there is one)."""
    from prefect.artifacts import create_markdown_artifact

    return create_markdown_artifact(markdown=markdown, key=key, description=description)


def prefect_event(name: str, resource: dict[str, str], payload: dict[str, Any]) -> Any:
    """The Prefect event ``name`` (None when no Prefect API is reachable)."""
    from prefect.events import emit_event

    return emit_event(event=name, resource=resource, payload=payload)


PREFECT_HOOKS = RunHooks(
    in_run=in_prefect_run,
    artifact=markdown_artifact,
    event=prefect_event,
    run_logger=run_logger_or_none,
    api_url=settings_api_url,
    auth_headers=auth_headers,
    flow_run_id=flow_run_id_here,
    client_fails_fast=client_fails_fast,
)
