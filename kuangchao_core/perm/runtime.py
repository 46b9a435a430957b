"""Wiring of the permission layer into processes: the worker guard, automatic renewal, the renewal server.

Worker side: :func:`install_worker_guard` verifies the module's token once, builds its :class:`TokenGuard`,
installs it through ``guard_api`` and starts a :class:`TokenRenewer` thread when ``KC_AUTHORITY_ADDR`` (or
``authority_addr``) names a :class:`RenewalServer`; :func:`module_guard` does the same for a second module of the
process (the rank's data loader) without installing it process-wide. With a ``trust_root`` the trust store and the
policy must be signed by it (a file edited by anyone else is refused). Renewal asks the orchestrating process over
HTTP; the worker never holds a signing key, every renewed token is verified (signature included) before it is
used, and a refused renewal (revoked, or a superseded copy) ends the guard's rights at once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kuangchao_core import guard_api
from kuangchao_core.perm import reasons as R
from kuangchao_core.perm.audit import AuditLog
from kuangchao_core.perm.authority import Authority
from kuangchao_core.perm.guard import AuditedDenyAll, TokenGuard
from kuangchao_core.perm.roles import Policy
from kuangchao_core.perm.tokens import DEFAULT_LEEWAY_S, DEFAULT_MAX_TTL_S, TrustStore, Verifier, token_digest

log = logging.getLogger("kuangchao.perm.runtime")
ENV_AUTHORITY_ADDR = "KC_AUTHORITY_ADDR"
MAX_REQUEST_BYTES = 16384


def _module_id_from_env() -> str:
    return f"worker-{int(os.environ.get('RANK', '0'))}"


def load_trust(
    trust_store_file: str | os.PathLike, trust_root: str | None, policy_file: str | os.PathLike | None
) -> tuple[TrustStore, Policy]:
    """The trust store and policy a module runs under. With ``trust_root`` (``KC_TRUST_ROOT``) both must be signed by
    it — ``DocumentRejected`` otherwise; without it (tools, tests) they are read as they are."""
    from kuangchao_core.perm.signed_doc import read_document, verify_document

    pf = Path(policy_file) if policy_file else Path(trust_store_file).with_name("policy.json")
    if trust_root is None:
        return TrustStore.load(trust_store_file), (Policy.load(pf) if pf.exists() else Policy())
    trust = TrustStore.load_verified(trust_store_file, trust_root)
    from kuangchao_core.perm.tokens import parse_trust_root

    body = verify_document(read_document(pf), "kuangchao/policy", parse_trust_root(trust_root)[1], where=str(pf))
    return trust, Policy(body.get("roles"), body.get("allowed_interfaces"), source=str(pf))


def module_guard(
    token: str,
    module_id: str,
    trust: TrustStore,
    policy: Policy,
    job_id: str,
    attempt: int,
    audit: AuditLog | None = None,
    *,
    authority_addr: str | None = None,
    leeway_s: float = DEFAULT_LEEWAY_S,
    max_ttl_s: float = DEFAULT_MAX_TTL_S,
    renew: bool = True,
) -> TokenGuard:
    """Verify ``module_id``'s token and build its guard (renewed in the background when ``authority_addr`` is
    given); not installed — use ``guard_api.install_guard`` or ``guard_api.thread_guard``. A token that fails
    verification is audited and re-raised as the generic ``TokenRejected``."""
    verifier = Verifier(trust, job_id=job_id, min_attempt=attempt, leeway_s=leeway_s, max_ttl_s=max_ttl_s)
    try:
        claims = verifier.verify(token, subject=module_id)
    except R.TokenRejected as exc:
        log.error("%s: capability token rejected (%s); sha256=%s", module_id, exc.code, token_digest(token))
        if audit:
            audit.append(
                "token_verify",
                actor=module_id,
                decision="deny",
                resource=f"job:{job_id}",
                reason=exc.code,
                jti=exc.jti or "",
                attempt=attempt,
                token_sha256=token_digest(token),
            )
        raise
    guard = TokenGuard(claims, policy, audit=audit, leeway_s=leeway_s)
    if audit:
        audit.append(
            "token_loaded",
            actor=module_id,
            decision="info",
            resource=f"job:{job_id}",
            reason=claims.role,
            jti=claims.jti,
            attempt=attempt,
        )
    if renew and authority_addr:
        guard.renewer = TokenRenewer(guard, verifier, token, authority_addr)
        guard.renewer.start()
    return guard


def install_worker_guard(
    token_file: str | os.PathLike | None,
    trust_store_file: str | os.PathLike | None,
    job_id: str,
    attempt: int,
    audit_log: str | os.PathLike | None = None,
    mode: str = "enforcing",
    *,
    token: str | None = None,
    trust_root: str | None = None,
    module_id: str | None = None,
    policy: Policy | None = None,
    policy_file: str | os.PathLike | None = None,
    authority_addr: str | None = None,
    leeway_s: float = DEFAULT_LEEWAY_S,
    max_ttl_s: float = DEFAULT_MAX_TTL_S,
    renew: bool = True,
):
    """Verify this process's token once and install its guard; returns the guard (or ``AllowAll`` in trusted mode).

    The token is ``token`` itself (the worker's path: from its environment) or read from ``token_file`` (tools,
    tests; ``{rank}`` is replaced by ``$RANK``). ``module_id`` defaults to ``worker-$RANK`` and must equal the
    token's subject. ``trust_root``: see :func:`load_trust` (a trust store or policy not signed by it installs a
    deny-all guard, audited, and raises). ``policy`` defaults to ``policy_file`` / ``$KC_POLICY_FILE`` / the
    ``policy.json`` beside the trust store, else the built-in roles. A token that fails verification installs a
    deny-all guard (audited) and re-raises the generic ``TokenRejected``.
    """
    module_id = module_id or _module_id_from_env()
    if token_file and "{rank}" in str(token_file):  # one template for every rank (torchrun shares the environment)
        token_file = str(token_file).format(rank=int(os.environ.get("RANK", "0")))
    policy_file = policy_file or os.environ.get("KC_POLICY_FILE")
    audit = AuditLog(audit_log, job_id) if audit_log else None
    if mode == "trusted":
        log.warning(
            "!!! permission.mode is TRUSTED: capability checks are OFF for %s (job %s). Use only on a private "
            "cluster; remove `permission.mode: trusted` to enforce tokens. !!!",
            module_id,
            job_id,
        )
        if audit:
            audit.append("mode_trusted", actor=module_id, decision="info", resource=f"job:{job_id}", attempt=attempt)
        guard_api.install_guard(guard_api.AllowAll())
        return guard_api.current_guard()
    if mode != "enforcing":
        raise ValueError(f"permission.mode must be 'enforcing' or 'trusted', not {mode!r}")
    if token is None and token_file:
        token = Path(token_file).read_text().strip()
    if not token or not trust_store_file:
        guard_api.install_guard(AuditedDenyAll(module_id, audit))
        raise R.TokenRejected(R.NO_TOKEN, module_id=module_id)
    from kuangchao_core.perm.signed_doc import DocumentRejected

    try:
        trust, loaded_policy = load_trust(trust_store_file, trust_root, policy_file)
    except DocumentRejected as exc:
        log.error("%s: %s; refusing to run under it", module_id, exc)
        if audit:
            audit.append(
                "trust_verify", actor=module_id, decision="deny", resource=f"job:{job_id}", reason=exc.reason[:200]
            )
        guard_api.install_guard(AuditedDenyAll(module_id, audit, R.BAD_SIGNATURE))
        raise R.TokenRejected(R.BAD_SIGNATURE, module_id=module_id) from None
    try:
        guard = module_guard(
            token,
            module_id,
            trust,
            policy or loaded_policy,
            job_id,
            attempt,
            audit,
            authority_addr=authority_addr or os.environ.get(ENV_AUTHORITY_ADDR),
            leeway_s=leeway_s,
            max_ttl_s=max_ttl_s,
            renew=renew,
        )
    except R.TokenRejected as exc:
        guard_api.install_guard(AuditedDenyAll(module_id, audit, exc.code))
        raise
    guard_api.install_guard(guard)
    return guard


ENV_TOKENS = "KC_TOKENS"
#: what a process without a token is told (the SDK outside ``kc launch``, a worker started by hand)
HOW_TO_RUN = (
    "start the script with `kc launch [--nproc-per-node N] script.py` (or the job with `kc train`), which issues "
    "every rank its token; on a private cluster call kc.init(trusted=True) to run without checks"
)


def take_environment_tokens() -> dict[str, str]:
    """This process's tokens (module -> token): from its launcher's lifeline (``KC_LIFELINE``, which hands this rank
    its own tokens and nobody else's, and ends the process when the launcher dies), else from ``KC_TOKENS``; both
    variables are removed from the environment at once so no process started from here inherits them; ``{}`` when
    there are none."""
    from kuangchao_core.sched.lifeline import connect

    raw = os.environ.pop(ENV_TOKENS, None)
    handed = connect()
    if handed:
        return handed
    if not raw:
        return {}
    try:
        tokens = json.loads(raw)
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in tokens.items()} if isinstance(tokens, dict) else {}


def install_from_environment(rank: int, tokens: dict[str, str] | None = None, audit_log: str | None = None):
    """Install rank ``rank``'s guards from the launcher's environment: ``worker-<rank>`` for the process (verified
    against ``KC_TRUST_STORE``/``KC_TRUST_ROOT``/``KC_POLICY_FILE``, renewed through ``KC_AUTHORITY_ADDR``) and,
    when issued, ``data_loader-<rank>`` for its dataset reads. Returns the worker guard; ``TokenRejected`` with
    :data:`HOW_TO_RUN` when the environment holds no token for the rank."""
    from kuangchao_core.errors import PermissionDenied

    tokens = take_environment_tokens() if tokens is None else tokens
    mine = tokens.get(f"worker-{rank}")
    if not mine or not os.environ.get("KC_TRUST_STORE"):
        guard_api.install_guard(guard_api.DenyAll())
        raise PermissionDenied("device_init", "device:*", f"worker-{rank} has no capability token; {HOW_TO_RUN}")
    job_id = os.environ.get("KC_JOB_ID", "")
    attempt = int(os.environ.get("KC_ATTEMPT", "0"))
    audit_log = audit_log or os.environ.get("KC_AUDIT_LOG")
    root = os.environ.get("KC_TRUST_ROOT")
    guard = install_worker_guard(
        None, os.environ["KC_TRUST_STORE"], job_id, attempt, audit_log, token=mine, trust_root=root
    )
    loader = tokens.get(f"data_loader-{rank}")
    if loader:  # dataset reads (start, evaluation, the prefetch thread) run under the data loader's own token
        trust, policy = load_trust(os.environ["KC_TRUST_STORE"], root, os.environ.get("KC_POLICY_FILE"))
        audit = AuditLog(audit_log, job_id) if audit_log else None
        addr = os.environ.get(ENV_AUTHORITY_ADDR)
        loader_guard = module_guard(
            loader, f"data_loader-{rank}", trust, policy, job_id, attempt, audit, authority_addr=addr
        )
        guard_api.install_module_guard("data_loader", loader_guard)
    return guard


class TokenRenewer(threading.Thread):
    """Background thread: renews the token at half its lifetime (or half ``$KC_TOKEN_TTL`` if shorter, for
    first tokens carrying a start-up grace) through the :class:`RenewalServer`; failures retry until expiry."""

    def __init__(self, guard: TokenGuard, verifier: Verifier, token: str, addr: str, *, fraction: float = 0.5):
        super().__init__(name=f"kc-token-renewer-{guard.module_id}", daemon=True)
        self.guard = guard
        self.verifier = verifier
        self.token = token
        self.addr = addr.rstrip("/")
        self.fraction = fraction
        self.ttl_hint_s = float(os.environ.get("KC_TOKEN_TTL", "0") or 0)
        self.renewals = 0
        self.failures = 0
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def _due_in(self) -> float:
        c = self.guard.claims
        life = c.exp - c.iat
        if self.ttl_hint_s:
            life = min(life, self.ttl_hint_s)
        return c.iat + life * self.fraction - time.time()

    def run(self) -> None:
        while not self._stop_event.is_set():
            wait = self._due_in()
            if wait > 0 and self._stop_event.wait(wait):
                return
            try:
                self.renew_once()
            except Exception as exc:  # a failed renewal is retried until the token really expires
                self.failures += 1
                remaining = self.guard.claims.exp - time.time()
                log.warning("%s: token renewal failed (%s); %.1fs left", self.guard.module_id, exc, remaining)
                if remaining + self.verifier.leeway_s <= 0:
                    log.error(
                        "%s: token expired without renewal; further operations will be denied", self.guard.module_id
                    )
                    return
                if self._stop_event.wait(min(1.0, max(0.05, remaining / 4))):
                    return

    def renew_once(self) -> None:
        """One renewal round trip; the new token is fully verified before the guard uses it."""
        body = json.dumps({"token": self.token, "module_id": self.guard.module_id}).encode()
        req = urllib.request.Request(f"{self.addr}/renew", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                new = json.loads(resp.read(MAX_REQUEST_BYTES))["token"]
        except urllib.error.HTTPError as exc:
            if exc.code == 403:  # the authority will not renew this token again: revoked, or a superseded copy
                self.guard.revoke(R.REVOKED)
                self._stop_event.set()
                raise R.TokenRejected(R.REVOKED, module_id=self.guard.module_id) from None
            raise R.TokenRejected(R.MALFORMED, module_id=self.guard.module_id) from None
        claims = self.verifier.verify(new, subject=self.guard.module_id)
        self.guard.update(claims)
        self.token = new
        self.renewals += 1


class _QuietServer(ThreadingHTTPServer):
    """A client's broken request is logged in one line, never as a traceback on the orchestrator's stderr."""

    def handle_error(self, request, client_address) -> None:
        import sys

        log.warning("renewal endpoint: dropped a request from %s (%s)", client_address[0], sys.exc_info()[1])


class RenewalServer:
    """Local HTTP endpoint of the authority, run by the orchestrating process (the ``launch`` task).

    ``POST /renew {"token": ..., "module_id": ...}`` answers ``{"token": <renewed>}`` or 403 (generic); the token
    must be the caller's own and the newest of its session, and operator revocations are applied first. It also signs audit
    checkpoints of the job's log every ``anchor_interval_s`` seconds and at :meth:`stop`. ``ttl_s`` (the configured
    ``permission.token_ttl_seconds``) is the lifetime of renewed tokens, so first tokens issued with a start-up grace
    fall back to it. Start it before the workers and pass :attr:`address` to them in ``KC_AUTHORITY_ADDR``.
    """

    def __init__(
        self,
        authority: Authority,
        job_id: str,
        attempt: int = 0,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        audit_log: str | os.PathLike | None = None,
        anchor_interval_s: float = 5.0,
        ttl_s: float | None = None,
        read_timeout_s: float = 10.0,
    ):
        self.authority = authority
        self.job_id = job_id
        self.attempt = attempt
        self.audit = AuditLog(audit_log, job_id, signer=authority.audit_signing_key()) if audit_log else None
        self.anchor_interval_s = anchor_interval_s
        self.ttl_s = ttl_s
        self.renewed = 0
        self.refused = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = read_timeout_s  # an idle or slow client loses its connection (and its thread) after this

            def log_message(self, *args):  # keep tokens and client chatter out of stderr
                return

            def do_POST(self):  # noqa: N802 (http.server API)
                if self.path != "/renew":
                    self.send_error(404)
                    return
                raw = (self.headers.get("Content-Length") or "0").strip()
                n = int(raw) if raw.isdigit() and len(raw) <= 9 else -1
                if n <= 0 or n > MAX_REQUEST_BYTES:
                    self._reply(400, {"error": "bad request"})
                    return
                try:
                    request = json.loads(self.rfile.read(n))
                    token, caller = request["token"], request["module_id"]
                except (ValueError, KeyError, TypeError):
                    self._reply(400, {"error": "bad request"})
                    return
                if not isinstance(token, str) or not isinstance(caller, str):
                    self._reply(400, {"error": "bad request"})
                    return
                code, body = server._renew(token, caller)
                self._reply(code, body)

            def _reply(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._httpd = _QuietServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._threads: list[threading.Thread] = []
        self._stop_event = threading.Event()

    @property
    def address(self) -> str:
        """``http://host:port`` for ``KC_AUTHORITY_ADDR``."""
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def _renew(self, token: str, caller: str) -> tuple[int, dict]:
        try:
            new = self.authority.renew(token, self.job_id, self.attempt, ttl_s=self.ttl_s, caller=caller)
        except R.TokenRejected as exc:
            self.refused += 1
            log.warning("renewal refused (%s); sha256=%s", exc.code, token_digest(token))
            if self.audit:
                self.audit.append(
                    "token_renew",
                    actor="authority",
                    decision="deny",
                    resource=f"job:{self.job_id}",
                    reason=exc.code,
                    caller=caller[:64],
                    jti=exc.jti or "",
                    token_sha256=token_digest(token),
                )
            return 403, {"error": "renewal refused"}
        self.renewed += 1
        return 200, {"token": new}

    def start(self) -> str:
        """Serve in background threads; returns :attr:`address`."""
        t = threading.Thread(target=self._httpd.serve_forever, name="kc-renewal-server", daemon=True)
        t.start()
        self._threads.append(t)
        if self.audit:
            a = threading.Thread(target=self._anchor_loop, name="kc-audit-anchor", daemon=True)
            a.start()
            self._threads.append(a)
        return self.address

    def _anchor_loop(self) -> None:
        while not self._stop_event.wait(self.anchor_interval_s):
            try:
                self.audit.checkpoint()
            except Exception as exc:  # never let anchoring kill the server
                log.error("audit checkpoint failed: %s", exc)

    def stop(self) -> None:
        """Stop serving and write a final signed audit checkpoint."""
        self._stop_event.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        for t in self._threads:
            t.join(timeout=5)
        if self.audit:
            self.audit.close()

    def __enter__(self) -> RenewalServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
