"""Collectives without staging copies, and the hierarchical all-reduce overlapping backward (issue 41, item 4).

ZeRO-3 gathers every unit every micro-batch. Two real Gloo processes train a tiny model in float64 with
:class:`Zero3Optimizer` against one process training the whole batch, and ``comm.staging`` counts every byte the
gathers and reduce-scatters copy through staging buffers:

- under NCCL's rules (``KC_COMM_RULES=nccl``: the stand-in device, the job as it runs on GPUs) each gather writes
  its bytes once — the comm layer copies nothing and the flat op stages nothing (``copies == 1``); the list forms
  of before (:func:`comm.staging.use_flat` off, the negative control) write every gathered byte twice, and the
  reduce-scatter concatenated its input into a copy;
- on Gloo itself the flat ops exist but stage inside torch: every call is counted as a ``gloo`` fallback.

Both train like one process in fp64; the control for that comparison gathers each unit's chunks in the wrong
order through the flat op and is caught.

The hierarchical all-reduce (four processes declared as two nodes): buckets launched one after another are in
flight together — a bucket's buffer still holds its local gradient when its launch returns, and when the next
bucket launches — and their sums equal the flat all-reduce's bitwise (integers in float64). Controls: the blocking
pipeline (``overlap=False``) has every sum done at its launch; a pipeline that skips the cross-node step differs.
"""

from __future__ import annotations

import pytest

from tests.mp import run_distributed
from tests.tolerances import FP64_REL, NEGATIVE_MIN, rel_norm

RULES = {"KC_COMM_RULES": "nccl"}
STEPS, SEQ = 2, 8


def _model(device):
    from kuangchao_core.models.llama import LlamaForCausalLM
    from tests.fixtures import tiny_llama

    m = LlamaForCausalLM(tiny_llama(vocab_size=64, hidden_size=32, intermediate_size=64, max_seq_len=SEQ))
    m.init_weights(3)
    return m.double().to(device)


