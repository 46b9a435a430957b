"""Reason codes of the permission layer and the errors that carry them.

Callers of the token verifier get a generic message (no oracle for forgers); the precise reason code travels
in ``.code`` for logs and the audit file. Guard denials (an operation outside the token's rights) carry the
reason both in the message and in ``.code``, since they help the operator and reveal nothing about signing.
"""

from __future__ import annotations

from kuangchao_core.errors import PermissionDenied

# token verification (reference §4.2 checklist)
MALFORMED = "malformed"
UNSUPPORTED_VERSION = "unsupported_version"
BAD_SIGNATURE = "bad_signature"
UNKNOWN_KEY = "unknown_key"
REVOKED_KEY = "revoked_key"
RETIRED_KEY = "retired_key"
WRONG_TYPE = "wrong_type"
WRONG_ISSUER = "wrong_issuer"
WRONG_SUBJECT = "wrong_subject"
AUDIENCE = "audience"
EXPIRED = "expired"
NOT_YET_VALID = "not_yet_valid"
TTL_TOO_LONG = "ttl_too_long"
WRONG_JOB = "wrong_job"
STALE_ATTEMPT = "stale_attempt"
REVOKED = "revoked"
REPLAY = "replay"
# authorization (guard)
NO_TOKEN = "no_token"
OUT_OF_SCOPE = "out_of_scope"
ROLE_DENIED = "role_denied"
UNKNOWN_ROLE = "unknown_role"
EXPLICIT_DENY = "explicit_deny"
# renewal
SCOPE_WIDENING = "scope_widening"
RENEWAL_LATE = "renewal_late"
SESSION_CAP = "session_cap"
RENEWAL_LIMIT = "renewal_limit"

# human phrases for `kc audit` lines and guard messages
PHRASES = {
    MALFORMED: "malformed token",
    UNSUPPORTED_VERSION: "unsupported token version",
    BAD_SIGNATURE: "bad token signature",
    UNKNOWN_KEY: "unknown signing key",
    REVOKED_KEY: "signing key revoked",
    RETIRED_KEY: "signing key retired",
    WRONG_TYPE: "wrong token type",
    WRONG_ISSUER: "untrusted issuer",
    WRONG_SUBJECT: "token belongs to another module",
    AUDIENCE: "token for another audience",
    EXPIRED: "token expired",
    NOT_YET_VALID: "token not yet valid",
    TTL_TOO_LONG: "token lifetime too long",
    WRONG_JOB: "token of another job",
    STALE_ATTEMPT: "token of an earlier attempt",
    REVOKED: "token revoked",
    REPLAY: "one-shot token replayed",
    NO_TOKEN: "no capability token",
    OUT_OF_SCOPE: "outside the token's scope",
    ROLE_DENIED: "not permitted by the module's role",
    UNKNOWN_ROLE: "role not defined in the policy",
    EXPLICIT_DENY: "explicitly denied by the role",
    SCOPE_WIDENING: "renewal may not widen scope",
    RENEWAL_LATE: "renewal after expiry",
    SESSION_CAP: "session lifetime cap reached",
    RENEWAL_LIMIT: "too many renewals",
}


def phrase(code: str) -> str:
    """A short human phrase for a reason code (the code itself when unknown)."""
    return PHRASES.get(code, code)


class TokenRejected(PermissionDenied):
    """A capability token failed verification; ``code`` is the precise reason, the message stays generic."""

    def __init__(self, code: str, jti: str | None = None, module_id: str | None = None):
        self.code = code
        self.jti = jti
        super().__init__(
            "token_verify",
            "token",
            "invalid capability token; the audit log has the reason (ask the job owner to reissue tokens)",
            module_id,
        )


class GuardDenied(PermissionDenied):
    """An operation outside the module's rights; ``code`` is the reason code."""

    def __init__(self, interface: str, resource: str, code: str, module_id: str | None = None):
        self.code = code
        super().__init__(interface, resource, f"{phrase(code)} [{code}]", module_id)
