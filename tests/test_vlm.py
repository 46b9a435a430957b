"""The vision-language model (issue 31, item 1) against transformers' LLaVA with a CLIP tower: config, import, export.

Tolerances. Image features: both sides run the tower and projector wholly in float64 (transformers' SDPA attention,
LayerNorm and activations keep the dtype), so they differ only by the order of float64 sums, ≲ sqrt(n)·u with
n ≤ 64 terms per reduction and u = 2**-53 over ~10 chained reductions: ~1e-14 relative, far inside ``FP64_REL``.
Logits: transformers computes each decoder RMSNorm in float32 whatever the dtype, the case ``HF_REL`` is derived
for (tests/tolerances.py: (2L+1) norms with L = 2 layers, ≲ 2.5e-6 of the largest logit; the tower adds ~1e-14).
Each negative control breaks one piece (the class token, the feature layer, the placeholders' order) and asserts
that the very same check fails by more than ``NEGATIVE_MIN``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kuangchao_core.ckpt.hf_llava import load_hf_llava, load_hf_llava_config, write_hf_llava_dir
from kuangchao_core.config import ConfigError, config_from_dict
from kuangchao_core.config.unused import unused_settings
from kuangchao_core.errors import CheckpointError
from kuangchao_core.models.llama import LlamaConfig
from kuangchao_core.models.vision import VisionTower, vision_config
from kuangchao_core.models.vlm import VisionLanguageModel
from tests.fixtures import hf_llama_config, tiny_llama
from tests.tolerances import FP64_REL, NEGATIVE_MIN, assert_logits_match, rel_norm

transformers = pytest.importorskip("transformers")

TEXT = tiny_llama(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, max_seq_len=64)
VISION = dict(image_size=16, patch_size=8, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4)
IMAGE_TOKEN = 63  # the vocabulary's last id, the default
TOKENS = 4  # (16 / 8)**2 patches per image, the class token dropped


def _hf_llava(hidden_act="quick_gelu", **changes):
    """A transformers LLaVA of the tiny shapes, every weight random (norms and biases too, so a mix-up shows)."""
    torch.manual_seed(3)
    vc = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=8
    )
    vc.hidden_act = hidden_act
    tc = hf_llama_config(TEXT, attn_implementation="sdpa")
    cfg = transformers.LlavaConfig(
        vision_config=vc, text_config=tc, image_token_index=IMAGE_TOKEN, image_seq_length=TOKENS, **changes
    )
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def _batch(images_per_row=(1, 2), seq=16, seed=0):
    """input_ids with each image's TOKENS placeholders at random places, and the images' pixels."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in images_per_row:
        ids = torch.randint(0, IMAGE_TOKEN, (seq,), generator=gen)
        ids[torch.randperm(seq, generator=gen)[: n * TOKENS]] = IMAGE_TOKEN
        rows.append(ids)
    pixels = torch.randn(sum(images_per_row), 3, 16, 16, generator=gen, dtype=torch.float64)
    return torch.stack(rows), pixels


