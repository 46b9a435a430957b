"""NCCL's rules enforced on Gloo (``KC_COMM_RULES=nccl``): the GPU path proven on CPU (issue 25).

With the variable set, ``device_init("cpu")`` gives the job a stand-in device (``cpu:0``, ``hal.stand_in``) whose
tensors are told apart from host tensors; device groups refuse host tensors as NCCL does, the host group refuses
device tensors, and the collective order of every group is compared across ranks after each step.

The job test runs the worker entry point as ``kc train``'s workers run it — start, resume plan, steps, evaluation
and greedy samples, a checkpoint save, a followed global-config change, the final evaluation, then a second run
that resumes — at dp2, tp2, tp2 with sequence parallelism, pp2 and dp2 with ZeRO-3. Negative control: the host
coordination sent on the world group, as before the fix, fails at the resume plan's broadcast with the error a CUDA
job gave.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.engine_helpers import tiny_job
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


# ---------------------------------------------------------------------- a whole job under the rules
LAYOUTS = {
    "dp2": {"data_parallel_size": 2},
    "tp2": {"tensor_parallel_size": 2},
    "tp2_sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
    "pp2": {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2},
    "dp2_zero3": {"data_parallel_size": 2, "zero_stage": 3},
    "cp2": {"context_parallel_size": 2},  # issue 30: the ring's exchanges and the dp×cp reductions
}


def _config(tmp_path: Path, parallel: dict) -> str:
    cfg = tiny_job(
        str(tmp_path),
        parallel={"micro_batch_size": 2, **parallel},
        train={"steps": 6, "eval_interval": 3, "log_interval": 1},
        checkpoint={"interval": 3, "resume": "auto"},
    ).model_dump(mode="json")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return str(path)


def _job(rank: int, world_size: int, config: str, global_config: str, sabotage: bool) -> dict:
    import os

    from kuangchao_core.engine import trainer as trainer_mod
    from kuangchao_core.engine import worker
    from kuangchao_core.hal import stand_in

    os.environ["KC_GLOBAL_CONFIG"] = global_config
    steps: list[tuple[int, int]] = []  # (step before, host reads in the step)
    applied: list[float] = []
    plain_step = trainer_mod.Trainer.train_step

    def counted(self, batches):
        before = stand_in.host_reads()
        out = plain_step(self, batches)
        steps.append((out.step - 1, stand_in.host_reads() - before))
        applied.append(self.lr_scale)
        return out

    trainer_mod.Trainer.train_step = counted
    if sabotage:  # the pre-fix code path: host coordination on the world (device) group
        from kuangchao_core.comm.group import world_group

        trainer_mod.host_group = world_group
    codes = [worker.main(["--config", config, "--max-steps", "3"]), worker.main(["--config", config])]
    return {"codes": codes, "steps": steps, "lr_scale": applied, "stand_in": stand_in.active()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_whole_job_keeps_nccl_rules(tmp_path, layout):
    from kuangchao_core.perm import guard_api
    from kuangchao_core.perm.audit import AuditLog
    from kuangchao_core.perm.global_config import GlobalConfig

    config = _config(tmp_path, LAYOUTS[layout])
    gc = tmp_path / "global_config.json"
    before = guard_api.current_guard()
    guard_api.install_guard(guard_api.AllowAll())  # a trusted-mode job takes an unsigned change
    try:
        GlobalConfig(gc, "t", audit=AuditLog(tmp_path / "audit.jsonl", "t")).set(
            "lr_scale", 0.5
        )  # `kc config set lr_scale 0.5`, followed from the first step
    finally:
        guard_api.install_guard(before)
    got = run_distributed(_job, 2, args=(config, str(gc), False), init_pg=False, env=RULES, timeout=300)
    for r in got:
        assert r["stand_in"] and r["codes"] == [0, 0]
        assert [s for s, _ in r["steps"]] == [0, 1, 2, 3, 4, 5]  # the second run resumed at step 3
        # the step reads device values once (loss, gradient norm and the finite flag together)
        assert all(reads == 1 for _, reads in r["steps"]), r["steps"]
    assert got[0]["lr_scale"] == [0.5] * 6  # the followed change, from the first step of each run
    step_dirs = sorted(p.name for p in (tmp_path / "ckpt").rglob("step_*") if p.is_dir())
    assert step_dirs == ["step_00000003", "step_00000006"]


def test_host_coordination_on_the_world_group_fails_under_the_rules(tmp_path):
    config = _config(tmp_path, LAYOUTS["dp2"])
    gc = tmp_path / "global_config.json"
    with pytest.raises(RuntimeError) as info:
        run_distributed(_job, 2, args=(config, str(gc), True), init_pg=False, env=RULES, timeout=300)
    assert "broadcast on NCCL group 'world': a (1,) torch.int64 tensor is on cpu" in str(info.value)


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
