"""ZeRO stage 1/2 (SPEC L3.5): equal to one process, really sharded, clipping, and optimizer-state resharding.

Each distributed case runs real Gloo processes. Every rank also trains the one-process reference (plain
``torch.optim.AdamW``, ``foreach=False``, ``clip_grad_norm_``) on the whole global batch, which the test compares to.
Models train in float64 so that the comparisons measure the sharding and not the CPU's fp32 kernels (tolerances in
tests/tolerances.py); the negative control with an unreduced bucket is in tests/test_engine_3d.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.mp import run_distributed
from tests.tolerances import FP64_REL

STEPS = 6
RESHARD_AT = 3  # optimizer steps done before the optimizer state is re-laid-out
MICRO_BATCH = 2
SEQ = 16
LR = 1e-2
WD = 0.1
MAX_NORM = 0.5
BUCKET_MB = 0.05  # ~6.5k fp64 elements: several buckets for the tiny model
ITEM = 8  # bytes per fp64 element


def _config():
    from tests.fixtures import tiny_llama

    return tiny_llama(max_seq_len=SEQ)


def _model(seed: int):
    from kuangchao_core.models.llama import LlamaForCausalLM

    torch.manual_seed(seed)
    m = LlamaForCausalLM(_config())
    m.init_weights(seed)
    return m.double()


def _batch(step: int, size: int):
    gen = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, _config().vocab_size, (size, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model, x, y):
    from kuangchao_core.models.llama import causal_lm_loss

    return causal_lm_loss(model(x), y)


def _np(tensors):
    return {k: v.detach().numpy().copy() for k, v in tensors.items()}


def _reference(global_size: int):
    """One process, whole global batch: losses, clip norms, params and the AdamW state at RESHARD_AT and the end."""
    from kuangchao_core.parallel.optim_state import flatten_optimizer_state

    model = _model(7)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    named = dict(model.named_parameters())
    out = {"losses": [], "norms": []}
    for step in range(STEPS):
        x, y = _batch(step, global_size)
        loss = _loss(model, x, y)
        loss.backward()
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        out["losses"].append(float(loss.detach()))
        if step + 1 == RESHARD_AT:
            out["mid_params"] = {n: p.detach().clone() for n, p in named.items()}
            tensors, meta = flatten_optimizer_state(opt, named)  # views of the live state: copy them
            out["mid_state"] = ({k: v.clone() for k, v in tensors.items()}, meta)
    out["params"] = _np(named)
    out["state"] = _np(flatten_optimizer_state(opt, named)[0])
    return out


def _train_step(model, opt, step, rank, world_size, accum, record=None):
    """One optimizer step of ``opt`` on this rank's part of the global batch; returns the (global-mean) loss."""
    from kuangchao_core.comm import all_reduce

    x, y = _batch(step, MICRO_BATCH * accum * world_size)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(accum):
        lo = (rank * accum + i) * MICRO_BATCH
        xb, yb = x[lo : lo + MICRO_BATCH], y[lo : lo + MICRO_BATCH]
        rs_before = opt.group.ops.get("reduce_scatter", 0)
        if i < accum - 1:
            with opt.no_sync():
                loss = _loss(model, xb, yb) / accum
                loss.backward()
            if record is not None:
                record["no_sync_reduce_scatters"].append(opt.group.ops.get("reduce_scatter", 0) - rs_before)
        else:
            loss = _loss(model, xb, yb) / accum
            loss.backward()
            if record is not None:  # stage 2 reduces during backward, stage 1 only afterwards
                record["in_backward_reduce_scatters"].append(opt.group.ops.get("reduce_scatter", 0) - rs_before)
        total += loss.detach()
    norm = opt.clip_grad_norm(MAX_NORM)
    if record is not None:
        record["norms"].append(float(norm))
        record["mem_after_sync"].append(opt.memory_report())
        record["param_grads_alive"].append(sum(p.grad is not None for p in model.parameters()))
    opt.step()
    opt.zero_grad()
    all_reduce(total, group=opt.group, op="sum")
    return float(total) / world_size