def _hf_features(hf, pixels):
    with torch.no_grad():
        # hidden states asked for explicitly: transformers 5.25 asks for them with the feature layer's index, and
        # index 0 reads as "no" (its LLaVA then fails on layer 0)
        out = hf.model.get_image_features(pixel_values=pixels, output_hidden_states=True)
        return torch.stack(list(out.pooler_output))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(transformers' model in float64, ours imported from its saved float32 directory, the directory)."""
    hf = _hf_llava()
    d = tmp_path_factory.mktemp("hf_llava")
    hf.save_pretrained(d, safe_serialization=True)
    ours = load_hf_llava(d, dtype=torch.float64).eval()
    return hf.double(), ours, d


# ------------------------------------------------------------------------------------------------------- config
def test_vision_config_absent_keeps_the_text_model_and_present_validates_with_field_paths():
    text_only = config_from_dict({"task": {"name": "t"}})
    assert text_only.model.vision is None and not [p for p, _ in unused_settings(text_only) if p == "model.vision"]
    ok = config_from_dict({"task": {"name": "t"}, "model": {"vision": {}}})
    assert ok.model.vision.tower == "clip" and ok.model.vision.feature_layer == -2
    assert not [p for p, _ in unused_settings(ok) if p == "model.vision"]  # the trainer builds it (issue 31)
    bad = {"image_size": 30, "patch_size": 8, "hidden_size": 30, "num_heads": 4, "feature_layer": 5}
    with pytest.raises(ConfigError) as info:
        config_from_dict(
            {"task": {"name": "t"}, "model": {"vocab_size": 300, "vision": {**bad, "image_token_id": 300}}}
        )
    paths = {p for p, _ in info.value.errors}
    assert paths == {f"model.vision.{k}" for k in ("patch_size", "num_heads", "feature_layer", "image_token_id")}
    with pytest.raises(ConfigError) as info:
        config_from_dict({"task": {"name": "t"}, "model": {"vision": {"tower": "vit", "depth": 2}}})
    assert {p for p, _ in info.value.errors} == {"model.vision.tower", "model.vision.depth"}
    assert vision_config(None, 64).image_token_id == 63  # unset: the vocabulary's last id
    with pytest.raises(ConfigError) as info:  # the model's own config names the fields too
        vision_config({"num_layers": 0, "patch_size": 3}, 64)
    assert {p for p, _ in info.value.errors} == {"model.vision.num_layers"}
    with pytest.raises(ConfigError) as info:
        vision_config({"patch_size": 3}, 64)
    assert {p for p, _ in info.value.errors} == {"model.vision.patch_size"}
    assert vision_config(None, 64, feature_select="full").tokens_per_image == 17


def test_initialisation_depends_on_the_seed_alone():
    vision = vision_config(None, 64, **VISION)
    a, b, c = (VisionLanguageModel(TEXT, vision) for _ in range(3))
    a.init_weights(5), b.init_weights(5), c.init_weights(6)
    assert all(torch.equal(t, b.state_dict()[n]) for n, t in a.state_dict().items())
    assert not torch.equal(a.vision_tower.embeddings.class_embedding, c.vision_tower.embeddings.class_embedding)
    # the tower's draws are not the decoder's (another generator), and norms start at one
    assert not torch.equal(
        a.multi_modal_projector.linear_2.weight, a.language_model.model.layers[0].mlp.up_proj.weight[:32]
    )
    assert torch.equal(a.vision_tower.pre_layrnorm.weight, torch.ones(32))


def test_gradients_reach_every_trainable_weight_and_the_unread_ones_are_frozen():
    model = VisionLanguageModel(TEXT, vision_config(None, 64, **VISION))  # feature_layer -2: layer 1 never runs
    model.init_weights(1)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(n.startswith("vision_tower.encoder.layers.0.") for n in trainable)
    assert not any(n.startswith(("vision_tower.encoder.layers.1.", "vision_tower.post_layernorm.")) for n in trainable)
    ids, pixels = _batch()
    model(ids, pixels.float()).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n in trainable)


# ------------------------------------------------------------------------------------------------------- import
def test_imported_config_matches_the_llava_config(imported):
    _, _, d = imported
    text, vision = load_hf_llava_config(d)
    assert isinstance(text, LlamaConfig) and (text.hidden_size, text.num_layers, text.vocab_size) == (32, 2, 64)
    assert (vision.image_size, vision.patch_size, vision.num_layers, vision.hidden_act) == (16, 8, 2, "quick_gelu")
    assert (vision.feature_layer, vision.feature_select, vision.image_token_id) == (-2, "default", IMAGE_TOKEN)


def test_imported_image_features_equal_transformers_and_break_without_cls_drop_or_with_another_layer(
    imported, monkeypatch
):
    hf, ours, _ = imported
    _, pixels = _batch()
    want = _hf_features(hf, pixels)
    with torch.no_grad():
        assert rel_norm(ours.image_features(pixels), want) < FP64_REL
        # negative controls: the class token kept in place of the last patch; the last layer instead of -2
        monkeypatch.setattr(VisionTower, "forward", lambda self, px: self.hidden_state(px, 2 - 1)[:, :-1])
        assert rel_norm(ours.image_features(pixels), want) > NEGATIVE_MIN
        monkeypatch.setattr(VisionTower, "forward", lambda self, px: self.hidden_state(px, 2)[:, 1:])
        assert rel_norm(ours.image_features(pixels), want) > NEGATIVE_MIN


@pytest.mark.parametrize(
    "changes",
    [
        {"vision_feature_layer": 0, "vision_feature_select_strategy": "full", "projector_hidden_act": "quick_gelu"},
        {"vision_feature_layer": 1, "projector_hidden_act": "gelu_pytorch_tanh", "multimodal_projector_bias": False},
        {"vision_feature_layer": -1, "hidden_act": "gelu", "projector_hidden_act": "silu"},
    ],
)
def test_other_feature_layers_strategies_and_activations_import_equal(tmp_path, changes):
    hf = _hf_llava(**changes)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_hf_llava(tmp_path, dtype=torch.float64).eval()
    _, pixels = _batch()
    want = _hf_features(hf.double(), pixels)
    assert want.shape[1] == ours.vision_config.tokens_per_image
    with torch.no_grad():
        assert rel_norm(ours.image_features(pixels), want) < FP64_REL


def test_imported_logits_equal_transformers_and_a_misplaced_merge_does_not(imported, monkeypatch):
    hf, ours, _ = imported
    ids, pixels = _batch()
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pixels).logits
        assert_logits_match(ours(ids, pixels), want)
        text_only = ids.masked_fill(ids == IMAGE_TOKEN, 0)  # a text sequence agrees too
        assert_logits_match(ours(text_only), hf(input_ids=text_only).logits)
        # negative control: the images' features in reverse order (each image's placeholders get another's)
        real = ours.image_features
        monkeypatch.setattr(ours, "image_features", lambda px: real(px).flip(0))
        with pytest.raises(AssertionError, match="logits differ"):
            assert_logits_match(ours(ids, pixels), want)
        assert float((ours(ids, pixels) - want).abs().max()) > NEGATIVE_MIN * float(want.abs().max())