def _batch(step: int, device):
    import torch

    tokens = torch.randint(0, 64, (4, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _zero3(rank: int, world: int, mode: str) -> dict:
    """Train ZeRO-3 and the one-process reference; ``mode``: ``flat``, ``staged`` (the list forms of before) or
    ``misplaced`` (the flat gather with each unit's chunks in the wrong order)."""
    import contextlib

    import torch

    from kuangchao_core.comm import primitives as P
    from kuangchao_core.comm import staging, world_group
    from kuangchao_core.hal import device_init
    from kuangchao_core.models.llama import causal_lm_loss
    from kuangchao_core.parallel.zero3 import Zero3Optimizer, block_units
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    dev = device_init("cpu").device
    ref, model = _model(dev), _model(dev)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    opt = Zero3Optimizer(model, block_units(model), world_group(), lr=1e-2, weight_decay=0.0)
    opt.trace = []
    real = P._ag_single
    if mode == "misplaced":

        def misplaced(out, src, group=None, async_op=False):
            work = real(out, src, group=group, async_op=False)
            out.copy_(out.view(world, -1).flip(0).reshape(-1))
            return work if not async_op else _Completed()

        P._ag_single = misplaced
    staging.STAGING.reset()
    with staging.use_flat(False) if mode == "staged" else contextlib.nullcontext():
        for step in range(STEPS):
            x, y = _batch(step, dev)
            ref_opt.zero_grad()
            causal_lm_loss(ref(x), y).backward()
            ref_opt.step()
            opt.zero_grad()
            half = slice(rank * 2, rank * 2 + 2)
            causal_lm_loss(model(x[half]), y[half]).backward()
            opt.step()
    counts = staging.STAGING.snapshot()
    copies = {op: staging.STAGING.copies(op) for op in counts}
    P._ag_single = real
    gathers = [i for event, i in opt.trace if event == "gather"]
    gathered = sum(opt.buckets[i].size for i in gathers) * 8
    with opt.full_parameters():
        got = {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()}
    want = {n: p.detach().cpu().numpy().copy() for n, p in ref.named_parameters()}
    return {
        "rules": world_group().rules,
        "gathers": len(gathers),
        "gathered_bytes": gathered,
        "counts": counts,
        "copies": copies,
        "worst": max(rel_norm(got[n], w) for n, w in want.items()),
    }


class _Completed:
    def wait(self) -> None:
        """Done already."""

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def _zero3_runs(rank: int, world: int, modes: list[str]) -> list[dict]:
    return [_zero3(rank, world, m) for m in modes]


@pytest.fixture(scope="module")
def nccl_rules():
    runs = run_distributed(_zero3_runs, 2, args=(["flat", "staged", "misplaced"],), env=RULES, timeout=180)
    return dict(zip(["flat", "staged", "misplaced"], runs[0], strict=True)), runs


@pytest.fixture(scope="module")
def gloo():
    return run_distributed(_zero3_runs, 2, args=(["flat"],), timeout=180)[0][0]


def test_each_zero3_gather_writes_its_bytes_once_under_nccl_rules(nccl_rules):
    runs, _ = nccl_rules
    flat = runs["flat"]
    assert flat["rules"] == "nccl"
    ag = flat["counts"]["all_gather"]
    assert flat["gathers"] >= 2 * STEPS * 4  # every unit, forward and backward, every step
    assert ag["calls"] == flat["gathers"] and ag["payload"] == flat["gathered_bytes"]
    assert ag["copied"] == 0 and ag["backend"] == 0 and ag["fallbacks"] == {}
    assert flat["copies"]["all_gather"] == 1.0
    rs = flat["counts"]["reduce_scatter"]
    assert rs["copied"] == 0 and rs["backend"] == 0 and flat["copies"]["reduce_scatter"] == 1.0


def test_negative_control_the_list_forms_of_before_write_every_gathered_byte_twice(nccl_rules):
    runs, _ = nccl_rules
    staged = runs["staged"]
    ag, rs = staged["counts"]["all_gather"], staged["counts"]["reduce_scatter"]
    assert ag["calls"] == staged["gathers"] and ag["payload"] == staged["gathered_bytes"]
    assert ag["backend"] == ag["payload"] and ag["fallbacks"] == {"staged": ag["calls"]}
    assert staged["copies"]["all_gather"] == 2.0
    assert rs["copied"] == rs["payload"]  # torch.cat of the chunks, counted where it is made
    assert staged["copies"]["reduce_scatter"] == 2.0


def test_zero3_trains_like_one_process_in_fp64_on_the_flat_and_the_staged_path(nccl_rules, gloo):
    runs, per_rank = nccl_rules
    assert max(r["worst"] for r in per_rank[1][:2]) <= FP64_REL
    assert runs["flat"]["worst"] <= FP64_REL and runs["staged"]["worst"] <= FP64_REL
    assert gloo["worst"] <= FP64_REL


def test_negative_control_chunks_gathered_out_of_place_fail_the_comparison(nccl_rules):
    runs, _ = nccl_rules
    assert runs["misplaced"]["worst"] >= NEGATIVE_MIN


def test_on_gloo_the_flat_ops_stage_inside_torch_and_are_counted_as_fallbacks(gloo):
    assert gloo["rules"] == "gloo"
    ag, rs = gloo["counts"]["all_gather"], gloo["counts"]["reduce_scatter"]
    assert ag["calls"] == gloo["gathers"] and ag["copied"] == 0
    assert ag["backend"] == ag["payload"] and ag["fallbacks"] == {"gloo": ag["calls"]}
    assert rs["copied"] == 0 and rs["fallbacks"] == {"gloo": rs["calls"]}
    assert rs["backend"] == rs["payload"] * 3 // 2  # the input cloned, this member's half copied out


# ---------------------------------------------------------------------- the order of a group's ranks
def _reversed_group(rank: int, world: int) -> dict:
    import torch

    from kuangchao_core.comm import CommGroup, staging
    from kuangchao_core.comm import primitives as P
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    g = CommGroup([1, 0], backend="gloo", name="reversed")
    staging.STAGING.reset()
    out = torch.empty(6, dtype=torch.float64)
    P.all_gather_into(out, torch.full((3,), float(rank), dtype=torch.float64), group=g)
    parts = P.all_gather(None, torch.full((2,), float(rank), dtype=torch.float64), group=g)
    mine = torch.empty(2, dtype=torch.float64)
    P.reduce_scatter(mine, torch.arange(4, dtype=torch.float64) * (rank + 1), group=g)
    return {
        "gathered": out.tolist(),
        "parts": [p.tolist() for p in parts],
        "scattered": mine.tolist(),
        "counts": staging.STAGING.snapshot(),
    }


def test_a_group_in_another_rank_order_gathers_in_its_order_through_a_counted_staging_copy():
    results = run_distributed(_reversed_group, 2, timeout=60)
    for rank, r in enumerate(results):
        assert r["gathered"] == [1.0] * 3 + [0.0] * 3  # group order: rank 1 first
        assert r["parts"] == [[1.0, 1.0], [0.0, 0.0]]
        assert r["scattered"] == ([0.0, 3.0] if rank == 1 else [6.0, 9.0])  # member 0 of the group is rank 1
        ag, rs = r["counts"]["all_gather"], r["counts"]["reduce_scatter"]
        assert ag["fallbacks"]["order"] == 2 and ag["copied"] == ag["payload"]
        assert rs["fallbacks"] == {"order": 1} and rs["copied"] == rs["payload"]


# ---------------------------------------------------------------------- the hierarchical all-reduce, pipelined
TWO_NODES = [0, 0, 1, 1]
SIZES = (1001, 64, 333, 7)  # odd sizes: the shards are padded


class _SkipCross:
    """A broken cross-node step: the node's sum is kept as the total."""

    kind = "skip"

    def exchange(self, key, shard, group):
        return shard

    def state_tensors(self):
        return {}


def _pipelined(rank: int, world: int) -> dict:
    import torch

    from kuangchao_core.comm import init_distributed
    from kuangchao_core.comm import primitives as P
    from kuangchao_core.parallel.bucket_reduce import BucketReducer
    from kuangchao_core.parallel.mesh import ParallelMesh
    from kuangchao_core.perm import guard_api

    guard_api.install_guard(guard_api.AllowAll())
    init_distributed(backend="gloo")
    mesh = ParallelMesh({"dp": 4}, rank, world, backend="gloo", node_of_rank=TWO_NODES, hierarchical="on")
    gen = torch.Generator().manual_seed(100 + rank)
    local = [torch.randint(-1000, 1000, (n,), generator=gen).double() for n in SIZES]
    flat = [t.clone() for t in local]
    for t in flat:
        P.all_reduce(t, group=mesh.dp_group)
    out: dict = {}
    for label, overlap, compressor in (("pipelined", True, None), ("blocking", False, None), ("skip", True, 0)):
        reducer = BucketReducer(
            mesh.dp_group, mesh.dp_intra_group, mesh.dp_inter_group, _SkipCross() if compressor == 0 else None
        )
        reducer.pipeline.overlap = overlap
        bufs = [t.clone() for t in local]
        handles, unreduced_at_launch, unreduced_at_next = [], [], []
        for key, buf in enumerate(bufs):
            handles.append(reducer.launch(key, buf))
            unreduced_at_launch.append(bool(torch.equal(buf, local[key])))
            if key:
                unreduced_at_next.append(bool(torch.equal(bufs[key - 1], local[key - 1])))
        for h in handles:
            h.wait()
        out[label] = {
            "equal": [bool(torch.equal(b, f)) for b, f in zip(bufs, flat, strict=True)],
            "unreduced_at_launch": unreduced_at_launch,
            "unreduced_at_next_launch": unreduced_at_next,
            "in_flight_after": len(reducer.pipeline._inflight),
        }
    return out


@pytest.fixture(scope="module")
def pipelined():
    return run_distributed(_pipelined, 4, timeout=120)


def test_pipelined_hierarchical_sums_equal_the_flat_all_reduce_bitwise(pipelined):
    for r in pipelined:
        assert r["pipelined"]["equal"] == [True] * len(SIZES)
        assert r["blocking"]["equal"] == [True] * len(SIZES)
        assert r["pipelined"]["in_flight_after"] == 0


def test_buckets_are_in_flight_together_until_their_wait(pipelined):
    for r in pipelined:
        assert r["pipelined"]["unreduced_at_launch"] == [True] * len(SIZES)
        assert r["pipelined"]["unreduced_at_next_launch"] == [True] * (len(SIZES) - 1)


def test_negative_controls_blocking_sums_are_done_at_launch_and_a_skipped_cross_step_differs(pipelined):
    for r in pipelined:
        assert r["blocking"]["unreduced_at_launch"] == [False] * len(SIZES)
        assert r["skip"]["equal"] == [False] * len(SIZES)
