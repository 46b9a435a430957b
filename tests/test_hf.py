"""Hugging Face Llama interop, pinned against transformers itself: export (`convert --format hf`) and import (hf.py)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kuangchao.cli.main import app
from kuangchao_core.ckpt.hf import load_hf_weights_for_layout
from kuangchao_core.ckpt.writer import CheckpointWriter
from kuangchao_core.models.layout import Region, TargetLayout
from kuangchao_core.models.llama import LlamaForCausalLM, load_hf_llama_config
from kuangchao_core.models.tp_llama import tp_shard_slices
from kuangchao_core.perm.guard_api import AllowAll, install_guard
from tests.fixtures import hf_llama_config, tiny_llama
from tests.tolerances import assert_logits_match

transformers = pytest.importorskip("transformers")

CFG = tiny_llama(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4)


@pytest.fixture(autouse=True)
def allow_all():
    previous = install_guard(AllowAll())
    yield
    install_guard(previous)


def _hf_model(tie: bool = False):
    torch.manual_seed(1)
    hf_cfg = hf_llama_config(CFG, max_position_embeddings=64, tie_word_embeddings=tie)
    model = transformers.LlamaForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():  # norms start at 1; make them random so a mix-up shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model


def test_hf_directory_loads_into_our_model(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = load_hf_llama_config(tmp_path)
    weights = load_hf_weights_for_layout(tmp_path, cfg)
    ours = LlamaForCausalLM(cfg).eval()
    ours.load_state_dict(weights, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():  # float64 on both sides (tests/tolerances.py, HF_REL)
        want = hf.double()(ids).logits
        got = ours.double()(ids)
    assert_logits_match(got, want)


def test_hf_sharded_directory_slices_for_tp2_pp2(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    full = {n: p.detach() for n, p in hf.state_dict().items()}
    cfg = load_hf_llama_config(tmp_path)
    seen: dict[str, list] = {}
    for pp_rank in range(2):
        for tp_rank in range(2):
            layout = TargetLayout(tp=2, pp=2, tp_rank=tp_rank, pp_rank=pp_rank)
            got = load_hf_weights_for_layout(tmp_path, cfg, layout)
            split = tp_shard_slices(cfg, 2, tp_rank)
            for name, t in got.items():
                want = full[name] if split[name] is None else full[name].narrow(*split[name])
                assert torch.equal(t, want), name
                seen.setdefault(name, []).append((tp_rank, t))
    # every parameter owned by exactly one stage; the TP pieces of each re-assemble to the full tensor
    assert sorted(seen) == sorted(full)
    for name, parts in seen.items():
        dim = tp_shard_slices(cfg, 2, 0)[name]
        if dim is None:
            assert all(torch.equal(t, full[name]) for _, t in parts)
        else:
            whole = torch.cat([t for _, t in sorted(parts, key=lambda x: x[0])], dim=dim[0])
            assert torch.equal(whole, full[name]), name


def _write_tp2(root, params):
    import threading

    barrier = threading.Barrier(2, timeout=60)

    def run(rank):
        split = tp_shard_slices(CFG, 2, rank)
        tensors, slices = {}, {}
        for name, t in params.items():
            s = split[name]
            tensors[f"param.{name}"] = t if s is None else t.narrow(*s).clone()
            if s is not None:
                slices[f"param.{name}"] = Region.split(t.shape, *s).to_meta()
        CheckpointWriter(root, "job", rank, 2, barrier.wait, attempt_id="t").save(
            3,
            tensors,
            {},
            state={},
            meta={"model_shape": vars(CFG), "parallel": {"tensor_parallel_size": 2}},
            slices=slices,
        )

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return root / "job" / "step_00000003"


def test_export_hf_loads_into_transformers(tmp_path):
    torch.manual_seed(2)
    ours = LlamaForCausalLM(CFG).eval()
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    step = _write_tp2(tmp_path / "ckpt", {n: p.detach().clone() for n, p in ours.named_parameters()})
    out = tmp_path / "hf"
    res = CliRunner().invoke(app, ["checkpoint", "convert", str(step), str(out), "--format", "hf"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLM"] and conf["num_key_value_heads"] == 2
    hf, info = transformers.LlamaForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.randint(0, CFG.vocab_size, (2, 16))
    with torch.no_grad():
        assert_logits_match(ours.double()(ids), hf.eval().double()(ids).logits)
