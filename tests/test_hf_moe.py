"""transformers' Mixtral in and out of Kuangchao's MoE Llama (issue 40 item 4), pinned against transformers itself:
the import (``ckpt/hf_moe.py``, ``models/hf_moe_config.py``) and ``kc checkpoint convert --format hf`` of a MoE
checkpoint. Logits are compared in float64 on both sides within ``HF_REL`` (tests/tolerances.py; Mixtral's router
also takes its softmax in fp32, ≲ 1e-7 relative on a gate weight, far inside it). Controls: two experts swapped,
gate and up projections swapped, the top-k weights left unnormalised, a sigmoid router, each must break the match."""

from __future__ import annotations

import dataclasses
import json
import threading
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from kuangchao.cli.main import app
from kuangchao_core.ckpt.hf import load_hf_weights_for_layout
from kuangchao_core.ckpt.writer import CheckpointWriter
from kuangchao_core.engine.expert_parallel import place_experts
from kuangchao_core.errors import CheckpointError, ConfigError
from kuangchao_core.models import moe as moe_module
from kuangchao_core.models.layout import TargetLayout
from kuangchao_core.models.llama import LlamaForCausalLM, config_from_model_section, load_hf_llama_config
from kuangchao_core.perm.guard_api import AllowAll, install_guard
from tests.tolerances import assert_logits_match

transformers = pytest.importorskip("transformers")

SIZES = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},  # not the default: a lost theta shows
}


@pytest.fixture(autouse=True)
def allow_all():
    previous = install_guard(AllowAll())
    yield
    install_guard(previous)


def mixtral(seed: int = 1, scale: float = 1.0, **changes):
    """A tiny random ``MixtralForCausalLM`` (eager attention and experts: they run in float64), its projections
    and embeddings times ``scale``."""
    torch.manual_seed(seed)
    hf_cfg = transformers.MixtralConfig(
        **{**SIZES, **changes}, attn_implementation="eager", experts_implementation="eager"
    )
    model = transformers.MixtralForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():  # norms start at 1 and routers near 0: random, so a mix-up shows and routing varies
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
            else:
                p.mul_(scale)
    return model


def _ids(cfg):
    return torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))


def _imported(tmp_path, hf):
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = load_hf_llama_config(tmp_path)
    ours = LlamaForCausalLM(cfg).eval()
    ours.load_state_dict(load_hf_weights_for_layout(tmp_path, cfg), strict=True)
    return cfg, ours


def test_mixtral_directory_loads_into_the_moe_llama(tmp_path):
    hf = mixtral()
    cfg, ours = _imported(tmp_path, hf)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.router, cfg.moe.moe_layers(2)) == (4, 2, "softmax", [0, 1])
    assert cfg.moe.width(cfg.intermediate_size) == 24 and cfg.moe.capacity_factor is None  # dropless, as Mixtral
    assert cfg.rope_theta == 5000.0
    assert cfg.moe.aux_loss_coef == pytest.approx(0.001 * 2)  # transformers' loss sums over the top_k choices
    ids = _ids(cfg)
    with torch.no_grad():
        want = hf.double()(ids).logits
        assert_logits_match(ours.double()(ids), want)
        chosen = {int(e) for b in ours.model.layers for e in b.mlp.load.nonzero()}
    assert chosen == {0, 1, 2, 3}  # every expert took tokens: a mapped-wrong expert could not hide


def _swap_experts(model):
    block = model.model.layers[0].mlp.experts
    for w in (block.w_gate, block.w_up, block.w_down):
        w.data[[0, 1]] = w.data[[1, 0]]


def _swap_gate_up(model):
    block = model.model.layers[1].mlp.experts
    block.w_gate.data, block.w_up.data = block.w_up.data.clone(), block.w_gate.data.clone()


def _unnormalised(monkeypatch):
    forward = moe_module.Router.forward

    def without_renormalising(self, x):
        routing = forward(self, x)
        routing.weights = routing.scores.gather(1, routing.index)  # the top-k probabilities as they are
        return routing

    monkeypatch.setattr(moe_module.Router, "forward", without_renormalising)


