"""Direct calls to the configured Prefect API, for the watch of a flow run's process
(:mod:`kuangchao_core.obs.prefect_watch`): plain HTTP with short timeouts, so that a server that stopped answering
costs seconds, not the client's minute of retries. The client's settings (the URL, the authentication) come from
the caller's :class:`~kuangchao_core.obs.run_hooks.RunHooks`: nothing here imports Prefect (issue 43 item 6)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from kuangchao_core.obs.run_hooks import RunHooks


def configured_api_url(hooks: RunHooks) -> str | None:
    """The ``PREFECT_API_URL`` the orchestrator's settings name (None: Prefect's ephemeral API, nothing to watch)."""
    url = hooks.api_url()
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


def flow_run_state(url: str, flow_run_id: str, headers: dict[str, str], timeout_s: float = 3.0) -> tuple[str, str]:
    """``(type, name)`` of the flow run's state as the API at ``url`` has it (``("", "")`` when it did not say)."""
    request = urllib.request.Request(f"{url}/flow_runs/{flow_run_id}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            state = json.loads(response.read()).get("state") or {}
    except (urllib.error.URLError, OSError, ValueError):
        return "", ""
    return str(state.get("type") or ""), str(state.get("name") or "")


def mark_cancelled(url: str, flow_run_id: str, message: str, headers: dict[str, str], timeout_s: float = 2.0) -> bool:
    """Set the flow run's state to Cancelled (forced) within ``timeout_s``, authenticated by ``headers`` (the
    client's: ``RunHooks.auth_headers``); whether the API took it. For a process that ends at once (a second
    Ctrl-C) and cannot wait for its flow engine to report the state."""
    body = {"state": {"type": "CANCELLED", "name": "Cancelled", "message": message}, "force": True}
    request = urllib.request.Request(
        f"{url}/flow_runs/{flow_run_id}/set_state",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read()).get("status") == "ACCEPT"
    except (urllib.error.URLError, OSError, ValueError):
        return False