def _zero_body(rank, world_size, stage, accum):
    import torch.distributed as dist

    from kuangchao_core.comm import CommGroup
    from kuangchao_core.parallel.zero import ZeroOptimizer
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    install_guard(AllowAll())
    group = CommGroup(list(range(world_size)), backend="gloo", name="dp")
    ref = _reference(MICRO_BATCH * accum * world_size)

    # Rank 1 starts from other weights: the optimizer's broadcast must make the replicas equal to rank 0's.
    model = _model(7 if rank == 0 else 99)
    opt = ZeroOptimizer(model.named_parameters(), group, stage=stage, lr=LR, weight_decay=WD, bucket_cap_mb=BUCKET_MB)
    rec = {k: [] for k in ("norms", "mem_after_sync", "param_grads_alive", "no_sync_reduce_scatters")}
    rec["in_backward_reduce_scatters"] = []
    losses = []
    resumed = {}
    for step in range(STEPS):
        losses.append(_train_step(model, opt, step, rank, world_size, accum, rec))
        for m, o in resumed.values():
            _train_step(m, o, step, rank, world_size, accum)
        if step + 1 == RESHARD_AT:
            tensors, slices, meta = opt.state_dict_for_checkpoint()
            rec["shard"] = (_np(tensors), slices, meta)
            shards = [None] * world_size
            dist.all_gather_object(shards, (tensors, slices, meta))
            full_t, full_m = opt.full_state_dict()
            rec["mid_full"] = (_np(full_t), full_m)
            # sharded -> differently sharded: other stage, other bucket size
            m_b = _model(7)
            m_b.load_state_dict(model.state_dict())
            o_b = ZeroOptimizer(
                m_b.named_parameters(), group, stage=3 - stage, lr=LR, weight_decay=WD, bucket_cap_mb=0.02
            )
            o_b.load_sharded_states(shards)
            rec["resharded_full"] = _np(o_b.full_state_dict()[0])
            # full (a plain one-process AdamW's state) -> sharded
            m_c = _model(7)
            m_c.load_state_dict(ref["mid_params"])
            o_c = ZeroOptimizer(m_c.named_parameters(), group, stage=stage, lr=LR, weight_decay=WD, bucket_cap_mb=1)
            o_c.load_full_state(*ref["mid_state"])
            resumed = {"resharded": (m_b, o_b), "from_plain": (m_c, o_c)}
    final_full = _np(opt.full_state_dict()[0])
    return {
        "ref": {k: ref[k] for k in ("losses", "norms", "params", "state")},
        "losses": losses,
        "params": _np(dict(model.named_parameters())),
        "resumed_params": {k: _np(dict(m.named_parameters())) for k, (m, _) in resumed.items()},
        "final_full": final_full,
        "rec": rec,
        "layout": {"numel": opt.numel, "padded": opt.padded_numel, "buckets": len(opt.buckets)},
    }


@pytest.fixture(scope="module", params=[(1, 1), (2, 1), (2, 2)], ids=["zero1", "zero2", "zero2_accum2"])
def run(request):
    stage, accum = request.param
    return stage, accum, run_distributed(_zero_body, 2, args=(stage, accum), timeout=240)


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(np.asarray(b)), 1e-30))


def _close(a, b, rtol=FP64_REL, what=""):
    """Per-tensor relative error (norm of the difference over the norm), as the data-parallel tests use.

    Element-wise comparison is too strict for AdamW: where |grad| is near ``eps`` the update lr*m/(sqrt(v)+eps)
    turns last-bit differences of the reduction order into visible ones on a few elements."""
    err = _rel(a, b)
    assert err <= rtol, f"{what}: relative error {err:.2e} > {rtol:.0e}"


def test_matches_one_process(run):
    stage, accum, results = run
    ref = results[0]["ref"]
    for r in results:
        assert len(r["losses"]) == STEPS
        for got, want in zip(r["losses"], ref["losses"], strict=True):
            assert abs(got - want) <= FP64_REL * abs(want), (r["losses"], ref["losses"])
        for name, want in ref["params"].items():
            _close(r["params"][name], want, what=name)
    # the two replicas hold identical parameters after the all-gather
    for name in ref["params"]:
        np.testing.assert_array_equal(results[0]["params"][name], results[1]["params"][name])
    # the final AdamW state, gathered from the shards, equals the plain optimizer's
    for key, want in ref["state"].items():
        _close(results[0]["final_full"][key], want, what=key)


def test_clipping_matches_torch(run):
    _, _, results = run
    ref_norms = results[0]["ref"]["norms"]
    assert any(n > MAX_NORM for n in ref_norms), f"clipping never active: {ref_norms}"
    for r in results:
        np.testing.assert_allclose(r["rec"]["norms"], ref_norms, rtol=FP64_REL)


def test_state_and_gradients_sharded(run):
    stage, accum, results = run
    n = 2
    layout = results[0]["layout"]
    numel, padded = layout["numel"], layout["padded"]
    assert layout["buckets"] > 1
    assert padded - numel < n * layout["buckets"]
    for r in results:
        mem = r["rec"]["mem_after_sync"][-1]
        assert mem["optimizer_state_elements"] == 2 * padded // n
        assert mem["measured"]["optimizer_state"] == 2 * ITEM * padded // n
        assert abs(mem["measured"]["optimizer_state"] - mem["formula"]["optimizer_state"]) <= 2 * ITEM * (
            padded - numel
        )
        assert mem["measured"]["params"] == ITEM * padded
        if stage == 2:
            assert mem["measured"]["grads"] == ITEM * padded // n
            assert abs(mem["measured"]["grads"] - mem["formula"]["grads"]) <= ITEM * (padded - numel)
            assert all(alive == 0 for alive in r["rec"]["param_grads_alive"])
            assert 0 < mem["peak_transient_grad_bytes"] < ITEM * numel
            # every bucket was reduce-scattered during the last backward, none inside no_sync
            assert all(c == layout["buckets"] for c in r["rec"]["in_backward_reduce_scatters"])
        else:
            assert mem["measured"]["grads"] == ITEM * padded
            assert all(c == 0 for c in r["rec"]["in_backward_reduce_scatters"])
        assert all(c == 0 for c in r["rec"]["no_sync_reduce_scatters"])
        assert len(r["rec"]["no_sync_reduce_scatters"]) == STEPS * (accum - 1)
    print(f"\nZeRO-{stage} accum={accum} memory per rank (bytes):", results[0]["rec"]["mem_after_sync"][-1])


