"""Audit log integrity (reference §7 G1–G8) and `kc audit`."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from kuangchao_core.perm.audit import AuditLog
from kuangchao_core.perm.audit_chain import anchors_path_for, genesis_hash, record_hash
from kuangchao_core.perm.audit_verify import read_records, verify_log
from kuangchao_core.perm.authority import Authority
from tests.mp import run_distributed

JOB = "task-a@run1"


@pytest.fixture(scope="module")
def authority(tmp_path_factory):
    return Authority(tmp_path_factory.mktemp("auth"))


@pytest.fixture(scope="module")
def base_log(tmp_path_factory, authority):
    """1,000 records, a signed checkpoint every 100."""
    d = tmp_path_factory.mktemp("base")
    log = AuditLog(d / "audit.jsonl", JOB, signer=authority.audit_signing_key(), checkpoint_every=100)
    for i in range(1000):
        log.append(
            "all_reduce",
            actor=f"worker-{i % 4}",
            decision="deny" if i % 7 == 0 else "allow",
            resource=f"group:dp[{i % 2},{i % 2 + 2}]",
            reason="out_of_scope" if i % 7 == 0 else "first_use",
        )
    log.close()
    return d / "audit.jsonl"


def copy_log(src, dst_dir):
    dst = dst_dir / "audit.jsonl"
    shutil.copy(src, dst)
    shutil.copy(anchors_path_for(src), anchors_path_for(dst))
    return dst


def lines(path):
    return path.read_text().splitlines(keepends=True)


def write(path, ls):
    path.write_text("".join(ls))


def check(path, authority, **kw):
    return verify_log(path, trust_store=authority.trust, **kw)


def test_g1_base_log_verifies(base_log, authority):
    r = check(base_log, authority, log_id=JOB)
    assert r.ok and r.records == 1000 and r.checkpoints == 10 and r.unanchored_tail == 0, r


def _append_worker(rank, world_size, path, n):
    log = AuditLog(path, JOB)
    for i in range(n):
        log.append("all_reduce", actor=f"worker-{rank}", decision="allow", resource="group:world", reason=str(i))
    log.close()
    return n


def test_g1_two_processes_1000_records(tmp_path, authority):
    path = tmp_path / "mp.jsonl"
    run_distributed(_append_worker, 2, args=(str(path), 500), init_pg=False, timeout=120)
    anchor = AuditLog(path, JOB, signer=authority.audit_signing_key())
    anchor.checkpoint()
    anchor.close()
    recs = list(read_records(path))
    assert [r["seq"] for r in recs] == list(range(1, 1001))
    assert {r["actor"] for r in recs} == {"worker-0", "worker-1"}
    per_actor = [[int(r["reason"]) for r in recs if r["actor"] == a] for a in ("worker-0", "worker-1")]
    assert all(p == list(range(500)) for p in per_actor)  # no record lost or duplicated
    r = check(path, authority, log_id=JOB)
    assert r.ok and r.checkpoints == 1 and r.unanchored_tail == 0, r


def test_g2_edit_one_field(base_log, authority, tmp_path):
    p = copy_log(base_log, tmp_path)
    ls = lines(p)
    ls[499] = ls[499].replace('"decision":"allow"', '"decision":"deny"')
    assert ls[499] != lines(base_log)[499]
    write(p, ls)
    r = check(p, authority, log_id=JOB)
    assert not r.ok and r.first_bad_seq == 500 and r.problem == "hash_mismatch", r


@pytest.mark.parametrize("mutation", ["delete", "swap", "insert_naive", "insert_rehashed"])
def test_g3_delete_reorder_insert(base_log, authority, tmp_path, mutation):
    p = copy_log(base_log, tmp_path)
    ls = lines(p)
    if mutation == "delete":
        del ls[499]
    elif mutation == "swap":
        ls[499], ls[500] = ls[500], ls[499]
    else:
        forged = json.loads(ls[498])
        forged.update(seq=500, actor="worker-9", decision="allow", reason="forged")
        if mutation == "insert_rehashed":
            forged["prev_hash"] = json.loads(ls[498])["hash"]
            body = {k: v for k, v in forged.items() if k != "hash"}
            forged["hash"] = record_hash(forged["prev_hash"], body)
        ls.insert(499, json.dumps(forged, sort_keys=True, separators=(",", ":")) + "\n")
    write(p, ls)
    r = check(p, authority, log_id=JOB)
    assert not r.ok and r.first_bad_seq == 500, r


def _rewrite_from(ls, start_seq, log_id=JOB):
    prev = json.loads(ls[start_seq - 2])["hash"] if start_seq > 1 else genesis_hash(log_id)
    out = ls[: start_seq - 1]
    for raw in ls[start_seq - 1 :]:
        rec = json.loads(raw)
        rec["decision"], rec["reason"] = "allow", "rewritten"  # hide every denial from here on
        rec["prev_hash"] = prev
        body = {k: v for k, v in rec.items() if k != "hash"}
        rec["hash"] = prev = record_hash(prev, body)
        out.append(json.dumps(rec, sort_keys=True, separators=(",", ":")) + "\n")
    return out


def test_g4_consistent_rewrite_caught_by_checkpoint(base_log, authority, tmp_path):
    p = copy_log(base_log, tmp_path)
    write(p, _rewrite_from(lines(p), 500))
    anchors = anchors_path_for(p)
    shutil.move(anchors, tmp_path / "aside")
    assert verify_log(p, log_id=JOB).ok  # the chain alone is consistent: only the anchor catches it
    shutil.move(tmp_path / "aside", anchors)
    r = check(p, authority, log_id=JOB)
    assert not r.ok and r.problem == "checkpoint_mismatch" and r.first_bad_seq == 500, r
    assert "(400, 500]" in r.detail


def test_g5_truncation_before_and_after_last_checkpoint(tmp_path, authority):
    p = tmp_path / "t.jsonl"
    log = AuditLog(p, JOB, signer=authority.audit_signing_key(), checkpoint_every=100)
    for i in range(250):
        log.append("send", actor="worker-0", decision="allow", resource="group:world", reason=str(i))
    log.checkpoint()  # at 250
    for _ in range(30):
        log.append("send", actor="worker-0", decision="allow", resource="group:world")
    ls = lines(p)
    write(p, ls[:270])  # cut inside the unanchored tail
    r = check(p, authority, log_id=JOB)
    assert r.ok and r.unanchored_tail == 20 and any("unanchored tail of 20" in w for w in r.warnings)
    write(p, ls[:240])  # cut before the checkpoint at 250
    r = check(p, authority, log_id=JOB)
    assert not r.ok and r.problem == "truncated" and r.first_bad_seq == 241, r


def test_g6_torn_tail_repaired_and_logged(tmp_path, authority, caplog):
    p = tmp_path / "torn.jsonl"
    log = AuditLog(p, JOB)
    for _ in range(10):
        log.append("recv", actor="worker-1", decision="allow", resource="group:world")
    log.close()
    whole = p.read_bytes()
    with open(p, "ab") as f:
        f.write(b'{"v":1,"log_id":"task-a@run1","seq":11,"actor":"wor')  # crash mid-write
    r = verify_log(p, log_id=JOB)
    assert r.torn_tail_bytes > 0 and any("torn_tail" in w for w in r.warnings) and r.records == 10
    log = AuditLog(p, JOB)  # the next writer repairs it
    log.append("recv", actor="worker-1", decision="deny", resource="group:tp[0,1]", reason="out_of_scope")
    log.close()
    recs = list(read_records(p))
    assert p.read_bytes().startswith(whole)
    assert recs[10]["action"] == "log_recovered" and recs[10]["reason"] == "torn_tail" and recs[10]["bytes_removed"] > 0
    assert recs[11]["decision"] == "deny" and [x["seq"] for x in recs] == list(range(1, 13))
    assert verify_log(p, log_id=JOB).ok and "torn last line" in caplog.text


def test_g7_splice_from_other_job(base_log, authority, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    log = AuditLog(other / "audit.jsonl", "task-a@run2")
    for _i in range(1000):
        log.append("all_reduce", actor="worker-0", decision="allow", resource="group:world")
    log.close()
    p = copy_log(base_log, tmp_path)
    ls = lines(p)[:499] + lines(other / "audit.jsonl")[499:]
    write(p, ls)
    r = check(p, authority, log_id=JOB)
    assert not r.ok and r.first_bad_seq == 500 and r.problem == "wrong_log_id", r
    # a whole, valid log of another job presented as this job's: genesis / log id mismatch at seq 1
    r2 = verify_log(other / "audit.jsonl", log_id=JOB)
    assert not r2.ok and r2.first_bad_seq == 1
    # even relabelled consistently, the genesis hash binds the chain to its job
    relabelled = [
        json.dumps({**json.loads(x), "log_id": JOB}, separators=(",", ":")) + "\n" for x in lines(other / "audit.jsonl")
    ]
    write(other / "audit.jsonl", relabelled)
    r3 = verify_log(other / "audit.jsonl", log_id=JOB)
    assert not r3.ok and r3.first_bad_seq == 1 and r3.problem == "chain_break"


def test_g8_tampered_checkpoint_signature(base_log, authority, tmp_path):
    p = copy_log(base_log, tmp_path)
    a = anchors_path_for(p)
    cps = a.read_text().splitlines(keepends=True)
    cp = json.loads(cps[2])
    cp["seq"] = 299
    cps[2] = json.dumps(cp, sort_keys=True, separators=(",", ":")) + "\n"
    a.write_text("".join(cps))
    r = check(p, authority, log_id=JOB)
    assert not r.ok and r.problem == "bad_checkpoint" and "bad signature" in r.detail, r
    # a checkpoint signed with the token key (not the audit key) is refused too
    other = Authority(tmp_path / "other-auth")
    r2 = verify_log(p, trust_store=other.trust, log_id=JOB)
    assert not r2.ok and "unknown_key" in r2.detail


# ---------------------------------------------------------------------------------------------- kc audit


def _cli(args):
    from kuangchao.cli.main import app

    return CliRunner().invoke(app, ["audit", *args])


def test_kc_audit_lines_filters_and_verify(tmp_path, authority):
    d = tmp_path / "audit" / "mytask"
    d.mkdir(parents=True)
    p = d / "mytask@r1.jsonl"
    log = AuditLog(p, "mytask@r1", signer=authority.audit_signing_key())
    log.append("memory_alloc", actor="worker-3", decision="deny", resource="memory:params", reason="expired")
    log.append("all_reduce", actor="worker-0", decision="allow", resource="group:world", reason="first_use")
    log.append("dataset_read", actor="data_loader-0", decision="deny", resource="dataset:x", reason="out_of_scope")
    log.close()
    authority.export_trust_store(f"{p}.trust.json")
    res = _cli(["--task", "mytask", "--action", "deny", "--log", str(tmp_path / "audit")])
    assert res.exit_code == 0, res.output
    out = res.output.strip().splitlines()
    assert len(out) == 3 and out[-1] == "2 denials in 1 audit log"
    parts = out[0].split(" | ")
    assert parts[1:] == ["worker-3", "memory_alloc", "DENIED", "token expired (memory:params)"]
    assert len(parts[0]) == 19 and parts[0][4] == "-" and parts[0][13] == ":"
    res = _cli(["--task", "mytask", "--action", "deny", "--module", "data_loader-0", "--json", "--log", str(p)])
    recs = [json.loads(x) for x in res.output.strip().splitlines()]
    assert [r["actor"] for r in recs] == ["data_loader-0"]
    assert (
        _cli(["--task", "mytask", "--since", "2999-01-01", "--log", str(p)]).output.strip()
        == "0 records in 1 audit log"
    )
    none = _cli(["--task", "mytask", "--action", "deny", "--since", "2999-01-01", "--log", str(p)])
    assert none.output.strip() == "0 denials in 1 audit log"  # said, not an empty screen
    assert len(_cli(["--task", "mytask", "--since", "1h", "--log", str(p)]).output.strip().splitlines()) == 4
    res = _cli(["--task", "mytask", "--verify", "--log", str(p)])  # issue 26: signed, yet no pins outside: fails
    assert res.exit_code == 1 and "no_pins" in res.output and "1 signed checkpoints" not in res.output
    res = _cli(["--task", "mytask", "--verify", "--mode", "trusted", "--log", str(p)])
    assert res.exit_code == 0 and res.output.startswith("OK") and "1 signed checkpoints" in res.output
    ls = lines(p)
    ls[1] = ls[1].replace("worker-0", "worker-1")
    write(p, ls)
    res = _cli(["--task", "mytask", "--verify", "--log", str(p)])
    assert res.exit_code == 1 and "first bad record seq 2" in res.output
    assert _cli(["--task", "mytask", "--action", "maybe", "--log", str(p)]).exit_code == 2
    assert _cli(["--task", "nosuch", "--log", str(tmp_path / "audit")]).exit_code == 2
