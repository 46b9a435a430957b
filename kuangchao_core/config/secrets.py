"""Credentials that arrive inside a config (a URL's ``user:password@``) are taken out before the config is written,
logged or handed to workers (SPEC: secrets never in run directories or MLflow params).

:func:`split_url_credentials` returns the URL without its user information and the credentials apart;
:func:`redact_url` is the same URL with them replaced by ``***`` for anything meant to be read by people.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit


def split_url_credentials(url: str) -> tuple[str, str | None, str | None]:
    """(the URL without ``user:password@``, user, password); unchanged with (None, None) when it has none."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None, None
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    clean = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    user = unquote(parts.username) if parts.username is not None else None
    password = unquote(parts.password) if parts.password is not None else None
    return clean, user, password


def redact_url(url: str | None) -> str | None:
    """``url`` with any ``user:password@`` shown as ``***@`` (None stays None)."""
    if not url:
        return url
    clean, user, password = split_url_credentials(url)
    if user is None and password is None:
        return url
    scheme, _, rest = clean.partition("://")
    return f"{scheme}://***@{rest}" if rest else "***@" + clean


def take_checkpoint_credentials(data: dict[str, Any], secrets: dict[str, Any] | None) -> dict[str, Any]:
    """Move credentials out of ``checkpoint.endpoint_url`` of a raw config mapping into ``secrets``
    (``s3_url_credentials``: access key id, secret); returns the mapping (changed in place)."""
    ckpt = data.get("checkpoint") if isinstance(data, dict) else None
    url = ckpt.get("endpoint_url") if isinstance(ckpt, dict) else None
    if not isinstance(url, str):
        return data
    clean, user, password = split_url_credentials(url)
    if user is None and password is None:
        return data
    ckpt["endpoint_url"] = clean
    if secrets is not None:
        secrets["s3_url_credentials"] = (user, password)
    return data
