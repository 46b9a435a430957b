"""Direct calls to the configured Prefect API and the client's settings, for the watch of a flow run's process
(:mod:`kuangchao_core.obs.prefect_watch`): plain HTTP with short timeouts, so that a server that stopped answering
costs seconds, not the client's minute of retries."""

from __future__ import annotations

import base64
import json
import logging
import urllib.error
import urllib.request

log = logging.getLogger("kuangchao.obs.prefect_watch")


def configured_api_url() -> str | None:
    """The configured ``PREFECT_API_URL`` (None: Prefect's ephemeral API, nothing to watch)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    return str(url).rstrip("/") if url else None


def api_answers(url: str, timeout_s: float = 3.0) -> str | None:
    """None when ``<url>/health`` answers (any response below 500), else the reason in a few words."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s):
            return None
    except urllib.error.HTTPError as exc:
        return None if exc.code < 500 else f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc))


def auth_headers() -> dict[str, str]:
    """What Prefect's own client sends to authenticate (an API key, or a self-hosted server's auth string)."""
    from prefect.settings import get_current_settings

    api = get_current_settings().api
    key = api.key.get_secret_value() if api.key else None
    if key:
        return {"Authorization": f"Bearer {key}"}
    auth = api.auth_string.get_secret_value() if api.auth_string else None
    return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}


def flow_run_state(url: str, flow_run_id: str, headers: dict[str, str], timeout_s: float = 3.0) -> tuple[str, str]:
    """``(type, name)`` of the flow run's state as the API at ``url`` has it (``("", "")`` when it did not say)."""
    request = urllib.request.Request(f"{url}/flow_runs/{flow_run_id}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            state = json.loads(response.read()).get("state") or {}
    except (urllib.error.URLError, OSError, ValueError):
        return "", ""
    return str(state.get("type") or ""), str(state.get("name") or "")


def mark_cancelled(url: str, flow_run_id: str, message: str, timeout_s: float = 2.0) -> bool:
    """Set the flow run's state to Cancelled (forced) within ``timeout_s``; whether the API took it. For a process
    that ends at once (a second Ctrl-C) and cannot wait for its flow engine to report the state."""
    body = {"state": {"type": "CANCELLED", "name": "Cancelled", "message": message}, "force": True}
    request = urllib.request.Request(
        f"{url}/flow_runs/{flow_run_id}/set_state",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **auth_headers()},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read()).get("status") == "ACCEPT"
    except (urllib.error.URLError, OSError, ValueError):
        return False


def flow_run_id_here() -> str | None:
    """The id of the flow run this code runs in (None outside one)."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return str(context.flow_run.id) if context is not None and context.flow_run is not None else None


def in_flow_run() -> bool:
    """Whether this code runs inside a Prefect flow or task run (an artifact has something to attach to)."""
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


_SAVED_RETRIES: list[int] = []


def client_fails_fast(on: bool) -> None:
    """Prefect's client retries a refused connection for about a minute per call (2 + 4 + … + 32 s) once it has
    reached the server: with the API lost, the calls the flow's clean-up still makes (audit pins, the seal's
    artifact) fail at once instead (``client.max_retries`` 0 in the process's settings; restored by ``on=False``)."""
    try:
        from prefect.context import GLOBAL_SETTINGS_CONTEXT
        from prefect.settings import get_current_settings

        settings = {id(s): s for s in (GLOBAL_SETTINGS_CONTEXT.settings, get_current_settings())}.values()
        if on and not _SAVED_RETRIES:
            _SAVED_RETRIES.append(GLOBAL_SETTINGS_CONTEXT.settings.client.max_retries)
            for s in settings:
                s.client.max_retries = 0
        elif not on and _SAVED_RETRIES:
            value = _SAVED_RETRIES.pop()
            for s in settings:
                s.client.max_retries = value
    except Exception as exc:  # noqa: BLE001 - another Prefect's settings: the deadline of exit_when_lost still holds
        log.warning("could not shorten Prefect's client retries: %s", exc)
