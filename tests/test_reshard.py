"""Checkpoints across layouts: slice assembly, per-rank slice reads, ZeRO ranges, gaps/overlaps, `kc checkpoint convert`."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kuangchao.cli.main import app
from kuangchao_core.axes import MeshAxes
from kuangchao_core.ckpt.index import (
    load_for_layout,
    load_full_tensors,
    load_optimizer_for_layout,
    param_keys,
)
from kuangchao_core.ckpt.integrity import verify_checkpoint
from kuangchao_core.ckpt.reader import load_shard, read_manifest
from kuangchao_core.ckpt.writer import CheckpointWriter
from kuangchao_core.errors import CheckpointCorrupt
from kuangchao_core.models.layout import Region, TargetLayout
from kuangchao_core.models.llama import LlamaForCausalLM
from kuangchao_core.models.tp_llama import tp_shard_slices
from kuangchao_core.perm.guard_api import AllowAll, install_guard
from tests.fixtures import tiny_llama

CFG = tiny_llama(vocab_size=64, hidden_size=32, intermediate_size=48)


@pytest.fixture(autouse=True)
def allow_all():
    previous = install_guard(AllowAll())
    yield
    install_guard(previous)


@pytest.fixture(scope="module")
def trained():
    """A tiny model after two AdamW steps: full params and full optimizer state by checkpoint key."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    ids = torch.randint(0, CFG.vocab_size, (2, 8))
    for _ in range(2):
        model(ids).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    params = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    optim = {}
    for n, p in model.named_parameters():
        for k, v in opt.state[p].items():
            optim[f"optim.{n}.{k}"] = v.detach().clone()
    return model, params, optim, ids


