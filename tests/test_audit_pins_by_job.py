"""Audit pins found by the job a log names, read with the bounded JSON reader (issue 38, item 3).

Attacks, each shown to pass (or break) the old behaviour as its negative control: a rewritten copy of a sealed job's
log at another path, or under ``audit/<new task>/``, used to verify OK (pins were matched by the log's path); a
3000-deep ``kuangchao.audit_pin`` tag on one run used to make every verification against the store answer
``no_pins`` (a ``RecursionError`` dropped the whole store).
"""

from __future__ import annotations

import json

import pytest

from kuangchao_core.perm import audit_external
from kuangchao_core.perm.audit_external import ExternalPins, collect_external_pins
from kuangchao_core.perm.audit_pins import MLFLOW_PIN_TAG
from tests import test_audit_trust as trust_tests
from tests.test_audit_trust import _cli, _make_job

store, outside, job = trust_tests.store, trust_tests.outside, trust_tests.job  # the fixtures of the sealed job


def _rewritten_copy(job, dest):
    """The sealed log with its first denial turned into an allow, re-chained without a key (hashes are unkeyed),
    no anchors or trust file beside it."""
    from kuangchao_core.perm.audit_chain import genesis_hash, record_hash

    dest.parent.mkdir(parents=True, exist_ok=True)
    prev, out = genesis_hash(job.job), []
    for i, line in enumerate(job.log.read_text().splitlines()):
        rec = json.loads(line)
        if i == 0:
            rec["decision"] = "allow"
        rec.pop("jti", None)  # no token named: the copy does not look like an enforcing job's
        rec["prev_hash"] = prev
        body = {k: v for k, v in rec.items() if k != "hash"}
        rec["hash"] = prev = record_hash(prev, body)
        out.append(json.dumps(rec, sort_keys=True))
    dest.write_text("\n".join(out) + "\n")
    return dest


def _old_for_log_only(monkeypatch):
    """The pre-fix lookup: pins by the log's path only."""
    monkeypatch.setattr(ExternalPins, "for_job", lambda self, job_id: [])


def test_rewritten_copy_at_another_path_fails_naming_its_job(job, monkeypatch):
    copy = _rewritten_copy(job, job.tmp / "elsewhere" / "copy.jsonl")
    res = _cli("--log", copy)
    assert res.exit_code == 1, res.output
    assert job.job in res.output and "pin_mismatch" in res.output, res.output
    res = _cli("--log", job.log)  # the untouched log still verifies
    assert res.exit_code == 0 and res.output.startswith("OK"), res.output
    _old_for_log_only(monkeypatch)  # negative control: matched by path, the copy passed
    res = _cli("--log", copy)
    assert res.exit_code == 0 and res.output.startswith("OK"), res.output


def test_rewritten_copy_under_a_new_task_fails_the_task(job, monkeypatch):
    _rewritten_copy(job, job.tmp / "audit" / "new-task" / f"{job.job}.jsonl")
    args = ("--task", "new-task", "--log", job.tmp / "audit")
    res = _cli(*args)
    assert res.exit_code == 1 and job.job in res.output and "pin_mismatch" in res.output, res.output
    _old_for_log_only(monkeypatch)
    res = _cli(*args)
    assert res.exit_code == 0 and res.output.startswith("OK"), res.output


def test_sealed_log_given_with_another_run_fails(job, tmp_path_factory, store):
    other = _make_job(tmp_path_factory.mktemp("other"), store)
    res = _cli("--run", other.run, "--log", job.log, "--mode", "trusted")
    assert res.exit_code == 1 and "pin_wrong_job" in res.output and job.job in res.output, res.output
    res = _cli("--run", job.run, "--log", job.log)  # control: with its own run it verifies
    assert res.exit_code == 0 and res.output.startswith("OK"), res.output


def test_a_3000_deep_tag_on_one_run_voids_only_itself(job, store):
    bad = store.client.create_run(store.exp).info.run_id
    deep = "[" * 3000 + "]" * 3000
    store.client.set_tag(bad, MLFLOW_PIN_TAG, deep)
    try:
        found = collect_external_pins(store.uri)
        assert found.for_job(job.job), found.notes  # the other job's pins survive
        assert any(bad in n and "deep" in n for n in found.notes), found.notes
        res = _cli("--log", job.log)
        assert res.exit_code == 0 and res.output.startswith("OK"), res.output
        # negative control: the old reader raised RecursionError (no ValueError), which ended the whole store's read
        with pytest.raises(RecursionError):
            json.loads(deep)
        assert not issubclass(RecursionError, ValueError)
    finally:
        store.client.delete_tag(bad, MLFLOW_PIN_TAG)


def test_old_whole_store_read_is_voided_by_one_deep_tag(job, store, monkeypatch):
    """Negative control of the isolation: one run whose pins raise, read the old way (no per-run guard), empties
    the store; read the new way it costs only that run."""
    bad = store.client.create_run(store.exp).info.run_id
    store.client.set_tag(bad, MLFLOW_PIN_TAG, "[" * 3000 + "]" * 3000)
    real = audit_external._run_pins
    monkeypatch.setattr(audit_external, "loads_bounded", lambda text, where="": json.loads(text))  # old reader
    try:
        found = collect_external_pins(store.uri)
        assert found.for_job(job.job) and any("RecursionError" in n for n in found.notes), found.notes

        def unguarded(found, client, run):
            try:
                real(found, client, run)
            except RecursionError as exc:
                raise KeyboardInterrupt from exc  # escapes the per-run guard, as the old loop let it

        monkeypatch.setattr(audit_external, "_run_pins", unguarded)
        with pytest.raises(KeyboardInterrupt):
            collect_external_pins(store.uri)
    finally:
        store.client.delete_tag(bad, MLFLOW_PIN_TAG)