def test_checkpoint_shards_disjoint_and_cover(run):
    _, _, results = run
    from kuangchao_core.parallel.zero_state import merge_shards_to_full

    shards = [r["rec"]["shard"] for r in results]
    covered: dict[str, np.ndarray] = {}
    for tensors, slices, meta in shards:
        assert meta["dp_size"] == 2
        for key, sl in slices.items():
            if not key.endswith(".exp_avg"):
                continue
            full = sl["full_shape"][0]
            mask = covered.setdefault(key, np.zeros(full, dtype=int))
            mask[sl["offsets"][0] : sl["offsets"][0] + sl["shape"][0]] += 1
            assert tensors[key].shape == tuple(sl["shape"])
    assert all((m == 1).all() for m in covered.values())  # every element held by exactly one rank
    from kuangchao_core.ckpt.writer import normalize_slice

    for tensors, slices, _ in shards:  # the checkpoint writer accepts the slice metadata as given
        for key, t in tensors.items():
            assert normalize_slice(key, torch.from_numpy(t), slices[key]) == slices[key]
    merged, meta = merge_shards_to_full([({k: torch.from_numpy(v) for k, v in t.items()}, s, m) for t, s, m in shards])
    mid_full, _ = results[0]["rec"]["mid_full"]
    assert set(merged) == set(mid_full)
    for key, want in mid_full.items():
        np.testing.assert_array_equal(merged[key].numpy(), want)


def test_reshard_round_trips(run):
    _, _, results = run
    mid_full, full_meta = results[0]["rec"]["mid_full"]
    # the gathered (full) state loads into a plain torch AdamW
    from kuangchao_core.parallel.optim_state import load_optimizer_state

    model = _model(7)
    plain = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    load_optimizer_state(
        plain, dict(model.named_parameters()), {k: torch.from_numpy(v) for k, v in mid_full.items()}, full_meta
    )
    assert float(plain.state[model.lm_head.weight]["step"]) == RESHARD_AT
    # sharded -> other stage / bucket layout -> gathered: unchanged
    for key, want in mid_full.items():
        np.testing.assert_array_equal(results[0]["rec"]["resharded_full"][key], want)
    # training continued from either re-laid-out state ends at the reference parameters
    ref = results[0]["ref"]["params"]
    for r in results:
        for variant in ("resharded", "from_plain"):
            for name, want in ref.items():
                _close(r["resumed_params"][variant][name], want, what=f"{variant} {name}")
        for name in ref:  # only the clip norm's summation order differs between the layouts
            _close(r["resumed_params"]["resharded"][name], r["params"][name], what=name)


class _Odd(torch.nn.Module):
    """Odd element counts, so every bucket needs padding to a multiple of the DP size."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(7, 5)
        self.b = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _odd_body(rank, world_size):
    from kuangchao_core.comm import CommGroup
    from kuangchao_core.parallel.zero import ZeroOptimizer
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    install_guard(AllowAll())
    group = CommGroup(list(range(world_size)), backend="gloo", name="dp")
    torch.manual_seed(3)
    ref, model = _Odd().double(), _Odd().double()
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
    opt = ZeroOptimizer(
        list(model.parameters()), group, stage=2, lr=LR, weight_decay=WD, bucket_cap_mb=40 * ITEM / 2**20
    )
    gen = torch.Generator().manual_seed(11)
    for _ in range(5):
        x, y = torch.randn(8, 7, generator=gen).double(), torch.randn(8, 3, generator=gen).double()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
        ref_opt.zero_grad()
        half = slice(rank * 4, rank * 4 + 4)
        torch.nn.functional.mse_loss(model(x[half]), y[half]).backward()
        opt.clip_grad_norm(0.1)
        opt.step()
        opt.zero_grad()
    return {
        "err": max(
            _rel(p.detach().numpy(), q.detach().numpy())
            for p, q in zip(model.parameters(), ref.parameters(), strict=True)
        ),
        "numel": opt.numel,
        "padded": opt.padded_numel,
        "buckets": len(opt.buckets),
        "state_elements": opt.memory_report()["optimizer_state_elements"],
        "names": opt.parameter_names(),
    }


def test_padding_and_plain_parameter_list():
    results = run_distributed(_odd_body, 2, timeout=120)
    for r in results:
        assert r["err"] <= FP64_REL, r
        assert r["numel"] == 7 * 5 + 5 + 5 * 3 + 3
        assert r["buckets"] > 1 and r["padded"] > r["numel"]  # padded buckets really exercised
        assert r["state_elements"] == r["padded"]  # exp_avg + exp_avg_sq of half the padded buffer each
        assert r["names"] == [f"param_{i}" for i in range(4)]