def _write(root: Path, params, optim, dp=1, tp=1, pp=1, zero=False, drop=(), extra=None) -> Path:
    """Write a checkpoint as a dp x tp x pp job would: one thread per rank through the writer's protocol.

    Each rank holds the TP slice of the parameters of its pipeline stage (ownership from TargetLayout), the
    optimizer state cut the same way, or with ``zero`` (tp=pp=1) flat 1-D ranges split over the DP ranks.
    ``drop``: (rank, key) pairs left out (to make gaps); ``extra``: rank -> {key: (tensor, slice meta)}.
    """
    world = dp * tp * pp
    barrier = threading.Barrier(world, timeout=60)
    errors = []

    def run(rank):
        try:
            at = MeshAxes(dp=dp, tp=tp, pp=pp).coords_of(rank)
            dp_rank, tp_rank, pp_rank = at["dp"], at["tp"], at["pp"]
            owns = TargetLayout(tp, pp, tp_rank, pp_rank).owns(CFG)
            split = tp_shard_slices(CFG, tp, tp_rank)
            tensors, slices = {}, {}
            for key, full in {**params, **optim}.items():
                name = key.split(".", 1)[1]
                if key.startswith("optim."):
                    name = name.rsplit(".", 1)[0]
                if not owns(name) or (rank, key) in drop:
                    continue
                if zero and key.startswith("optim.") and full.dim():
                    flat = full.reshape(-1)
                    per = -(-flat.numel() // dp)
                    lo, hi = dp_rank * per, min(flat.numel(), (dp_rank + 1) * per)
                    tensors[key] = flat[lo:hi].clone()
                    slices[key] = {"full_shape": [flat.numel()], "offsets": [lo]}
                    continue
                s = split.get(name) if full.dim() else None
                if s is None:
                    tensors[key] = full.clone()
                else:
                    dim, start, length = s
                    tensors[key] = full.narrow(dim, start, length).clone()
                    slices[key] = Region.split(full.shape, dim, start, length).to_meta()
            for key, (t, meta) in (extra or {}).get(rank, {}).items():
                tensors[key], slices[key] = t, meta
            w = CheckpointWriter(root, "job", rank, world, barrier.wait, attempt_id="t")
            w.save(
                5,
                tensors,
                {"rank": rank},
                state={"sampler": {}},
                meta={"model_shape": vars(CFG), "parallel": {}},
                slices=slices,
            )
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return root / "job" / "step_00000005"


def _assert_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


def test_dp2_tp2_assembles_to_full(tmp_path, trained):
    _, params, optim, _ = trained
    step = _write(tmp_path, params, optim, dp=2, tp=2)
    assert read_manifest(step)["world_size"] == 4
    _assert_equal(load_full_tensors(step), {**params, **optim})


def test_tp2_checkpoint_read_for_pp2_tp2_ranks(tmp_path, trained):
    _, params, optim, _ = trained
    step = _write(tmp_path, params, optim, tp=2)
    for pp_rank in range(2):
        for tp_rank in range(2):
            slices = TargetLayout(tp=2, pp=2, tp_rank=tp_rank, pp_rank=pp_rank).param_slices(CFG)
            names = set(slices)
            assert ("model.embed_tokens.weight" in names) == (pp_rank == 0)
            assert ("lm_head.weight" in names) == (pp_rank == 1)
            assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {str(pp_rank)}
            got = load_for_layout(step, param_keys(slices))
            split = tp_shard_slices(CFG, 2, tp_rank)
            for name in names:
                full = params[f"param.{name}"]
                want = full if split[name] is None else full.narrow(*split[name])
                assert torch.equal(got[f"param.{name}"], want), name
            opt = load_optimizer_for_layout(step, slices)
            q = f"model.layers.{pp_rank}.self_attn.q_proj.weight"
            assert torch.equal(opt[f"optim.{q}.exp_avg"], optim[f"optim.{q}.exp_avg"].narrow(*split[q]))
            assert torch.equal(opt[f"optim.{q}.step"], optim[f"optim.{q}.step"])


def test_zero_ranges_to_full_and_to_tp_slices(tmp_path, trained):
    _, params, optim, _ = trained
    step = _write(tmp_path, params, optim, dp=2, zero=True)
    shard1 = load_shard(step, 1)
    key = "optim.model.layers.0.mlp.down_proj.weight.exp_avg"
    assert shard1[key].dim() == 1 and shard1[key].numel() < optim[key].numel()
    _assert_equal(load_full_tensors(step), {**params, **optim})
    # a row-parallel (dim 1) slice of flat ranges
    region = Region.split(optim[key].shape, 1, 24, 24)
    got = load_for_layout(step, {key: region})[key]
    assert torch.equal(got, optim[key][:, 24:48])


def test_gap_and_overlap_are_reported(tmp_path, trained):
    _, params, optim, _ = trained
    q = "param.model.layers.1.self_attn.q_proj.weight"
    step = _write(tmp_path / "gap", params, optim, tp=2, drop={(1, q)})
    with pytest.raises(CheckpointCorrupt, match=r"q_proj.weight: region \[16:32, 0:32\] of \[32, 32\] is held by no"):
        load_full_tensors(step)
    o = "param.model.layers.0.self_attn.o_proj.weight"
    bad = params[o][:, 8:24].clone()
    step = _write(
        tmp_path / "overlap",
        params,
        optim,
        tp=2,
        drop={(1, o)},
        extra={1: {o: (bad, Region.split(params[o].shape, 1, 8, 16).to_meta())}},
    )
    with pytest.raises(CheckpointCorrupt, match=r"o_proj.weight: region \[0:32, 8:16\] of \[32, 32\] is held by 2"):
        load_full_tensors(step)


def test_convert_cli_to_tp1_and_pp2(tmp_path, trained):
    model, params, optim, ids = trained
    src = _write(tmp_path / "src", params, optim, dp=2, tp=2)
    runner = CliRunner()
    res = runner.invoke(app, ["checkpoint", "convert", str(src), str(tmp_path / "tp1"), "--parallel", "tp=1,pp=1"])
    assert res.exit_code == 0, res.output
    out = tmp_path / "tp1" / "step_00000005"
    assert verify_checkpoint(out) == []
    man = read_manifest(out)
    assert man["world_size"] == 1 and man["parallel"]["tensor_parallel_size"] == 1
    shard = load_shard(out, 0)
    _assert_equal(shard, {**params, **optim})
    fresh = LlamaForCausalLM(CFG)
    fresh.load_state_dict({k.removeprefix("param."): v for k, v in shard.items() if k.startswith("param.")})
    assert torch.equal(fresh(ids), model(ids))

    res = runner.invoke(app, ["checkpoint", "convert", str(src), str(tmp_path / "pp2"), "--parallel", "pp=2,dp=1"])
    assert res.exit_code == 0, res.output
    out = tmp_path / "pp2" / "step_00000005"
    assert read_manifest(out)["world_size"] == 2
    r0, r1 = load_shard(out, 0), load_shard(out, 1)
    assert "param.model.embed_tokens.weight" in r0 and "param.lm_head.weight" not in r0
    assert "param.lm_head.weight" in r1 and "param.model.layers.0.mlp.up_proj.weight" not in r1
    _assert_equal(load_full_tensors(out), {**params, **optim})


def test_convert_cli_refuses_bad_arguments(tmp_path, trained):
    _, params, optim, _ = trained
    src = _write(tmp_path / "src", params, optim)
    runner = CliRunner()
    res = runner.invoke(app, ["checkpoint", "convert", str(src), str(tmp_path / "o"), "--parallel", "tp=x"])
    assert res.exit_code == 2 and "not an integer" in res.output
    res = runner.invoke(app, ["checkpoint", "convert", str(src), str(tmp_path / "o"), "--parallel", "tp=3"])
    assert res.exit_code == 2 and "num_heads 4 is not divisible by tensor_parallel_size 3" in res.output
    res = runner.invoke(app, ["checkpoint", "convert", str(tmp_path), str(tmp_path / "o")])
    assert res.exit_code == 2 and "not a step directory" in res.output
