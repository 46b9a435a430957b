"""The permission layer in real multi-process Gloo jobs, through the communication primitives.

- a worker that reaches for another group's gradients is denied; its own group works;
- a ``data_loader`` module calling ``all_reduce`` is denied;
- a token of job A is useless in job B;
- a job whose tokens live 2 s trains for several TTLs with automatic renewal and no failed step.
"""

from __future__ import annotations

import time

import pytest
import torch

from kuangchao_core.perm import reasons as R
from kuangchao_core.perm.audit_verify import read_records, verify_log
from kuangchao_core.perm.authority import Authority
from kuangchao_core.perm.layout import DEFAULT_REGIONS, group_layout, groups_of_rank
from kuangchao_core.perm.runtime import RenewalServer
from tests.mp import run_distributed

TRAINER = ["all_reduce", "all_gather", "broadcast", "send", "recv", "device_init", "memory_alloc", "dataset_read"]


def _issue_all(auth, job, world, dp, tp, ttl_s=600, tmp=None):
    layout = group_layout({"dp": dp, "tp": tp})
    paths = {}
    for r in range(world):
        for module, role, kw in (
            (
                f"worker-{r}",
                "trainer",
                dict(
                    interfaces=TRAINER,
                    devices=["cpu"],
                    regions=DEFAULT_REGIONS,
                    groups=groups_of_rank(layout, r),
                    objects=["dataset:synthetic"],
                ),
            ),
            (f"data_loader-{r}", "data_loader", dict(interfaces=["dataset_read"], objects=["dataset:synthetic"])),
        ):
            p = tmp / f"{job}-{module}.token"
            p.write_text(auth.issue(module, role, job, 0, ttl_s=ttl_s, **kw))
            paths[module] = str(p)
    return paths


def _denied(fn):
    from kuangchao_core.errors import PermissionDenied

    try:
        fn()
    except PermissionDenied as exc:
        return getattr(exc, "code", "?")
    return None


def _scope_body(rank, world_size, tokens, trust, audit, forged_dl):
    import kuangchao.distributed as kc
    from kuangchao_core.perm import guard_api
    from kuangchao_core.perm.runtime import install_worker_guard

    out = {}
    install_worker_guard(tokens[f"worker-{rank}"], trust, "job-A", 0, audit, renew=False)
    kc.init()
    groups = {
        name: kc.CommGroup(ranks=ranks, backend="gloo", name=name)
        for name, ranks in group_layout({"dp": 2, "tp": 2}).items()
        if name not in ("world", "host")
    }
    mine_tp = groups["tp[0,1]"] if rank < 2 else groups["tp[2,3]"]
    other_tp = groups["tp[2,3]"] if rank < 2 else groups["tp[0,1]"]
    grad = torch.full((4,), float(rank + 1))
    kc.all_reduce(tensor=grad, group=mine_tp)
    out["own_group_sum"] = grad.tolist()
    # reach into the other tensor-parallel pair's gradients: never reaches the backend
    out["recv_other"] = _denied(lambda: kc.recv(torch.empty(4), src=(rank + 2) % 4, group=other_tp))
    out["reduce_other"] = _denied(lambda: kc.all_reduce(tensor=torch.ones(4), group=other_tp))
    out["non_canonical"] = _denied(lambda: guard_api.check("all_reduce", "group:tp[0,1]/../tp[2,3]"))
    kc.all_reduce(tensor=torch.zeros(1))  # every rank is done with the worker token
    # this process now acts as its data loader module
    install_worker_guard(
        tokens[f"data_loader-{rank}"], trust, "job-A", 0, audit, module_id=f"data_loader-{rank}", renew=False
    )
    out["loader_all_reduce"] = _denied(lambda: kc.all_reduce(tensor=torch.ones(1)))
    guard_api.check("dataset_read", "dataset:synthetic")
    if rank == 0:  # a data_loader token that lists all_reduce: the role still refuses
        install_worker_guard(forged_dl, trust, "job-A", 0, audit, module_id="data_loader-0", renew=False)
        out["loader_token_with_all_reduce"] = _denied(lambda: kc.all_reduce(tensor=torch.ones(1)))
    # job A's worker token presented in job B
    try:
        install_worker_guard(tokens[f"worker-{rank}"], trust, "job-B", 0, audit + ".job-B", renew=False)
        out["job_b_install"] = None
    except R.TokenRejected as exc:
        out["job_b_install"] = exc.code
    out["job_b_all_reduce"] = _denied(lambda: kc.all_reduce(tensor=torch.ones(1)))
    return out


