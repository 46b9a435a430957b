"""``comm.host_staging``: every primitive on a Gloo device group run through host copies (the GPU check's several
ranks on one GPU) gives the same tensors as without staging, and each staged op is counted.

CUDA is not here, so ``KC_GLOO_HOST_STAGING=always`` stages CPU tensors through the same code (copies, the primitive
on the copies, the copy back at the end or at ``wait()``). Negative control: the same ops with the copy back
removed leave the original tensors unchanged, and the comparison fails.
"""

from __future__ import annotations

import pytest
import torch

from tests.mp import run_distributed

pytestmark = pytest.mark.distributed


def _ops(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Every primitive once on a 2-rank device group, in float64 (exact sums of small integers)."""
    from kuangchao_core.comm import CommGroup
    from kuangchao_core.comm import primitives as P
    from kuangchao_core.comm.p2p_batch import batch_send_recv

    g = CommGroup([0, 1], backend="gloo", name="staged")
    other = 1 - rank
    base = torch.arange(6, dtype=torch.float64) + 10 * rank
    out: dict[str, torch.Tensor] = {}
    t = base.clone()
    P.all_reduce(t, group=g)
    out["all_reduce"] = t
    t = base.clone()
    P.all_reduce(t, group=g, op="avg", async_op=True).wait()
    out["all_reduce_async_avg"] = t
    t = base.clone()
    P.broadcast(t, src=1, group=g)
    out["broadcast"] = t
    w = torch.nn.Parameter(base.clone())  # a leaf that requires grad, broadcast in place as the engine does
    P.broadcast(w, src=0, group=g)
    out["broadcast_parameter"] = w.detach()
    out["all_gather_new_list"] = torch.cat(P.all_gather(None, base.clone(), group=g))
    flat = torch.zeros(12, dtype=torch.float64)
    P.all_gather_into(flat, base.clone(), group=g, async_op=True).wait()
    out["all_gather_into_async"] = flat
    shard = torch.zeros(3, dtype=torch.float64)
    P.reduce_scatter(shard, base.clone(), group=g)
    out["reduce_scatter"] = shard
    got = torch.zeros(6, dtype=torch.float64)
    if rank == 0:
        P.send(base.clone(), 1, group=g)
        P.recv(got, 1, group=g)
    else:
        P.recv(got, 0, group=g)
        P.send(base.clone(), 0, group=g)
    out["send_recv"] = got
    got = torch.zeros(6, dtype=torch.float64)
    handles = [P.irecv(got, other, group=g, tag=3), P.isend(base.clone(), other, group=g, tag=3)]
    for h in handles:
        h.wait()
    out["isend_irecv"] = got
    got = torch.zeros(6, dtype=torch.float64)
    batch_send_recv([(base.clone(), other)], [(got, other)], g).wait()
    out["batch_send_recv"] = got
    return out


def _body(rank: int, world: int, staged: bool, broken: bool) -> dict:
    import os

    from kuangchao_core import guard_api
    from kuangchao_core.comm import host_staging, init_distributed

    guard_api.install_guard(guard_api.AllowAll())
    if staged:
        os.environ[host_staging.ENV] = "always"
    if broken:  # the broken variant: results stay in the host copies
        host_staging._copy_back = lambda pairs: None
    init_distributed("gloo")
    out = _ops(rank, world)
    return {"out": {k: v.tolist() for k, v in out.items()}, "stats": host_staging.summary()}


def test_every_primitive_staged_through_the_host_equals_the_unstaged_one():
    plain = run_distributed(_body, world_size=2, args=(False, False))
    staged = run_distributed(_body, world_size=2, args=(True, False))
    for rank in range(2):
        assert staged[rank]["out"] == plain[rank]["out"], rank
        assert plain[rank]["stats"] == {}  # CPU tensors, staging not forced: nothing staged
        stats = staged[rank]["stats"]
        assert set(stats) == {"all_reduce", "broadcast", "all_gather", "all_gather_into", "reduce_scatter", "send",
                              "recv", "batch_send_recv"}, stats  # fmt: skip
        assert (
            stats["all_reduce"]["ops"] == 2
            and stats["broadcast"]["ops"] == 2
            and stats["send"]["ops"] == 2
            and stats["recv"]["ops"] == 2
        )
        assert stats["reduce_scatter"]["bytes"] == (6 + 3) * 8  # the input and the output shard, float64
    # the values themselves (rank 0: 0..5, rank 1: 10..15)
    want_sum = [2 * i + 10 for i in range(6)]
    assert plain[0]["out"]["all_reduce"] == want_sum and plain[1]["out"]["reduce_scatter"] == want_sum[3:]
    assert plain[0]["out"]["send_recv"] == [float(10 + i) for i in range(6)]


def test_the_broken_variant_without_the_copy_back_is_caught():
    plain = run_distributed(_body, world_size=2, args=(False, False))
    broken = run_distributed(_body, world_size=2, args=(True, True))
    assert broken[0]["out"] != plain[0]["out"]
    assert broken[0]["out"]["all_reduce"] == [float(i) for i in range(6)]  # untouched: the sum stayed on the host


def _job(rank: int, world: int, tmp: str, staged: bool) -> dict:
    import os

    from kuangchao_core.comm import host_staging
    from tests.engine_helpers import run_trainer, tiny_job

    if staged:
        os.environ[host_staging.ENV] = "always"
    cfg = tiny_job(tmp, parallel={"data_parallel_size": 2, "zero_stage": 2}, train={"steps": 3})
    out = run_trainer(rank, world, cfg)
    out["staged"] = host_staging.summary()
    return out


def test_a_zero2_job_through_host_staging_trains_the_same_weights(tmp_path):
    plain = run_distributed(_job, world_size=2, args=(str(tmp_path / "plain"), False))
    staged = run_distributed(_job, world_size=2, args=(str(tmp_path / "staged"), True))
    assert staged[0]["losses"] == plain[0]["losses"] and len(plain[0]["losses"]) == 3
    for name, value in plain[0]["params"].items():
        assert (staged[0]["params"][name] == value).all(), name  # bit for bit: the copies are exact
    # the initial broadcast, ZeRO-2's gradient reduce-scatter and parameter all-gather, the loss all-reduce: all
    # through the host
    ops = set(staged[0]["staged"])
    assert {"broadcast", "all_reduce", "reduce_scatter"} <= ops and ops & {"all_gather", "all_gather_into"}, ops
    assert plain[0]["staged"] == {}
