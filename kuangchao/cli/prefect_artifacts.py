"""``kc audit``'s reader of Prefect artifacts: the
:class:`~kuangchao_core.perm.audit_external.ArtifactSource` of the Prefect API this shell is configured for
(issue 43 item 6: the core reads the ``kc-audit-pin`` artifacts through it and imports no Prefect)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kuangchao_core.perm.audit_external import ArtifactSource

PAGE = 200


def configured_api() -> str | None:
    """``PREFECT_API_URL`` of the current Prefect settings; None when unset."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def artifacts(key: str, most: int) -> Iterator[tuple[Any, Any, Any]]:
    """``(id, flow run id, data)`` of the artifacts named ``key``, in pages of :data:`PAGE`, at most ``most``."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        offset = 0
        while offset < most:
            page = client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), limit=PAGE, offset=offset
            )
            for art in page:
                yield art.id, art.flow_run_id, art.data
            if len(page) < PAGE:
                break
            offset += len(page)


PREFECT_ARTIFACTS = ArtifactSource(api=configured_api, artifacts=artifacts)
