"""The enforcing guard (L5.2): a verified token ∩ its role, precomputed into sets; one lookup per operation.

Signatures are checked only when a token is loaded or renewed (:meth:`TokenGuard.update`); ``check`` is a dict
lookup, a set membership test and a monotonic-clock comparison against the token's expiry. Denials are always
audited with their reason code; allowed decisions are audited on first use per (module, interface, resource) and
then as periodic counts; every decision is logged at DEBUG level when that level is on.
"""

from __future__ import annotations

import logging
import threading
import time

from kuangchao_core.perm import reasons as R
from kuangchao_core.perm.audit import AuditLog
from kuangchao_core.perm.names import INTERFACE_KINDS, is_canonical_resource
from kuangchao_core.perm.roles import Policy, Role
from kuangchao_core.perm.tokens import ANY_GROUP, DEFAULT_LEEWAY_S, Claims

log = logging.getLogger("kuangchao.perm.guard")
_monotonic = time.monotonic


def effective_rights(claims: Claims, role: Role | None, policy: Policy) -> dict[str, frozenset[str]]:
    """interface -> the resources this module may use it on: token ∩ role ∩ the job's allowed interfaces."""
    if role is None:
        return {}
    granted = claims.resources()
    out: dict[str, frozenset[str]] = {}
    for itf in claims.interfaces:
        if not policy.interface_allowed(itf):
            continue
        kind = INTERFACE_KINDS[itf]
        res = frozenset(r for r in granted if r.partition(":")[0] == kind and role.allows(itf, r))
        if res:
            out[itf] = res
    return out