@pytest.mark.parametrize("sabotage", ["swap_experts", "swap_gate_up", "unnormalised", "sigmoid_router"])
def test_each_mapping_mistake_breaks_the_match(tmp_path, monkeypatch, sabotage):
    hf = mixtral()
    cfg, ours = _imported(tmp_path, hf)
    if sabotage == "swap_experts":
        _swap_experts(ours)
    elif sabotage == "swap_gate_up":
        _swap_gate_up(ours)
    elif sabotage == "unnormalised":
        _unnormalised(monkeypatch)
    else:
        state = ours.state_dict()
        ours = LlamaForCausalLM(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, router="sigmoid"))).eval()
        ours.load_state_dict(state)
    ids = _ids(cfg)
    with torch.no_grad(), pytest.raises(AssertionError, match="logits differ"):
        assert_logits_match(ours.double()(ids), hf.double()(ids).logits)


def _ep_regions(cfg, ep: int, ep_rank: int):
    """The regions the engine gives an ep rank (``engine.expert_parallel.place_experts`` on a model of ``cfg``)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    regions = TargetLayout().param_slices(cfg)
    placement = SimpleNamespace(params={n: {} for n in regions})  # the part of the record place_experts writes
    mesh = SimpleNamespace(ep=ep, ep_group=SimpleNamespace(size=ep, rank=ep_rank))
    place_experts(model, regions, placement, mesh)
    return regions


@pytest.mark.parametrize(("world", "ep"), [(1, 1), (2, 2), (4, 2)])
def test_every_moe_layout_reads_its_slice_of_the_mixtral(tmp_path, world, ep):
    """One process, ep2 (world 2) and ep2 × dp2 (world 4: a rank's ep index is its dp index mod 2): each rank reads
    exactly its experts (and every other parameter whole); the ranks of one ep group together hold all of them."""
    cfg, ours = _imported(tmp_path, mixtral())
    full = ours.state_dict()
    held: dict[str, set[int]] = {}
    for rank in range(world):
        regions = _ep_regions(cfg, ep, rank % ep)
        got = load_hf_weights_for_layout(tmp_path, cfg, regions=regions)
        assert set(got) == set(full)
        for name, value in got.items():
            region = regions[name]
            cut = tuple(slice(o, o + s) for o, s in zip(region.offsets, region.shape, strict=True))
            assert torch.equal(value, full[name][cut]), name
            if ".experts.w_" in name:
                assert value.shape[0] == 4 // ep
                held.setdefault(name, set()).update(range(region.offsets[0], region.offsets[0] + region.shape[0]))
    assert all(experts == {0, 1, 2, 3} for experts in held.values()) and len(held) == 6


def _write_ep2(root, cfg, params):
    """``params`` written as an ep2 checkpoint: each rank its half of the experts, both the rest."""
    barrier = threading.Barrier(2, timeout=60)
    section = {**{k: v for k, v in vars(cfg).items() if k != "moe"}, "moe": dataclasses.asdict(cfg.moe)}

    def run(rank):
        regions = _ep_regions(cfg, 2, rank)
        tensors, slices = {}, {}
        for name, t in params.items():
            region = regions[name]
            cut = tuple(slice(o, o + s) for o, s in zip(region.offsets, region.shape, strict=True))
            tensors[f"param.{name}"] = t[cut].clone()
            if region.shape != region.full_shape:
                slices[f"param.{name}"] = region.to_meta()
        meta = {"model": section, "parallel": {"data_parallel_size": 2, "expert_parallel_size": 2}}
        CheckpointWriter(root, "job", rank, 2, barrier.wait, attempt_id="t").save(
            3, tensors, {}, state={}, meta=meta, slices=slices
        )

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return root / "job" / "step_00000003"


def test_moe_checkpoint_exports_as_mixtral_and_imports_back(tmp_path):
    hf = mixtral(seed=3)
    cfg, ours = _imported(tmp_path / "in", hf)
    params = {n: p.detach().clone() for n, p in ours.named_parameters()}
    step = _write_ep2(tmp_path / "ckpt", cfg, params)
    out = tmp_path / "hf"
    res = CliRunner().invoke(app, ["checkpoint", "convert", str(step), str(out), "--format", "hf"])
    assert res.exit_code == 0, res.output
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["MixtralForCausalLM"] and conf["num_local_experts"] == 4
    back, info = transformers.MixtralForCausalLM.from_pretrained(
        out, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = _ids(cfg)
    with torch.no_grad():
        assert_logits_match(ours.double()(ids), back.eval().double()(ids).logits)
    again = load_hf_llama_config(out)
    assert again == cfg
    for name, value in load_hf_weights_for_layout(out, again).items():
        assert torch.equal(value, params[name]), name  # fp32 out and in: bit for bit


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"router": "sigmoid"}, "model.moe.router"),
        ({"num_shared_experts": 1}, "model.moe.num_shared_experts"),
        ({"layers": (1,)}, "model.moe.layers"),
        ({"balance": "bias"}, "model.moe.balance"),
        ({"top_k": 1}, "model.moe.top_k"),
    ],
)
def test_a_block_mixtral_does_not_compute_is_not_exported(tmp_path, change, field):
    cfg, ours = _imported(tmp_path / "in", mixtral())
    bad = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **change))
    params = {n: p.detach() for n, p in LlamaForCausalLM(bad).named_parameters()}
    from kuangchao_core.ckpt.hf import write_hf_dir

    write_hf_dir({n: p.detach() for n, p in ours.named_parameters()}, cfg, tmp_path / "ok")  # the control
    with pytest.raises(CheckpointError, match=field):
        write_hf_dir(params, bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"num_experts_per_tok": 1}, "num_experts_per_tok 1"),
        ({"sliding_window": 16}, "sliding_window 16"),
    ],
)
def test_a_mixtral_kuangchao_computes_differently_is_refused(tmp_path, changes, words):
    mixtral(**changes).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=words) as err:
        load_hf_llama_config(tmp_path)
    assert err.value.errors[0][0] == "model.checkpoint"


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_the_other_moe_families_are_refused_naming_what_differs(tmp_path, family):
    raw = {"model_type": family, **SIZES}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="sigmoid" if family == "qwen2_moe" else "q_norm"):
        load_hf_llama_config(tmp_path)


def test_the_job_section_trains_the_checkpoints_block_and_may_not_reshape_it(tmp_path):
    """The section's training settings (its defaults where unset) over the checkpoint's block, whose fields it must
    match, given or default: a worker reads back a resolved config where every field is set."""
    mixtral().save_pretrained(tmp_path)
    section = {"checkpoint": str(tmp_path), "moe": {"num_experts": 4, "aux_loss_coef": 0.05, "capacity_factor": 1.5}}
    moe = config_from_model_section(section).moe
    assert (moe.num_experts, moe.top_k, moe.aux_loss_coef, moe.capacity_factor) == (4, 2, 0.05, 1.5)
    cases = [
        ({"checkpoint": str(tmp_path)}, "model.moe"),  # the job's MoE checks need the section
        ({"checkpoint": str(tmp_path), "moe": {"num_experts": 8}}, "model.moe.num_experts"),
        ({"checkpoint": str(tmp_path), "moe": {"top_k": 2}}, "model.moe.num_experts"),  # the default 8 is not 4
        ({"checkpoint": str(tmp_path), "moe": {"num_experts": 4, "router": "sigmoid"}}, "model.moe.router"),
    ]
    for bad, path in cases:
        with pytest.raises(ConfigError) as err:
            config_from_model_section(bad)
        assert err.value.errors[0][0] == path, bad


def test_a_job_config_read_back_builds_the_same_model(tmp_path):
    """The flow checks the job as written; a worker reads back the resolved config (every field set): both build
    the checkpoint's block with the section's training settings."""
    from kuangchao_core.config.loader import config_from_dict

    mixtral().save_pretrained(tmp_path)
    model = {"checkpoint": str(tmp_path), "moe": {"num_experts": 4, "z_loss_coef": 0.01}}
    job = config_from_dict({"task": {"name": "t"}, "model": model, "parallel": {"data_parallel_size": 2}})
    back = config_from_dict(job.to_dict())
    built = [config_from_model_section(j.model) for j in (job, back)]
    assert built[0] == built[1] and built[0].moe.z_loss_coef == 0.01 and built[0].moe.num_experts == 4
