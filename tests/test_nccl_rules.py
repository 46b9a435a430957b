"""NCCL's rules enforced on Gloo (``KC_COMM_RULES=nccl``): the GPU path proven on CPU (issue 25).

With the variable set, ``device_init("cpu")`` gives the job a stand-in device (``cpu:0``, ``hal.stand_in``) whose
tensors are told apart from host tensors; device groups refuse host tensors as NCCL does, the host group refuses
device tensors, and the collective order of every group is compared across ranks after each step; every rank's
operations are replayed under NCCL's stream rules (``comm.stream_model``), which name a deadlock's cycle — here a
host wait before what the peer needs first, which Gloo runs. The whole job in every layout: ``test_nccl_rules_job``.
"""

from __future__ import annotations

from tests.mp import run_distributed

RULES = {"KC_COMM_RULES": "nccl"}


# ---------------------------------------------------------------------- the stand-in device
def _marking(rank: int, world_size: int) -> dict:
    import torch

    from kuangchao_core.hal import device_init, stand_in
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    dev = device_init("cpu").device
    p = torch.nn.Parameter(torch.randn(4, 4, device=dev))
    x = torch.randn(2, 4).to(dev)
    (x @ p).sum().backward()
    reads0 = stand_in.host_reads()
    host_copy = p.cpu()
    value = p.grad.sum().item()
    out = {
        "device": str(dev),
        "param": stand_in.is_device_tensor(p),
        "batch_before_copy": stand_in.is_device_tensor(torch.randn(2)),
        "batch": stand_in.is_device_tensor(x),
        "grad": stand_in.is_device_tensor(p.grad),
        "grad_view": stand_in.is_device_tensor(p.grad[1:]),
        "reported_device": str(p.grad.device),
        "like_device": stand_in.is_device_tensor(torch.zeros(1, device=p.grad.device)),
        "tensor_on_device": stand_in.is_device_tensor(torch.tensor([1.0], device=dev)),
        "host_scalar": stand_in.is_device_tensor(torch.tensor([3])),
        "cpu_copy": stand_in.is_device_tensor(host_copy),
        "cpu_copy_is_copy": host_copy.data_ptr() != p.data_ptr(),
        "reads": stand_in.host_reads() - reads0,
        "value": value,
    }
    try:
        p.detach().numpy()
        out["numpy"] = "allowed"
    except TypeError as exc:
        out["numpy"] = str(exc)
    return out


def test_stand_in_device_tells_device_tensors_from_host_tensors():
    got = run_distributed(_marking, 1, env=RULES)[0]
    assert got["device"] == "cpu:0"
    assert got["param"] and got["batch"] and got["grad"] and got["grad_view"]  # forward, backward and views
    assert got["reported_device"] == "cpu:0" and got["like_device"] and got["tensor_on_device"]
    assert not got["batch_before_copy"] and not got["host_scalar"]
    assert not got["cpu_copy"] and got["cpu_copy_is_copy"]  # .cpu() is a device-to-host copy
    assert got["reads"] == 2  # .cpu() and .item(), each a host sync on a GPU
    assert "numpy" in got["numpy"] and ".cpu()" in got["numpy"]
    plain = run_distributed(_marking, 1)[0]  # control: without the variable there is no stand-in
    assert plain["device"] == "cpu" and not plain["param"] and plain["numpy"] == "allowed"


