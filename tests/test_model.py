"""The Llama model against Hugging Face transformers, its building blocks, config helpers and learnability."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import transformers

from kuangchao_core.data.dataset import build_dataset
from kuangchao_core.errors import ConfigError
from kuangchao_core.models.llama import (
    PRESETS,
    LlamaConfig,
    LlamaForCausalLM,
    causal_lm_loss,
    config_from_model_section,
    load_hf_llama_config,
)
from kuangchao_core.perm import guard_api
from tests.fixtures import hf_llama_config
from tests.tolerances import FP64_REL, assert_logits_match


@pytest.fixture(autouse=True)
def _allow_all():
    previous = guard_api.install_guard(guard_api.AllowAll())
    yield
    guard_api.install_guard(previous)


def _hf_model(cfg: LlamaConfig) -> transformers.LlamaForCausalLM:
    hc = hf_llama_config(cfg)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hc).float().eval()
    # HF initialises norms to one; perturb them so RMSNorm weights are really checked.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize(
    "cfg",
    [
        LlamaConfig(),  # grouped-query attention, 2 kv heads for 4 query heads
        LlamaConfig(num_kv_heads=4, tie_embeddings=True, rope_theta=500000.0, norm_eps=1e-6),
        LlamaConfig(num_heads=8, num_kv_heads=1, num_layers=3, hidden_size=32, intermediate_size=64),
    ],
)
def test_logits_match_transformers(cfg):
    # float64 on both sides; what remains is transformers' fp32 RMSNorm (tests/tolerances.py, HF_REL)
    hf = _hf_model(cfg).double()
    ours = LlamaForCausalLM(cfg).eval().double()
    hf_sd = hf.state_dict()
    assert set(ours.state_dict()) == set(hf_sd)
    ours.load_state_dict(hf_sd, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    assert got.shape == (3, 40, cfg.vocab_size)
    assert expected.dtype == torch.float64 and expected.std() > 0.1  # a real signal
    assert_logits_match(got, expected)


def test_parameter_names_follow_the_contract():
    cfg = LlamaConfig(num_layers=2)
    names = set(LlamaForCausalLM(cfg).state_dict())
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(2):
        want |= {f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        want |= {f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        want |= {f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.post_attention_layernorm.weight"}
    assert names == want
    assert sum(p.numel() for p in LlamaForCausalLM(cfg).parameters()) == cfg.num_params()


def test_building_blocks_compose_to_forward_and_attention_is_causal():
    cfg = LlamaConfig(num_layers=3)
    model = LlamaForCausalLM(cfg)
    model.init_weights(7)
    model = model.double()
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        full = model(ids)
        h = model.embed(ids)
        h = model.run_layers(h, 0, 1)
        h = model.run_layers(h, 1, 3)
        staged = model.head(h)
        assert torch.equal(full, staged)
        changed = ids.clone()
        changed[:, 10:] = (changed[:, 10:] + 1) % 256
        other = model(changed)
    assert torch.allclose(full[:, :10], other[:, :10], atol=FP64_REL, rtol=FP64_REL)
    assert not torch.allclose(full[:, 10:], other[:, 10:])


def test_linear_factory_is_the_only_way_projections_are_built():
    roles = []

    class Recording(LlamaForCausalLM):
        def make_linear(self, in_features, out_features, role):
            roles.append(role)
            return super().make_linear(in_features, out_features, role)

    Recording(LlamaConfig(num_layers=2))
    per_layer = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert roles == per_layer * 2 + ["lm_head"]


def test_init_weights_is_deterministic():
    a, b, c = (LlamaForCausalLM(LlamaConfig()) for _ in range(3))
    a.init_weights(3)
    b.init_weights(3)
    c.init_weights(4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])
    assert torch.equal(sa["model.norm.weight"], torch.ones(64))
    std = sa["model.embed_tokens.weight"].std().item()
    assert 0.018 < std < 0.022


def test_causal_lm_loss_ignores_minus_100():
    logits = torch.randn(2, 5, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :3] = -100
    keep = labels != -100
    manual = -torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0][keep].mean()
    assert causal_lm_loss(logits, labels).dtype == torch.float64  # fp64 logits are not rounded to fp32
    assert torch.allclose(causal_lm_loss(logits, labels), manual, atol=0, rtol=FP64_REL)
    assert torch.allclose(causal_lm_loss(logits, labels, reduction="sum"), manual * keep.sum(), atol=0, rtol=FP64_REL)


def test_config_from_model_section_and_hf_config(tmp_path):
    section = SimpleNamespace(preset="tiny", hidden_size=None, num_layers=3, vocab_size=None, checkpoint=None)
    cfg = config_from_model_section(section)
    assert cfg.num_layers == 3 and cfg.hidden_size == PRESETS["tiny"].hidden_size and cfg.head_dim == 16
    assert config_from_model_section({"preset": "llama3-8b"}).num_kv_heads == 8
    with pytest.raises(ConfigError) as err:
        config_from_model_section({"hidden_size": 64})
    assert "model.vocab_size" in str(err.value)
    with pytest.raises(ConfigError, match="num_kv_heads"):
        config_from_model_section({"preset": "tiny", "num_kv_heads": 3})

    hf = _hf_model(LlamaConfig(rope_theta=250000.0, tie_embeddings=True))
    hf.config.save_pretrained(tmp_path)
    loaded = load_hf_llama_config(tmp_path)
    assert loaded == LlamaConfig(rope_theta=250000.0, tie_embeddings=True, norm_eps=1e-5)
    from_ckpt = config_from_model_section({"checkpoint": str(tmp_path), "max_seq_len": 64})
    assert from_ckpt.rope_theta == 250000.0 and from_ckpt.max_seq_len == 64
    with pytest.raises(ConfigError, match="config.json"):
        load_hf_llama_config(tmp_path / "nope")


def test_tiny_model_learns_the_synthetic_corpus_quickly():
    torch.manual_seed(0)
    data_cfg = {"seq_len": 64, "synthetic": {"task": "arithmetic", "num_train": 4000, "num_eval": 100, "seed": 5}}
    ds = build_dataset(data_cfg, 256)
    floor = ds.corpus.loss_floor()
    model = LlamaForCausalLM(PRESETS["tiny"])
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    start = time.time()
    for _ in range(40):
        idx = torch.randint(0, len(ds), (16,), generator=gen).tolist()
        batch = {k: torch.stack([ds[i][k] for i in idx]) for k in ("input_ids", "labels")}
        loss = causal_lm_loss(model(batch["input_ids"]), batch["labels"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert time.time() - start < 20
    first, last = losses[0], sum(losses[-5:]) / 5
    assert abs(first - torch.log(torch.tensor(256.0)).item()) < 0.3  # uniform start
    assert last < 0.5 * first, losses
    assert last > floor  # the entropy floor cannot be beaten
