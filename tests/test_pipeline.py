"""Pipeline parallel equals one process (SPEC L3.3, L3.6): pp2/pp4 1F1B and interleaved 1F1B (v=2) and the
all-forward-all-backward reference, 5 AdamW steps each on real Gloo processes.

One 4-process run serves every layout (two pp2 pipelines run side by side on ranks [0,1] and [2,3]) to keep the
file fast on two cores. Models train in float64 (tolerances derived in tests/tolerances.py); the negative control
with a skipped micro-batch is in tests/test_engine_3d.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.mp import run_distributed
from tests.tolerances import FP64_REL

STEPS = 5
SEQ = 8
MB_SIZE = 2

# name: (pipeline ranks, schedule, virtual, num_layers, micro-batches)
PHASES = [
    {"pp2_1f1b": ([0, 1], "1f1b", 1, 4, 4), "pp2_interleaved": ([2, 3], "interleaved_1f1b", 2, 4, 4)},
    {"pp4_1f1b": ([0, 1, 2, 3], "1f1b", 1, 4, 8)},
    {"pp4_interleaved": ([0, 1, 2, 3], "interleaved_1f1b", 2, 8, 8)},
    {"pp2_afab": ([1, 2], "afab", 1, 4, 3)},
]
LAYOUTS = {name: spec for phase in PHASES for name, spec in phase.items()}


def _cfg(num_layers):
    from tests.fixtures import tiny_llama

    return tiny_llama(vocab_size=64, intermediate_size=96, num_layers=num_layers, max_seq_len=SEQ)


def _batches(m, vocab):
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (m * MB_SIZE, SEQ + 1), generator=gen)
        out.append({"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()})
    return out


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)


def _reference(num_layers, m, accumulate):
    """One process: the whole batch at once, or (``accumulate``) its ``m`` micro-batches with loss / m each."""
    from kuangchao_core.models.llama import LlamaForCausalLM, causal_lm_loss

    model = LlamaForCausalLM(_cfg(num_layers))
    model.init_weights(11)
    model = model.double()
    opt = _optimizer(model.parameters())
    losses = []
    for batch in _batches(m, model.config.vocab_size):
        opt.zero_grad()
        if accumulate:
            total = 0.0
            for i in range(m):
                sl = slice(i * MB_SIZE, (i + 1) * MB_SIZE)
                loss = causal_lm_loss(model(batch["input_ids"][sl]), batch["labels"][sl]) / m
                loss.backward()
                total += loss.item()
            losses.append(total)
        else:
            loss = causal_lm_loss(model(batch["input_ids"]), batch["labels"])
            loss.backward()
            losses.append(loss.item())
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(group, schedule, virtual, num_layers, m):
    from kuangchao_core.models.llama import LlamaForCausalLM, causal_lm_loss
    from kuangchao_core.parallel.pipeline import PipelineExecutor, build_stage_chunks, stage_parameters

    model = LlamaForCausalLM(_cfg(num_layers))
    model.init_weights(11)
    model = model.double()
    chunks = build_stage_chunks(model, group.size, group.rank, virtual)
    params = stage_parameters(chunks)
    opt = _optimizer(list(params.values()))
    ex = PipelineExecutor(
        group, chunks, causal_lm_loss, model.config.hidden_size, schedule=schedule, dtype=torch.float64
    )
    from kuangchao_core.comm import COMM_STATS

    losses = []
    COMM_STATS.reset()
    for batch in _batches(m, model.config.vocab_size):
        opt.zero_grad()
        mbs = [{k: t[i * MB_SIZE : (i + 1) * MB_SIZE] for k, t in batch.items()} for i in range(m)]
        loss = ex.run(mbs)
        opt.step()
        losses.append(None if loss is None else loss.item())
    return {
        "losses": losses,
        "p2p_counts": {k: v for k, v in COMM_STATS.counts_by_op().items() if k in ("send", "recv")},
        "params": {n: p.detach().numpy().copy() for n, p in params.items()},
        "trace": [str(e.action) for e in ex.trace],
        "times": [(e.t0, e.t1) for e in ex.trace],
        "keys": [_key(e.action, group.size, group.rank) for e in ex.trace],
        "definition": [str(a) for a in ex.actions(m)],
    }


def _key(action, p, pp_rank):
    from kuangchao_core.parallel.pp_schedules import COMPUTE, message_key

    return None if action.kind in COMPUTE else message_key(action, p, pp_rank)


def _body(rank, world_size):
    from kuangchao_core.comm import CommGroup, init_distributed
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    install_guard(AllowAll())
    init_distributed("gloo")
    out = {}
    for phase in PHASES:
        groups = {name: CommGroup(spec[0], backend="gloo", name=name) for name, spec in phase.items()}
        for name, (ranks, schedule, virtual, num_layers, m) in phase.items():
            if rank in ranks:
                out[name] = _train(groups[name], schedule, virtual, num_layers, m)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_body, 4)


def _rel(a, b) -> float:
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_equals_one_process(runs, layout):
    ranks, _, _, num_layers, m = LAYOUTS[layout]
    results = [runs[r][layout] for r in ranks]
    assert all(x is None for r in results[:-1] for x in r["losses"]), "only the last stage reports the loss"
    gathered = {}
    for r in results:
        assert not set(r["params"]) & set(gathered), "a parameter is owned by two stages"
        gathered.update({n: torch.from_numpy(a) for n, a in r["params"].items()})
    whole_losses, whole_params = _reference(num_layers, m, accumulate=False)
    acc_losses, acc_params = _reference(num_layers, m, accumulate=True)
    assert set(gathered) == set(whole_params), "the stages together must hold every parameter"
    for step, (got, whole, acc) in enumerate(zip(results[-1]["losses"], whole_losses, acc_losses, strict=True)):
        assert abs(got - whole) <= FP64_REL * abs(whole), f"{layout} step {step}: loss {got} vs whole batch {whole}"
        assert abs(got - acc) <= FP64_REL * abs(acc), f"{layout} step {step}: loss {got} vs accumulated {acc}"
    for name in whole_params:
        # the same micro-batches accumulated in one process, and the whole batch at once (another summation order)
        err = _rel(gathered[name], acc_params[name])
        assert err <= FP64_REL, f"{layout} {name}: relative error {err:.2e} vs one process accumulating micro-batches"
        err = _rel(gathered[name], whole_params[name])
        assert err <= FP64_REL, f"{layout} {name}: relative error {err:.2e} vs one process on the whole batch"
    from kuangchao_core.models.llama import LlamaForCausalLM

    init = LlamaForCausalLM(_cfg(num_layers))
    init.init_weights(11)
    moved = (init.model.layers[0].mlp.up_proj.weight - whole_params["model.layers.0.mlp.up_proj.weight"]).abs().max()
    assert moved > 1e-2, "training must move the parameters for the comparison to mean anything"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_executed_order_is_the_schedule(runs, layout):
    ranks = LAYOUTS[layout][0]
    for r in ranks:
        res = runs[r][layout]
        assert res["trace"] == res["definition"], f"{layout} rank {r}: executed order differs from the schedule"
        # every transfer went through the comm layer's dispatch (guarded, timed, counted), one per schedule action
        want = {
            k: STEPS * sum(a.startswith(p) for a in res["definition"]) for k, p in (("send", "SEND"), ("recv", "RECV"))
        }
        assert res["p2p_counts"] == {k: v for k, v in want.items() if v}, (layout, r, res["p2p_counts"])


@pytest.mark.parametrize("layout", ["pp4_1f1b", "pp4_interleaved"])
def test_every_receive_ends_after_its_send_starts(runs, layout):
    """The traffic really flowed: perf_counter is one monotonic clock for all processes of the machine."""
    ranks = LAYOUTS[layout][0]
    sends, recvs = {}, {}
    for r in ranks:
        res = runs[r][layout]
        for name, key, (t0, t1) in zip(res["trace"], res["keys"], res["times"], strict=True):
            if key is not None:
                (sends if name.startswith("SEND") else recvs)[key] = (t0, t1)
    assert sends.keys() == recvs.keys() and sends
    late = [k for k in sends if recvs[k][1] < sends[k][0]]
    assert not late, f"receives finished before their sends started: {late[:3]}"