# ---------------------------------------------------------------------- the groups' rules
def _group_rules(rank: int, world_size: int) -> dict:
    import torch

    from kuangchao_core.comm import primitives as P
    from kuangchao_core.comm.group import host_group, init_distributed, world_group
    from kuangchao_core.errors import CommError
    from kuangchao_core.hal import device_init
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    dev = device_init("cpu").device
    init_distributed(backend="gloo", timeout_ms=60_000)
    world, host = world_group(), host_group()
    out = {"world": (world.kind, world.backend, world.rules), "host": (host.kind, host.backend, host.rules)}

    def attempt(key, fn):
        try:
            fn()
            out[key] = "ok"
        except CommError as exc:
            out[key] = str(exc)

    attempt("host_on_world", lambda: P.broadcast(torch.tensor([7], dtype=torch.int64), src=0, group=world))
    attempt("device_on_world", lambda: P.all_reduce(torch.ones(2, device=dev), group=world))
    attempt("host_on_host", lambda: P.all_reduce(torch.ones(2), group=host))
    attempt("device_on_host", lambda: P.all_reduce(torch.ones(2, device=dev), group=host))
    attempt("send_host", lambda: P.send(torch.ones(2), dst=1, group=world) if rank == 0 else None)
    return out


def test_device_groups_refuse_host_tensors_and_the_host_group_device_tensors():
    got = run_distributed(_group_rules, 2, init_pg=False, env=RULES)
    for r in got:
        assert r["world"] == ("device", "gloo", "nccl") and r["host"] == ("host", "gloo", "gloo")
        assert "broadcast on NCCL group 'world': a (1,) torch.int64 tensor is on cpu" in r["host_on_world"]
        assert r["device_on_world"] == "ok" and r["host_on_host"] == "ok"
        assert "on host group 'host'" in r["device_on_host"] and "cpu:0" in r["device_on_host"]
    assert "send on NCCL group 'world'" in got[0]["send_host"]
    plain = run_distributed(_group_rules, 2, init_pg=False)  # control: plain Gloo carries both
    assert plain[0]["world"] == ("device", "gloo", "gloo")
    assert plain[0]["host_on_world"] == "ok" and plain[0]["device_on_host"] == "ok"


def _order(rank: int, world_size: int, swap: bool) -> str:
    import torch

    from kuangchao_core.comm import primitives as P
    from kuangchao_core.comm.group import host_group, init_distributed, world_group
    from kuangchao_core.comm.order_check import verify_order
    from kuangchao_core.errors import CommError
    from kuangchao_core.hal import device_init
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    dev = device_init("cpu").device
    init_distributed(backend="gloo", timeout_ms=60_000)
    a, b = torch.ones(4, device=dev), torch.ones(2, 2, device=dev)  # the same bytes: Gloo cannot tell them apart
    for t in (b, a) if swap and rank == 1 else (a, b):
        P.all_reduce(t, group=world_group())
    try:
        verify_order(host_group())
        return "ok"
    except CommError as exc:
        return str(exc)


def test_collective_order_is_compared_across_ranks():
    assert run_distributed(_order, 2, args=(False,), init_pg=False, env=RULES) == ["ok", "ok"]
    swapped = run_distributed(_order, 2, args=(True,), init_pg=False, env=RULES)
    for text in swapped:
        assert "group 'world'" in text and "all_reduce float32 [2, 2]" in text and "order" in text, text


def _host_wait(rank: int, world_size: int, sabotage: bool) -> str:
    import torch

    from kuangchao_core.comm import primitives as P
    from kuangchao_core.comm.group import CommGroup, host_group, init_distributed
    from kuangchao_core.comm.order_check import verify_order
    from kuangchao_core.comm.p2p_batch import batch_send_recv
    from kuangchao_core.errors import CommError
    from kuangchao_core.hal import device_init
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    dev = device_init("cpu").device
    init_distributed(backend="gloo", timeout_ms=60_000)
    a = CommGroup([0, 1, 2], backend="gloo", name="a[0,1,2]")
    b = CommGroup([0, 1], backend="gloo", name="b[0,1]")
    x, y, w = torch.ones(2, device=dev), torch.ones(3, device=dev), torch.ones(4, device=dev)
    P.all_reduce(x, group=a)  # both communicators created first, in one order (NCCL creates them at first use)
    if rank < 2:
        (P.send if rank == 0 else P.recv)(y, 1 - rank, group=b)
    if rank == 0:
        if not sabotage:
            P.all_reduce(x, group=a)
        P.send(y, 1, group=b)
        y.sum().item()  # the host waits for its send on group b ...
        if sabotage:  # ... before issuing the all-reduce on group a that rank 1's later receive queues behind
            P.all_reduce(x, group=a)
    elif rank == 1:
        pending = P.all_reduce(x, group=a, async_op=True)
        batch_send_recv([], [(w, 2)], a).wait()  # on NCCL: behind the all-reduce on group a's stream
        w.sum().item()
        P.recv(y, 0, group=b)
        pending.wait()
    else:
        pending = P.all_reduce(x, group=a, async_op=True)
        batch_send_recv([(w, 1)], [], a).wait()
        pending.wait()
    try:
        verify_order(host_group(), final=True)
        return "ok"
    except CommError as exc:
        return str(exc)