def test_scope_roles_and_job_binding_in_real_processes(tmp_path):
    auth = Authority(tmp_path / "auth")
    tokens = _issue_all(auth, "job-A", 4, dp=2, tp=2, tmp=tmp_path)
    forged = tmp_path / "dl-forged.token"
    forged.write_text(
        auth.issue(
            "data_loader-0",
            "data_loader",
            "job-A",
            0,
            interfaces=["all_reduce", "dataset_read"],
            groups=["world"],
            objects=["dataset:synthetic"],
            ttl_s=600,
        )
    )
    audit = tmp_path / "audit.jsonl"
    res = run_distributed(
        _scope_body, 4, args=(tokens, str(auth.trust_store_path), str(audit), str(forged)), timeout=180
    )
    for rank, out in enumerate(res):
        pair = [1.0, 2.0] if rank < 2 else [3.0, 4.0]
        assert out["own_group_sum"] == [sum(pair)] * 4
        assert out["recv_other"] == R.OUT_OF_SCOPE and out["reduce_other"] == R.OUT_OF_SCOPE
        assert out["non_canonical"] == R.OUT_OF_SCOPE
        assert out["loader_all_reduce"] == R.OUT_OF_SCOPE
        assert out["job_b_install"] == R.WRONG_JOB and out["job_b_all_reduce"] == R.WRONG_JOB
    assert res[0]["loader_token_with_all_reduce"] == R.ROLE_DENIED
    recs = list(read_records(audit))
    denials = {(r["actor"], r["action"], r["reason"]) for r in recs if r["decision"] == "deny"}
    assert ("worker-0", "recv", "out_of_scope") in denials and (
        "data_loader-3",
        "all_reduce",
        "out_of_scope",
    ) in denials
    assert ("data_loader-0", "all_reduce", "role_denied") in denials
    assert verify_log(audit, log_id="job-A").ok
    assert {r["reason"] for r in read_records(f"{audit}.job-B") if r["decision"] == "deny"} == {"wrong_job"}


def _train_body(rank, world_size, tokens, trust, audit, addr, seconds):
    import kuangchao.distributed as kc
    from kuangchao_core.perm import guard_api
    from kuangchao_core.perm.runtime import install_worker_guard

    guard = install_worker_guard(tokens[f"worker-{rank}"], trust, "job-T", 0, audit, authority_addr=addr, leeway_s=0.25)
    kc.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    steps, t_end, losses = 0, time.monotonic() + seconds, []
    while True:
        done = torch.tensor([float(time.monotonic() >= t_end)])
        kc.all_reduce(tensor=done, op="max")  # the ranks agree on when to stop
        if done.item():
            break
        x = torch.randn(8, 16, generator=gen)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            kc.all_reduce(tensor=p.grad, op="avg")
        opt.step()
        losses.append(loss.item())
        steps += 1
        time.sleep(0.02)
    guard.renewer.stop()
    guard.renewer.join(timeout=5)
    renewals = guard.renewer.renewals  # read once stopped: a renewal in flight is counted by both sides
    failures = guard.renewer.failures
    time.sleep(max(0.0, guard.expires_in) + 0.1)  # negative control: without renewal the token now lapses
    expired = _denied(lambda: guard_api.check("all_reduce", "group:world"))
    guard.close()
    return {
        "steps": steps,
        "renewals": renewals,
        "failures": failures,
        "expired": expired,
        "first": losses[0],
        "last": losses[-1],
        "ttl": guard.claims.exp - guard.claims.iat,
    }


@pytest.mark.timeout(240)
def test_short_ttl_job_runs_many_ttls_with_renewal(tmp_path):
    auth = Authority(tmp_path / "auth", leeway_s=0.25)
    # first tokens carry a start-up grace (as issue_tokens does); every renewal lives the configured 2 s
    tokens = _issue_all(auth, "job-T", 2, dp=2, tp=1, ttl_s=60, tmp=tmp_path)
    audit = tmp_path / "audit.jsonl"
    seconds = 9.0
    with RenewalServer(auth, "job-T", 0, audit_log=audit, anchor_interval_s=1.0, ttl_s=2) as server:
        res = run_distributed(
            _train_body,
            2,
            timeout=200,
            env={"KC_TOKEN_TTL": "2"},
            args=(tokens, str(auth.trust_store_path), str(audit), server.address, seconds),
        )
    for out in res:
        assert out["ttl"] == 2
        assert out["renewals"] >= seconds / 2, out  # renewed every ~1 s across 9 s: > 4 TTLs
        assert out["failures"] == 0 and out["steps"] > 20
        assert out["last"] < out["first"]
        assert out["expired"] == R.EXPIRED  # the control: renewal is what kept the token alive
    assert server.renewed == sum(o["renewals"] for o in res) and server.refused == 0
    report = verify_log(audit, log_id="job-T", trust_store=auth.trust)
    assert report.ok and report.checkpoints >= 2, report
    recs = list(read_records(audit))
    assert sum(r["action"] == "token_renewed" for r in recs) == server.renewed
    assert not any(r["decision"] == "deny" and r["action"] == "all_reduce" and r["reason"] != "expired" for r in recs)