def test_placeholders_must_pair_with_the_features(imported):
    _, ours, _ = imported
    ids, pixels = _batch()
    with torch.no_grad(), pytest.raises(ValueError, match="12 image placeholder tokens .* 2 images give 8"):
        ours(ids, pixels[:2])
    with pytest.raises(ValueError, match="12 image placeholder tokens"):
        ours(ids)


# ------------------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("tie", [False, True])
def test_export_loads_in_transformers_with_identical_logits(tmp_path, tie):
    torch.manual_seed(4)
    text = dataclasses.replace(TEXT, tie_embeddings=tie)
    model = VisionLanguageModel(text, vision_config(None, TEXT.vocab_size, **VISION))
    model.init_weights(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.uniform_(0.5, 1.5)
    model = model.double().eval()
    out = write_hf_llava_dir(model.state_dict(), model.config, model.vision_config, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert ("language_model.lm_head.weight" in f.keys()) is not tie
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlavaForConditionalGeneration"] and conf["image_seq_length"] == TOKENS
    hf, info = transformers.LlavaForConditionalGeneration.from_pretrained(
        out, dtype=torch.float64, attn_implementation="sdpa", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids, pixels = _batch((2, 1), seed=1)
    with torch.no_grad():
        assert rel_norm(model.image_features(pixels), _hf_features(hf.eval(), pixels)) < FP64_REL
        assert_logits_match(model(ids, pixels), hf(input_ids=ids, pixel_values=pixels).logits)


def test_transformers_to_ours_to_transformers_is_bit_identical(imported, tmp_path):
    hf, ours, _ = imported
    out = write_hf_llava_dir(ours.state_dict(), ours.config, ours.vision_config, tmp_path / "again", dtype="fp32")
    back = transformers.LlavaForConditionalGeneration.from_pretrained(out, dtype=torch.float64)
    want = hf.state_dict()
    got = back.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want)  # fp32 weights, widened and narrowed exactly


def test_transformers_in_memory_names_import_too(imported, tmp_path):
    hf, ours, d = imported
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    save_file({n: t.contiguous() for n, t in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    assert any(n.startswith("model.vision_tower.") for n in hf.state_dict())
    again = load_hf_llava(tmp_path, dtype=torch.float64).state_dict()
    assert sorted(again) == sorted(ours.state_dict())
    assert all(torch.equal(again[n], t) for n, t in ours.state_dict().items())


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"model_type": "llama"}, "a LLaVA model"),
        ({"vision_config": {"model_type": "siglip_vision_model"}}, "only CLIP's"),
        ({"vision_feature_layer": [-2, -1]}, "only one layer"),
        ({"image_token_index": 64}, "image_token_id"),
    ],
)
def test_unsupported_llava_configs_are_refused_naming_why(imported, tmp_path, change, words):
    _, _, d = imported
    raw = json.loads((d / "config.json").read_text())
    for key, value in change.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=words):
        load_hf_llava_config(tmp_path)


def test_foreign_or_misshapen_tensors_are_refused_naming_them(imported, tmp_path):
    _, _, d = imported
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    tensors = load_file(str(d / "model.safetensors"))
    save_file({**tensors, "image_newline": torch.zeros(32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="image_newline is not a parameter"):
        load_hf_llava(tmp_path)
    name = "multi_modal_projector.linear_1.weight"
    save_file({**tensors, name: torch.zeros(32, 31)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"{name} has shape"):
        load_hf_llava(tmp_path)
    del tensors[name]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="1 parameters are not in the weights"):
        load_hf_llava(tmp_path)


def test_a_llava_export_is_not_made_a_text_only_pyfunc_model(imported, tmp_path):
    """``write_pyfunc_files`` leaves a LLaVA directory as its files (the pyfunc code loads ``LlamaForCausalLM``);
    control: the tiny Llama of ``tests/data/kc-tiny-demo`` becomes a pyfunc model."""
    import shutil

    from kuangchao_core.obs.mlflow_model import write_pyfunc_files

    llava, llama = tmp_path / "llava", tmp_path / "llama"
    shutil.copytree(imported[2], llava)
    shutil.copytree(Path(__file__).parent / "data" / "kc-tiny-demo", llama)
    record = {"format": "hf", "files": sorted(p.name for p in llava.iterdir())}
    assert write_pyfunc_files(llava, record) == record and not (llava / "MLmodel").exists()
    assert "MLmodel" in write_pyfunc_files(llama, {"format": "hf", "files": []})["files"]
    assert (llama / "MLmodel").is_file()