def test_a_host_wait_before_what_the_peer_needs_first_is_caught():
    """Gloo runs both orders (its receive on group a does not queue behind the all-reduce). On NCCL rank 1's
    receive from rank 2 waits behind the all-reduce on group a's stream, which waits for rank 0, whose host waits for
    a send that rank 1 receives only after that receive: the replay names the cycle through both hosts."""
    assert run_distributed(_host_wait, 3, args=(False,), init_pg=False, env=RULES) == ["ok"] * 3
    for text in run_distributed(_host_wait, 3, args=(True,), init_pg=False, env=RULES):
        assert "NCCL would deadlock" in text, text
        assert "rank 0's host reads a device value" in text and "rank 0: send to rank 1" in text, text
        assert "rank 1's host reads a device value" in text and "is queued behind rank 1: all_reduce" in text, text


# ---------------------------------------------------------------------- a hang named without a host wait
def _hang(rank: int, world_size: int) -> dict:
    import time

    import torch

    from kuangchao_core.comm import primitives as P
    from kuangchao_core.comm import watchdog
    from kuangchao_core.comm.group import CommGroup, init_distributed
    from kuangchao_core.errors import CommTimeout
    from kuangchao_core.hal import device_init
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    dev = device_init("cpu").device
    init_distributed(backend="gloo", timeout_ms=60_000)
    group = CommGroup([0, 1], backend="gloo", timeout_ms=2000, name="dp[0,1]")
    P.all_reduce(torch.ones(2, device=dev), group=group, async_op=True).wait()  # both arrive: nothing to name
    time.sleep(2.5)
    out = {"after_clean_op": [str(e) for e in watchdog.noticed()]}
    if rank == 0:  # rank 1 never joins the second one; rank 0 issues it and goes on without waiting
        handle = P.all_reduce(torch.ones(2, device=dev), group=group, async_op=True)
        deadline = time.monotonic() + 8.0  # noticed at 0.9 x 2 s, then the diagnosis asks rank 1 (<= 1 s)
        while not watchdog.noticed() and time.monotonic() < deadline:
            time.sleep(0.1)
        out["noticed"] = [(e.group, e.op, e.seq, e.missing_ranks) for e in watchdog.noticed()]
        try:
            handle.wait()
            out["wait"] = "returned"
        except CommTimeout as exc:
            out["wait"] = (exc.group, exc.op, exc.seq, exc.missing_ranks)
    else:
        time.sleep(10.0)  # alive, its counters answering the diagnosis
    return out


def test_the_watchdog_names_a_hang_that_no_host_wait_sees():
    got = run_distributed(_hang, 2, init_pg=False, env=RULES, timeout=120)
    assert got[0]["after_clean_op"] == [] and got[1]["after_clean_op"] == []
    assert got[0]["noticed"] == [("dp[0,1]", "all_reduce", 2, [1])]
    assert got[0]["wait"] == ("dp[0,1]", "all_reduce", 2, [1])  # the wait raises what the watchdog named
