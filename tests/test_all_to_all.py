"""The ``all_to_all`` primitive (issue 40: expert parallelism's token exchange) on 3 real Gloo processes: variable
splits (counts exchanged first, then rows), the guard (denied without a token, under its own interface name), the
timers, the bad-input errors, and the NCCL rules' order log, which records the same entry on every member though
the row counts differ."""

from __future__ import annotations

import pytest
import torch

from tests.mp import run_distributed

WORLD = 3


def _splits(rank: int) -> list[int]:
    """Rows rank sends to each member: uneven, one empty."""
    return [(rank + 2 * j) % 3 for j in range(WORLD)]


def _body(rank: int, world_size: int) -> dict:
    import kuangchao.distributed as kc
    from kuangchao_core.errors import CommError, PermissionDenied
    from kuangchao_core.perm import guard_api

    out: dict = {}
    try:
        kc.all_to_all(torch.empty(0), torch.empty(0), [0] * world_size, [0] * world_size)
        out["denied"] = None
    except PermissionDenied as exc:
        out["denied"] = (exc.interface, exc.resource)
    guard_api.install_guard(guard_api.AllowAll())
    kc.init()
    kc.COMM_STATS.reset()
    g = kc.CommGroup(ranks=list(range(world_size)), backend="gloo", timeout_ms=30000)
    send = _splits(rank)
    counts = torch.tensor(send, dtype=torch.int64)
    recv_counts = torch.empty(world_size, dtype=torch.int64)
    kc.all_to_all(recv_counts, counts, [1] * world_size, [1] * world_size, group=g)  # counts first
    recv = recv_counts.tolist()
    rows = torch.cat([torch.tensor([[100.0 * rank + 10 * j + i, -1.0] for i in range(n)]) for j, n in enumerate(send)])
    got = torch.empty(sum(recv), 2, dtype=torch.float32)
    kc.all_to_all(got, rows.reshape(-1, 2), recv, send, group=g)
    out["recv"], out["got"] = recv, got[:, 0].tolist()
    out["calls"] = kc.COMM_STATS.counts_by_op().get("all_to_all")
    from kuangchao_core.comm import host_staging

    out["staged"] = host_staging.summary().get("all_to_all", {}).get("ops", 0)
    try:
        kc.all_to_all(torch.empty(1, 2), rows, recv, send, group=g)
    except CommError as exc:
        out["bad_sizes"] = str(exc)
    try:
        kc.all_to_all(got, rows, recv, send[:2], group=g)
    except CommError as exc:
        out["bad_splits"] = str(exc)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_body, WORLD, timeout=120)


def test_variable_splits_arrive_in_group_order(results):
    for rank, r in enumerate(results):
        assert r["recv"] == [_splits(j)[rank] for j in range(WORLD)]
        want = [100.0 * j + 10 * rank + i for j in range(WORLD) for i in range(_splits(j)[rank])]
        assert r["got"] == want


def test_host_staging_path_gives_the_same_rows():
    """``KC_GLOO_HOST_STAGING=always``: the path CUDA tensors on a Gloo group take (several ranks on one GPU)."""
    staged = run_distributed(_body, WORLD, timeout=120, env={"KC_GLOO_HOST_STAGING": "always"})
    for rank, r in enumerate(staged):
        assert r["staged"] >= 2 and r["recv"] == [_splits(j)[rank] for j in range(WORLD)]
        assert r["got"] == [100.0 * j + 10 * rank + i for j in range(WORLD) for i in range(_splits(j)[rank])]


def test_guarded_timed_and_checked(results):
    for r in results:
        assert r["denied"] == ("all_to_all", "group:world")
        assert r["calls"] == 2  # the counts, then the rows; the refused calls never reach dispatch
        assert "splits sum to" in r["bad_sizes"] and "need 3 splits each way" in r["bad_splits"]


def _order_body(rank: int, world_size: int, host_rows: bool) -> str:
    from kuangchao_core.comm import primitives as P
    from kuangchao_core.comm.group import host_group, init_distributed, world_group
    from kuangchao_core.comm.order_check import verify_order
    from kuangchao_core.errors import CommError
    from kuangchao_core.hal import device_init
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    dev = device_init("cpu").device
    init_distributed(backend="gloo", timeout_ms=60_000)
    send = _splits(rank)
    recv = [_splits(j)[rank] for j in range(world_size)]
    rows = torch.ones(sum(send), 4) if host_rows else torch.ones(sum(send), 4, device=dev)
    try:
        P.all_to_all(torch.empty(sum(recv), 4, device=dev), rows, recv, send, group=world_group())
        verify_order(host_group())  # every member logged the same entry, whatever its row counts
        return "ok"
    except CommError as exc:
        return str(exc)


def test_nccl_rules_order_log_and_host_tensor_refusal():
    rules = {"KC_COMM_RULES": "nccl"}
    assert run_distributed(_order_body, WORLD, args=(False,), init_pg=False, env=rules) == ["ok"] * WORLD
    for text in run_distributed(_order_body, WORLD, args=(True,), init_pg=False, env=rules):
        assert "all_to_all on NCCL group 'world'" in text and "device tensors only" in text, text
