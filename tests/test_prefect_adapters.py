"""The Prefect side of the core's hooks (issue 43 item 6), on the session's real Prefect server.

The core imports no Prefect: a launch gets :data:`tasks.prefect_hooks.PREFECT_HOOKS` from its task, ``kc audit``
reads the pins' artifacts through :data:`kuangchao.cli.prefect_artifacts.PREFECT_ARTIFACTS`. Here each adapter does
the real thing: an audit pin recorded inside a flow run becomes the run's ``kc-audit-pin`` artifact, which the
reader finds again; outside a run, or without the hooks, nothing is published (controls).
"""

from __future__ import annotations

import os
import uuid

from kuangchao.cli.prefect_artifacts import PREFECT_ARTIFACTS
from kuangchao_core.obs.run_hooks import NO_HOOKS
from kuangchao_core.perm.audit import AuditLog
from kuangchao_core.perm.audit_external import collect_external_pins
from kuangchao_core.perm.audit_pins import record_audit_pin
from kuangchao_core.perm.authority import Authority
from kuangchao_core.perm.tokens import public_raw
from tasks.prefect_hooks import PREFECT_HOOKS


def _pins_of(job_id: str) -> list:
    return [p for p, _ in collect_external_pins(os.devnull, prefect=PREFECT_ARTIFACTS).found if p.job_id == job_id]


def test_a_pin_recorded_in_a_flow_run_is_read_back_from_prefect(prefect_api, tmp_path):
    from prefect import flow

    job = f"kc-adapter@{uuid.uuid4().hex[:8]}"  # the session's server holds other tests' pins too
    authority = Authority(tmp_path / "keys")
    run = tmp_path / "run"
    run.mkdir()
    log_path = run / "audit.jsonl"
    log = AuditLog(log_path, job, signer=authority.audit_signing_key())
    log.append("all_reduce", actor="worker-0", decision="allow", resource="group:world", reason="first_use")
    log.close()
    kid, key = authority.audit_signing_key()

    def pin(hooks):
        return record_audit_pin(run, log_path, job, kid, public_raw(key), hooks=hooks)

    assert PREFECT_HOOKS.in_run() is False and PREFECT_HOOKS.api_url() == prefect_api
    pin(PREFECT_HOOKS)  # outside a flow run: nothing to attach it to

    @flow(name="kc-adapter-no-hooks")
    def without_hooks():
        return pin(NO_HOOKS)  # the core's default: a flow run it is not told of

    without_hooks()
    assert _pins_of(job) == [], "published outside a run, or without the orchestrator's hooks"

    @flow(name="kc-adapter")
    def inside():
        assert PREFECT_HOOKS.in_run()
        return pin(PREFECT_HOOKS)

    published = inside()
    found = _pins_of(job)
    assert found == [published], found
    sources = collect_external_pins(os.devnull, prefect=PREFECT_ARTIFACTS).sources
    assert f"Prefect {prefect_api}" in sources and not collect_external_pins(os.devnull).for_run(run)
