"""Expert parallelism (issue 40 item 2): the ``ep`` axis carved out of dp, the all-to-all primitive, and a MoE
block whose experts are sharded over real Gloo processes equal to the one-process block in float64.

The block test: every rank builds the same float64 block (all experts), keeps its ``E / ep`` experts
(``models.moe_dispatch.shard_experts``) and runs its own tokens; one process runs the whole block on each rank's
tokens separately (the capacity is per micro-batch: each rank's tokens are one). Outputs, the input gradients and
the expert weights' gradients (each rank's shard summed over the ep group, as GradSync sums it) must match to
float64 rounding; the negative control sends each token to the rank holding the wrong experts.
"""

from __future__ import annotations

import pytest
import torch

from kuangchao_core.axes import GRID, MeshAxes, size_problems
from tests.mp import run_distributed

H, WIDTH, E = 16, 12, 4
TOL = 1e-12  # float64: the same products per row; only the summation order of the input gradients differs


def test_ep_is_carved_out_of_dp_its_groups_and_replicas():
    axes = MeshAxes(dp=4, ep=2, tp=2)
    assert "ep" not in GRID and axes.world_size == 8  # ep adds no processes
    assert axes.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert axes.groups("ep") == [[0, 2], [4, 6], [1, 3], [5, 7]]  # consecutive dp indices
    assert axes.groups("dp_mod_ep") == [[0, 4], [2, 6], [1, 5], [3, 7]]  # the experts' replicas: dp ÷ ep
    assert axes.coords_of(6) == {"dp": 3, "cp": 0, "pp": 0, "tp": 0, "ep": 1}
    assert axes.group_of("ep", 6) == [4, 6] and axes.group_of("dp_mod_ep", 6) == [2, 6]
    assert axes.active() == ("tp", "pp", "dp", "ep", "dp_mod_ep")
    assert MeshAxes(dp=4).active() == ("tp", "pp", "dp")  # a job without ep builds what it always built
    assert size_problems({"dp": 3, "ep": 2}, 3) == [
        ("parallel.expert_parallel_size", "2 must divide data_parallel_size 3")
    ]
    assert "expert_parallel_size" not in size_problems({"dp": 2, "ep": 2}, 4)[0][1]  # not a factor of the world


def _block(seed: int = 0, **moe):
    from kuangchao_core.models.moe import MoeBlock, MoeConfig

    cfg = MoeConfig(num_experts=E, expert_intermediate_size=WIDTH, **moe)
    block = MoeBlock(H, 99, cfg).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
        block.router.weight[0] += 0.5  # a skew: expert 0 overloaded, so capacity drops tokens
    return block


def _tokens(rank: int, n: int = 20) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, H, generator=gen, dtype=torch.float64) + 0.3


def _ep_block_body(rank: int, world_size: int, moe: dict, sabotage: bool) -> dict:
    from kuangchao_core.comm import CommGroup, init_distributed
    from kuangchao_core.models import moe_dispatch
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    init_distributed(backend="gloo", timeout_ms=60_000)
    group = CommGroup(list(range(world_size)), backend="gloo", timeout_ms=60_000)
    if sabotage:  # the negative control: each expert's tokens go to the next rank (the wrong experts)
        moe_dispatch.owner = lambda expert, local, ranks: (torch.div(expert, local, rounding_mode="floor") + 1) % ranks
    block = _block(**moe)
    moe_dispatch.shard_experts(block.experts, moe_dispatch.ExpertShard(group, E))
    x = _tokens(rank).requires_grad_(True)
    out = block(x)
    out.pow(2).sum().backward()
    w = block.experts
    return {
        "out": out.detach().numpy().copy(),
        "x_grad": x.grad.numpy().copy(),
        "w_grads": [getattr(w, n).grad.numpy().copy() for n in ("w_gate", "w_up", "w_down")],
        "shape": tuple(w.w_gate.shape),
    }


def _one_process(world: int, moe: dict) -> dict:
    block = _block(**moe)
    outs, x_grads = [], []
    for rank in range(world):  # each rank's tokens are one micro-batch: the capacity applies to each alone
        x = _tokens(rank).requires_grad_(True)
        out = block(x)
        out.pow(2).sum().backward()
        outs.append(out.detach())
        x_grads.append(x.grad)
    w = block.experts
    return {"out": outs, "x_grad": x_grads, "w_grads": [getattr(w, n).grad for n in ("w_gate", "w_up", "w_down")]}


def _worst(ranks: list[dict], ref: dict) -> float:
    local = E // len(ranks)
    worst = 0.0
    for r, got in enumerate(ranks):
        worst = max(worst, float((torch.from_numpy(got["out"]) - ref["out"][r]).abs().max()))
        worst = max(worst, float((torch.from_numpy(got["x_grad"]) - ref["x_grad"][r]).abs().max()))
        for g, want in zip(got["w_grads"], ref["w_grads"], strict=True):
            worst = max(worst, float((torch.from_numpy(g) - want[r * local : (r + 1) * local]).abs().max()))
    return worst


@pytest.mark.parametrize(
    "moe", [{"top_k": 2}, {"top_k": 2, "capacity_factor": 0.75}, {"top_k": 1, "num_shared_experts": 1}]
)
def test_experts_sharded_over_two_processes_equal_one_process(moe):
    ref = _one_process(2, moe)
    good = run_distributed(_ep_block_body, 2, args=(moe, False), timeout=120)
    assert [r["shape"] for r in good] == [(E // 2, H, WIDTH)] * 2  # each rank holds half the experts
    assert _worst(good, ref) < TOL
    bad = run_distributed(_ep_block_body, 2, args=(moe, True), timeout=120)
    assert _worst(bad, ref) > 1e-3  # tokens sent to the wrong rank's experts


def test_capacity_drops_tokens_in_the_capacity_test():
    """The capacity case above is a real one: one process drops assignments of this skewed router."""
    block = _block(capacity_factor=0.75, top_k=2)
    x = _tokens(0)
    routing = block.router(x)
    assert int(routing.load.max()) > block.cfg.capacity(x.shape[0])


def test_kc_plan_shows_ep_within_dp_its_groups_and_the_all_to_all_it_needs(tmp_path):
    from kuangchao_core.engine.plan import explain_plan, format_plan, required_primitives
    from tests.engine_helpers import tiny_job

    moe = {"preset": "tiny", "num_layers": 2, "moe": {"num_experts": 4}}
    cfg = tiny_job(str(tmp_path), model=moe, parallel={"data_parallel_size": 4, "expert_parallel_size": 2})
    text = format_plan(explain_plan(cfg))
    assert text.splitlines()[0] == "layout: dp=4 x tp=1 x pp=1 (virtual 1; ep=2 within dp) = 4 processes"
    assert "ep0=[0, 1]  ep1=[2, 3]" in text and "dp_mod_ep0=[0, 2]  dp_mod_ep1=[1, 3]" in text
    assert required_primitives(cfg)["all_to_all"] == "expert_parallel_size 2"
    assert "all_to_all" not in required_primitives(
        tiny_job(str(tmp_path), model=moe, parallel={"data_parallel_size": 4})
    )
