"""The Prefect client's settings and context for the core's watch of the API (issue 26 §5), moved out of the core
by issue 43 item 6; :data:`tasks.prefect_hooks.PREFECT_HOOKS` hands them down."""

from __future__ import annotations

import base64
import logging

log = logging.getLogger("kuangchao.obs.prefect_watch")
_SAVED_RETRIES: list[int] = []


def settings_api_url() -> str | None:
    """``PREFECT_API_URL`` of the current Prefect settings (a test harness's included); None when unset."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def auth_headers() -> dict[str, str]:
    """What Prefect's own client sends to authenticate (an API key, or a self-hosted server's auth string)."""
    from prefect.settings import get_current_settings

    api = get_current_settings().api
    key = api.key.get_secret_value() if api.key else None
    if key:
        return {"Authorization": f"Bearer {key}"}
    auth = api.auth_string.get_secret_value() if api.auth_string else None
    return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}


def flow_run_id_here() -> str | None:
    """The id of the flow run this code runs in (None outside one)."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return str(context.flow_run.id) if context is not None and context.flow_run is not None else None


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