class TokenGuard:
    """The guard of one module, built from verified claims; implements ``check(interface, resource)``."""

    def __init__(
        self,
        claims: Claims,
        policy: Policy,
        *,
        audit: AuditLog | None = None,
        leeway_s: float = DEFAULT_LEEWAY_S,
        count_interval_s: float = 60.0,
        clock=time.time,
    ):
        self.policy = policy
        self.audit = audit
        self.leeway_s = leeway_s
        self.count_interval_s = count_interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self._reported: dict[tuple[str, str], int] = {}
        self._next_flush = _monotonic() + count_interval_s
        self.renewals_applied = 0
        self.revoked: str | None = None  # the reason, once the authority refused to renew this module's token
        self._debug = log.isEnabledFor(logging.DEBUG)
        self._install(claims)

    def _install(self, claims: Claims) -> None:
        role = self.policy.role(claims.role)
        rights = effective_rights(claims, role, self.policy)
        # interfaces granted on every group of the job (a ``groups: ["*"]`` token): a group is then checked by name
        self._any_group = frozenset(itf for itf, res in rights.items() if f"group:{ANY_GROUP}" in res)
        self._group_ok: dict[tuple[str, str], bool] = {}
        # expiry on the monotonic clock, so a wall-clock jump cannot extend a token
        deadline = _monotonic() + (claims.exp + self.leeway_s - self.clock())
        self._state = (rights, deadline)
        self.claims = claims
        self.role = role
        self.module_id = claims.sub

    def update(self, claims: Claims) -> None:
        """Swap in renewed, already verified claims (same module); takes effect atomically."""
        if claims.sub != self.module_id:
            raise R.TokenRejected(R.WRONG_SUBJECT, claims.jti, self.module_id)
        self._install(claims)
        self.renewals_applied += 1
        if self.audit:
            self.audit.append(
                "token_renewed",
                actor=self.module_id,
                decision="info",
                resource=f"token:{claims.sid}",
                jti=claims.jti,
                attempt=claims.attempt,
                renewals=claims.renewals,
            )

    def revoke(self, reason: str = R.REVOKED) -> None:
        """Stop allowing anything from now on (the authority refused a renewal: revoked or superseded)."""
        rights, _ = self._state
        self._state = ({}, _monotonic() - 1.0)
        if self.revoked is None and self.audit:
            self.audit.append(
                "token_revoked",
                actor=self.module_id,
                decision="info",
                resource=f"token:{self.claims.sid}",
                reason=reason,
                jti=self.claims.jti,
                attempt=self.claims.attempt,
            )
        self.revoked = reason
        log.error(
            "%s: capability token %s (%s); every further operation is denied", self.module_id, reason, self.claims.jti
        )

    @property
    def expires_in(self) -> float:
        """Seconds until the current token stops being honoured (leeway included)."""
        return self._state[1] - _monotonic()

    def check(self, interface: str, resource: str) -> None:
        """Allow or raise ``GuardDenied`` (a ``PermissionDenied``) — the per-operation hot path."""
        rights, deadline = self._state
        allowed = rights.get(interface)
        now = _monotonic()
        if (
            allowed is not None
            and (resource in allowed or (interface in self._any_group and self._any_group_allows(interface, resource)))
            and now < deadline
        ):
            key = (interface, resource)
            n = self._counts.get(key)
            if n is None:
                self._first_use(key)
            else:
                self._counts[key] = n + 1
            if self._debug:
                log.debug("allow %s %s %s", self.module_id, interface, resource)
            if now > self._next_flush:
                self.flush_counts()
            return
        self._deny(interface, resource, self._reason(interface, resource, rights, now, deadline))

    def _any_group_allows(self, interface: str, resource: str) -> bool:
        key = (interface, resource)
        ok = self._group_ok.get(key)
        if ok is None:
            ok = (
                isinstance(resource, str)
                and resource.startswith("group:")
                and is_canonical_resource(resource)
                and self.role is not None
                and self.role.allows(interface, resource)
            )
            if len(self._group_ok) < 4096:
                self._group_ok[key] = ok
        return ok

    def _reason(self, interface, resource, rights, now, deadline) -> str:
        if self.revoked is not None:
            return R.REVOKED
        granted = interface in rights and (
            resource in rights[interface]
            or (interface in self._any_group and self._any_group_allows(interface, resource))
        )
        if granted and now >= deadline:
            return R.EXPIRED
        if self.role is None:
            return R.UNKNOWN_ROLE
        if not isinstance(resource, str) or not is_canonical_resource(resource):
            return R.OUT_OF_SCOPE
        claimed = self.claims.resources()
        in_token = resource in claimed or (resource.startswith("group:") and f"group:{ANY_GROUP}" in claimed)
        if interface not in self.claims.interfaces or not in_token:
            return R.OUT_OF_SCOPE
        if self.role.denies(interface, resource):
            return R.EXPLICIT_DENY
        if not self.policy.interface_allowed(interface) or not self.role.allows(interface, resource):
            return R.ROLE_DENIED
        return R.OUT_OF_SCOPE

    def _first_use(self, key) -> None:
        with self._lock:
            if key in self._counts:
                self._counts[key] += 1
                return
            self._counts[key] = 1
            self._reported[key] = 1
        if self.audit:
            self.audit.append(
                key[0],
                actor=self.module_id,
                decision="allow",
                resource=key[1],
                reason="first_use",
                jti=self.claims.jti,
                attempt=self.claims.attempt,
            )

    def flush_counts(self) -> None:
        """Audit how many allowed uses each (interface, resource) had since the last flush."""
        with self._lock:
            self._next_flush = _monotonic() + self.count_interval_s
            deltas = []
            for key, n in list(self._counts.items()):
                d = n - self._reported.get(key, 0)
                if d > 0:
                    deltas.append((key, d))
                    self._reported[key] = n
        if self.audit:
            for (itf, res), d in deltas:
                self.audit.append(
                    itf,
                    actor=self.module_id,
                    decision="allow",
                    resource=res,
                    reason="count",
                    count=d,
                    jti=self.claims.jti,
                    attempt=self.claims.attempt,
                )

    def _deny(self, interface: str, resource: str, code: str) -> None:
        log.warning("DENIED %s %s on %r: %s", self.module_id, interface, resource, code)
        if self.audit:
            self.audit.append(
                str(interface),
                actor=self.module_id,
                decision="deny",
                resource=str(resource)[:200],
                reason=code,
                jti=self.claims.jti,
                attempt=self.claims.attempt,
            )
        raise R.GuardDenied(interface, resource, code, self.module_id)

    def close(self) -> None:
        """Flush the allow counts to the audit log."""
        self.flush_counts()


class AuditedDenyAll:
    """The guard of a module without a valid token: everything is denied and audited (``no_token``)."""

    def __init__(self, module_id: str, audit: AuditLog | None = None, code: str = R.NO_TOKEN):
        self.module_id = module_id
        self.audit = audit
        self.code = code

    def check(self, interface: str, resource: str) -> None:
        if self.audit:
            self.audit.append(
                str(interface), actor=self.module_id, decision="deny", resource=str(resource)[:200], reason=self.code
            )
        raise R.GuardDenied(interface, resource, self.code, self.module_id)
