"""Every tensor a training step hands to a collective lives on the job's device (issue 12: NCCL reduces device
tensors only; a CPU scalar on an NCCL group fails there and nowhere on a CPU machine).

On a CPU-only machine every tensor is on the CPU, so a missing ``device=`` cannot be seen directly. The step runs
with torch's default device set to ``meta``: a tensor made without an explicit device lands on ``meta``, and a check
wrapped around torch.distributed's collectives names any tensor that is not on the trainer's device. Negative control:
the gradient-norm reduction rebuilt the way it was before the fix (a scalar without a device) is caught.
"""

from __future__ import annotations

import pytest

from tests.engine_helpers import tiny_job
from tests.mp import run_distributed

LAYOUTS = {
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2},
    "dp2": {"data_parallel_size": 2},
    "dp2_zero2": {"data_parallel_size": 2, "zero_stage": 2},
    "dp2_zero3": {"data_parallel_size": 2, "zero_stage": 3},
}


def _check_collectives(device_type: str, seen: list[str]):
    import torch
    import torch.distributed as dist

    from kuangchao_core.comm import primitives

    def wrap(fn):
        def checked(*args, **kwargs):
            for a in list(args) + list(kwargs.values()):
                for t in a if isinstance(a, (list, tuple)) else [a]:
                    t = t.tensor if isinstance(t, dist.P2POp) else t  # a grouped batch's sends and receives
                    if isinstance(t, torch.Tensor) and t.device.type != device_type:
                        seen.append(f"{fn.__name__}: a {tuple(t.shape)} tensor on {t.device}")
                        raise RuntimeError(seen[-1])
            return fn(*args, **kwargs)

        return checked

    names = ("all_reduce", "all_gather", "broadcast", "reduce_scatter_tensor", "send", "recv", "isend", "irecv")
    for name in (*names, "batch_isend_irecv"):
        setattr(dist, name, wrap(getattr(dist, name)))
    primitives._ag_single = wrap(primitives._ag_single)  # the flat forms, bound when the comm layer was imported
    primitives._rs_single = wrap(primitives._rs_single)


def _pre_fix_norm_reduction():
    """The gradient norm's sum of squares reduced as a fresh scalar made without a device (the old bug)."""
    import torch

    from kuangchao_core.parallel import grad_sync

    honest = grad_sync._sum_over

    def without_device(t, *groups):
        scalar = torch.zeros((), dtype=t.dtype) + t.cpu()
        return honest(scalar, *groups)

    grad_sync._sum_over = without_device


def _steps(rank: int, world_size: int, jobs: list[tuple[str, object, bool]]):
    import torch

    from kuangchao_core.data import PrefetchLoader
    from tests.engine_helpers import trainer_in_process

    out = {}
    for name, cfg, sabotage in jobs:
        trainer = trainer_in_process(cfg, rank, world_size, timeout_ms=60_000)
        trainer.sync.prepare()
        loader = PrefetchLoader(trainer.dataset, trainer.sampler, depth=2)
        batches = [loader.next_step() for _ in range(2)]
        loader.close()
        seen: list[str] = []
        if name == jobs[0][0]:
            _check_collectives("cpu", seen)
        if sabotage:
            _pre_fix_norm_reduction()
        torch.set_default_device("meta")
        try:
            losses = [trainer.train_step(b).loss for b in batches]
            out[name] = ("ok", losses)
        except Exception as exc:  # the communication layer wraps the check's error in its CommError
            out[name] = ("caught", str(exc))
        finally:
            torch.set_default_device(None)
        if sabotage:
            return out  # the sabotaged reduction leaves the group mid-step: this process is done
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("devices")
    jobs = [(n, tiny_job(str(tmp / n), parallel=p, train={"steps": 2}), False) for n, p in LAYOUTS.items()]
    jobs.append(("tp2_pre_fix", tiny_job(str(tmp / "neg"), parallel=LAYOUTS["tp2"], train={"steps": 2}), True))
    return run_distributed(_steps, 2, args=(jobs,), timeout=240)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_collective_of_a_step_gets_tensors_on_the_job_device(results, layout):
    for rank_out in results:
        status, detail = rank_out[layout]
        assert status == "ok", f"{layout}: {detail}"
        assert all(0 < x < 10 for x in detail)


def test_a_scalar_made_without_a_device_is_caught(results):
    status, detail = results[0]["tp2_pre_fix"]
    assert status == "caught" and "all_reduce" in detail and "meta" in detail, detail


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather", "reduce_scatter"])
def test_an_nccl_group_refuses_a_cpu_tensor_with_its_name_before_any_op(op):
    from types import SimpleNamespace

    import torch

    from kuangchao_core.comm import primitives as P
    from kuangchao_core.errors import CommError

    group = SimpleNamespace(
        backend="nccl", kind="device", rules="nccl", name="dp[0,1]", ranks=[0, 1], size=2, global_rank=0, pg=None
    )
    t = torch.zeros(4)
    calls = {
        "all_reduce": lambda: P.all_reduce(t, group=group),
        "broadcast": lambda: P.broadcast(t, src=0, group=group),
        "all_gather": lambda: P.all_gather_into(torch.zeros(8), t, group=group),
        "reduce_scatter": lambda: P.reduce_scatter(torch.zeros(4), torch.zeros(8), group=group),
    }
    with pytest.raises(CommError, match=r"NCCL group 'dp\[0,1\]'.*\(4,\) torch.float32 tensor is on cpu"):
        calls[op]()
