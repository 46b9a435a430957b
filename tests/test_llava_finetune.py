"""Fine-tuning what transformers saved (issue 31): a LLaVA directory as ``model.checkpoint``, trained at tp2 (and pp2).

A random ``transformers.LlavaForConditionalGeneration`` (CLIP tower width 32, 2 layers, 16 px images in 8 px patches;
the tiny Llama decoder, hidden 64, 2 layers; every norm and bias random too) is saved with ``save_pretrained``.
Jobs with ``model.checkpoint`` pointing at it and ``model.vision: {}`` (every tower size taken from the directory)
train the generated shape set in ``train.dtype: fp64``, encoder data-parallel over the two TP ranks:

- ``start`` jobs (tp2 and pp2) run one step at ``lr = 1e-300``: AdamW moves a weight by at most ``lr`` (its
  normalised update is <= 1 in size) and decays it by the factor ``1 - lr * wd``, both far below half an ulp of any
  weight above ~1e-284, so the step leaves every float64 weight bit for bit as loaded. Every rank's slices,
  reassembled, equal the directory's tensors exactly (fp32 widened to fp64 is exact) — tower (the unread last layer
  and post-norm too), projector and decoder — and the engine's first loss equals transformers' loss on the same
  micro-batches; the tp2 checkpoint exported with ``kc checkpoint convert --format hf`` loads into transformers
  with the original's weights bit for bit, so its logits on images and text are the original's.
- ``ft`` fine-tunes 2 steps at tp2: the loss falls, the export loads into transformers (no missing or unexpected key)
  and its logits equal the Kuangchao model's own; the weights the job never trained (the tower's unread last layer
  and post-norm) are the directory's, not the seed's; the checkpoint resumed at tp2 has them too.

Tolerances: transformers' logits against ours (``HF_REL``, tests/tolerances.py: transformers computes RMSNorm in
fp32, <= (2L+1)·5e-7 of the largest logit for L = 2). The export is fp32: rounding each weight (2^-24 relative)
perturbs a logit by <= ~25 chained matmuls x 6e-8 ≈ 1.5e-6 of the largest, inside ``HF_REL`` with the norms.
A loss from logits off by at most d differs by at most 2d (each log-softmax term moves by <= 2 max|dz|).
Negative controls: a tower weight left at its initialisation, the two TP ranks' shards swapped, the export without
the directory (its untrained tower weights drawn from the seed) and a resume that reads the checkpoint alone (the
behaviour before) each fail the same comparison.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kuangchao_core.config import ConfigError, config_from_dict
from tests.engine_helpers import SABOTAGE, gather_full, only_lineage, run_trainers, tiny_job
from tests.fixtures import hf_llama_config, tiny_llama
from tests.mp import run_distributed
from tests.tolerances import FP64_REL, HF_REL, assert_logits_match

transformers = pytest.importorskip("transformers")

VISION = dict(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
IMAGE_TOKEN = 255  # the byte vocabulary's last id: model.vision's default placeholder
TP2 = {"tensor_parallel_size": 2}
PP2 = {"pipeline_parallel_size": 2}
UNLOADED = "vision_tower.encoder.layers.0.self_attn.q_proj.weight"
UNREAD = ("vision_tower.encoder.layers.1.", "vision_tower.post_layernorm.")  # feature_layer -2 never reads them


def _save_llava(path: Path):
    """A random transformers LLaVA saved (fp32 safetensors) under ``path``; returns it in float64."""
    torch.manual_seed(5)
    vc = transformers.CLIPVisionConfig(num_attention_heads=2, **VISION)
    tc = hf_llama_config(tiny_llama(), attn_implementation="sdpa")
    cfg = transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=IMAGE_TOKEN, image_seq_length=4)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("lm_head.weight"):
                p.mul_(20.0)  # logits far from uniform (max ~10), so the comparisons see a mix-up
    model.save_pretrained(path, safe_serialization=True)
    return model.double()


def _job(tmp: Path, shapes: Path, hf_dir: Path, name: str, parallel: dict, lr: float, steps: int, **model):
    return tiny_job(
        str(tmp / name),
        task={"name": name, "seed": 7},
        model={"preset": None, "num_layers": None, "checkpoint": str(hf_dir), "vision": {}, **model},
        data={
            "format": "sft",
            "path": str(shapes / "train.jsonl"),
            "seq_len": 64,
            "images": {"decode_workers": 0},
        },
        parallel={"micro_batch_size": 2, "gradient_accumulation_steps": 2, **parallel},
        optimizer={"lr": lr},
        train={"steps": steps, "warmup_steps": 0, "dtype": "fp64"},
    )


def _tower_weight_not_loaded(trainer):
    copy_params = trainer.checkpoints._copy_params
    trainer.checkpoints._copy_params = lambda full, source, names: copy_params(full, source, names - {UNLOADED})


def _tp_shards_swapped(trainer):
    """Each TP rank reads the other's slice: every split region mirrored along its split dimension."""
    from kuangchao_core.ckpt import hf_llava
    from kuangchao_core.models.layout import Region

    real = hf_llava.load_hf_llava_weights_for_layout

    def swapped(hf_dir, regions, *args, **kw):
        mirror = {
            n: Region(
                r.full_shape,
                tuple(f - o - s for f, o, s in zip(r.full_shape, r.offsets, r.shape, strict=True)),
                r.shape,
            )
            for n, r in regions.items()
        }
        return real(hf_dir, mirror, *args, **kw)

    hf_llava.load_hf_llava_weights_for_layout = swapped
    return lambda: setattr(hf_llava, "load_hf_llava_weights_for_layout", real)


def _resume_skips_the_directory(trainer):
    """The resume before: the checkpoint alone, the untrained tower weights left at the seed's."""
    trainer.checkpoints.load_pretrained = lambda hf_dir: None


def _run(rank: int, world_size: int, jobs: list[dict]):
    """``run_trainers`` with this module's negative controls registered in the worker process."""
    SABOTAGE.update(
        tower_weight_not_loaded=_tower_weight_not_loaded,
        tp_shards_swapped=_tp_shards_swapped,
        resume_skips_the_directory=_resume_skips_the_directory,
    )
    return run_trainers(rank, world_size, jobs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """The random transformers LLaVA (float64) and the directory it was saved to."""
    tmp = tmp_path_factory.mktemp("llava_ft")
    return {"hf": _save_llava(tmp / "hf"), "hf_dir": tmp / "hf", "tmp": tmp}


@pytest.fixture(scope="module")
def runs(saved):
    from kuangchao_core.data.shapes import make_shape_set

    tmp, hf_dir = saved["tmp"], saved["hf_dir"]
    shapes = tmp / "shapes"
    make_shape_set(shapes, num_train=16, num_heldout=4, seed=1, size=16)
    jobs = {
        "start_tp2": {"cfg": _job(tmp, shapes, hf_dir, "start_tp2", TP2, 1e-300, 1)},
        "start_pp2": {"cfg": _job(tmp, shapes, hf_dir, "start_pp2", PP2, 1e-300, 1)},
        "ft": {"cfg": _job(tmp, shapes, hf_dir, "ft", TP2, 1e-3, 2)},
        "resumed": {"cfg": _job(tmp, shapes, hf_dir, "ft", TP2, 1e-3, 2), "resume": "auto", "max_steps": 0},
    }
    lora = {"vision": {"freeze": True}, "lora": {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"]}}
    jobs["lora_tp2"] = {"cfg": _job(tmp, shapes, hf_dir, "lora_tp2", TP2, 1e-3, 1, **lora), "max_steps": 0}
    etp2 = _job(tmp, shapes, hf_dir, "encoder_tp2", TP2, 1e-3, 1, vision={"parallel": "tp"})
    jobs["encoder_tp2"] = {"cfg": etp2, "max_steps": 0}
    jobs["resumed_without_directory"] = {**jobs["resumed"], "sabotage": "resume_skips_the_directory"}
    for control in ("tower_weight_not_loaded", "tp_shards_swapped"):
        jobs[control] = {"cfg": _job(tmp, shapes, hf_dir, control, TP2, 1e-3, 1), "max_steps": 0, "sabotage": control}
    per_rank = run_distributed(_run, 2, args=(list(jobs.values()),), timeout=400)
    return {**{name: [per_rank[r][i] for r in range(2)] for i, name in enumerate(jobs)}, **saved}


def _hf_state(hf) -> dict[str, np.ndarray]:
    """transformers' tensors by our names (``load_hf_llava``'s mapping), as float64."""
    from kuangchao_core.ckpt.hf_llava import _our_name

    buffers = ("position_ids", "rotary_emb.inv_freq")
    return {_our_name(n): t.detach().double().numpy() for n, t in hf.state_dict().items() if not n.endswith(buffers)}


def _worst_mismatch(full: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> tuple[str, float]:
    """The parameter furthest from ``want`` (max absolute difference) and that difference."""
    assert set(full) <= set(want), set(full) - set(want)
    return max(((n, float(np.abs(v - want[n]).max())) for n, v in full.items()), key=lambda x: x[1])


@pytest.mark.parametrize("layout", ["start_tp2", "start_pp2", "lora_tp2", "encoder_tp2"])
def test_every_weight_of_the_llava_directory_loads_into_the_layout(runs, layout):
    """``lora_tp2``: a frozen tower and LoRA on the decoder, loaded (0 steps): the base is the directory's;
    ``encoder_tp2``: decoder tp2 with the tower split over its own TP group (``model.vision.parallel: tp``)."""
    got = runs[layout]
    full = gather_full(got)
    want = _hf_state(runs["hf"])
    if layout == "lora_tp2":
        adapters = {n for n in full if ".lora_" in n}
        assert adapters and all(not got[0]["params"][n].any() for n in adapters if "lora_B" in n)
        full = {n: v for n, v in full.items() if n not in adapters}
    assert set(full) == set(want)
    assert any(n.startswith(UNREAD) for n in full)  # the tower's unread layer loaded too
    name, diff = _worst_mismatch(full, want)
    assert diff == 0.0, f"{layout}: {name} differs from the directory's by {diff:.2e}"
    q = "language_model.model.layers.0.self_attn.q_proj.weight"
    if layout == "encoder_tp2":  # half of a split tower weight too
        assert got[0]["params"][q].shape == (32, 64) and got[0]["params"][UNLOADED].shape == (16, 32)
    elif layout != "start_pp2":  # each rank holds half of a TP-split weight, the whole tower
        assert got[0]["params"][q].shape == (32, 64) and got[0]["params"][UNLOADED].shape == (32, 32)
    else:  # the tower on the first stage only
        assert not any(n.startswith("vision_tower.") for n in got[1]["params"])


@pytest.mark.parametrize("control", ["tower_weight_not_loaded", "tp_shards_swapped"])
def test_negative_control_fails_the_loading_comparison(runs, control):
    name, diff = _worst_mismatch(gather_full(runs[control]), _hf_state(runs["hf"]))
    assert diff > 1e-3, (control, name, diff)
    if control == "tower_weight_not_loaded":
        assert name == UNLOADED


def _hf_logits(hf, ids, pixels):
    with torch.no_grad():
        return hf(input_ids=ids, pixel_values=pixels).logits


@pytest.mark.parametrize("layout", ["start_tp2", "start_pp2", "ft"])
def test_first_step_loss_is_transformers_loss(runs, layout):
    from kuangchao_core.models.llama import causal_lm_loss

    batches = runs[layout][0]["first_step"]  # dp = 1: rank 0 sees every micro-batch of the step
    total, tokens, largest = 0.0, 0, 0.0
    for b in batches:
        ids, labels = torch.from_numpy(b["input_ids"]), torch.from_numpy(b["labels"])
        assert int((ids == IMAGE_TOKEN).sum()) == 4 * b["pixel_values"].shape[0]  # 4 features per image
        logits = _hf_logits(runs["hf"], ids, torch.from_numpy(b["pixel_values"]).double())
        total += float(causal_lm_loss(logits, labels, reduction="sum"))
        tokens += int((labels != -100).sum())
        largest = max(largest, float(logits.abs().max()))
    want = total / tokens  # the step's loss: the mean over every labelled token (parallel.step_loss)
    for r in runs[layout]:
        assert abs(r["losses"][0] - want) <= 2 * HF_REL * largest, (layout, r["losses"][0], want)
    print(
        f"{layout}: loss {want:.6f}, engine off by {abs(runs[layout][0]['losses'][0] - want):.1e} (bound {2 * HF_REL * largest:.1e})"
    )
    assert abs(want - np.log(256)) > 0.05  # not a random model's ~uniform prediction


def _export(runs, name: str, out: Path) -> Path:
    from typer.testing import CliRunner

    from kuangchao.cli.main import app

    step = sorted(only_lineage(runs["tmp"] / name / "ckpt" / name).glob("step_*"))[-1]
    res = CliRunner().invoke(app, ["checkpoint", "convert", str(step), str(out), "--format", "hf"])
    assert res.exit_code == 0, res.output
    return step


def _load_hf(path: Path):
    hf, info = transformers.LlavaForConditionalGeneration.from_pretrained(
        path, dtype=torch.float64, attn_implementation="sdpa", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return hf.eval()


def _images_and_text(runs, seed: int):
    """Two rows of random text, with 1 and 2 images' placeholders, and the images' random pixels (float64)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in (1, 2):
        ids = torch.randint(0, IMAGE_TOKEN, (24,), generator=gen)
        ids[torch.randperm(24, generator=gen)[: 4 * n]] = IMAGE_TOKEN
        rows.append(ids)
    return torch.stack(rows), torch.randn(3, 3, 16, 16, generator=gen, dtype=torch.float64)


def test_transformers_to_tp2_to_transformers_keeps_weights_and_logits(runs, tmp_path):
    _export(runs, "start_tp2", tmp_path / "hf")
    back, original = _load_hf(tmp_path / "hf"), runs["hf"]
    want = original.state_dict()
    assert all(torch.equal(back.state_dict()[n], t) for n, t in want.items())
    ids, pixels = _images_and_text(runs, 1)
    a, b = _hf_logits(back, ids, pixels), _hf_logits(original, ids, pixels)
    # the same weights through the same float64 code: only a kernel's summation order could differ (FP64_REL)
    assert_logits_match(a, b, rel=FP64_REL)


def _our_logits(full: dict[str, np.ndarray], hf_dir: Path, ids, pixels):
    """The Kuangchao model with the parameters ``full`` (reassembled from the ranks), in float64."""
    from kuangchao_core.ckpt.hf_llava import load_hf_llava_config
    from kuangchao_core.models.vlm import VisionLanguageModel

    text, vision = load_hf_llava_config(hf_dir)
    model = VisionLanguageModel(text, vision).double().eval()
    model.load_state_dict({n: torch.from_numpy(v) for n, v in full.items()}, strict=True)
    with torch.no_grad():
        return model(ids, pixels)


def test_finetuned_tp2_exports_to_transformers_with_its_own_logits(runs, tmp_path):
    ft = runs["ft"]
    assert ft[0]["losses"][1] < ft[0]["losses"][0]  # it trains
    _export(runs, "ft", tmp_path / "hf")
    back = _load_hf(tmp_path / "hf")
    full = gather_full(ft)
    ids, pixels = _images_and_text(runs, 2)
    ours, theirs = _our_logits(full, runs["hf_dir"], ids, pixels), _hf_logits(back, ids, pixels)
    assert_logits_match(ours, theirs)
    print(
        f"fine-tuned export: logits off by {float((ours - theirs).abs().max() / theirs.abs().max()):.1e} of the largest"
    )
    moved = "multi_modal_projector.linear_1.weight"
    assert not np.array_equal(full[moved], _hf_state(runs["hf"])[moved])  # fine-tuning moved the weights


def test_untrained_tower_weights_come_from_the_directory_in_the_export_and_on_resume(runs, tmp_path):
    """The unread tower layer is not trained, so not in the checkpoint: the export reads it from the directory
    the job started from (``vision_base``) and the resumed job loads it from there again, so the resumed model is
    the fine-tuned one exactly. Control: without ``vision_base`` (the export before) it is drawn from the seed."""
    from safetensors.torch import load_file

    from kuangchao_core.ckpt.index import CheckpointIndex, model_config_of_checkpoint
    from kuangchao_core.ckpt.vlm_export import export_hf_llava
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    step = _export(runs, "ft", tmp_path / "hf")
    want = _hf_state(runs["hf"])
    unread = [n for n in want if n.startswith(UNREAD)]

    def exported(path: Path) -> dict[str, np.ndarray]:
        tensors = load_file(str(path / "model.safetensors"))
        return {
            n: tensors[n.replace("vision_tower.", "vision_tower.vision_model.", 1)].double().numpy() for n in unread
        }

    assert unread and all(np.array_equal(v, want[n]) for n, v in exported(tmp_path / "hf").items())
    name, diff = _worst_mismatch(gather_full(runs["resumed"]), gather_full(runs["ft"]))
    assert diff == 0.0, (name, diff)
    name, diff = _worst_mismatch(gather_full(runs["resumed_without_directory"]), gather_full(runs["ft"]))
    assert name.startswith(UNREAD) and diff > 1e-3, (name, diff)  # control: the seed's tower layer
    previous = install_guard(AllowAll())  # offline reads, as `kc checkpoint convert` does them
    try:
        index = CheckpointIndex.open(step)
        try:
            manifest = {k: v for k, v in index.manifest.items() if k != "vision_base"}
            params = {k[len("param.") :]: index.read(k).float() for k in index.keys() if k.startswith("param.")}
        finally:
            index.close()
        export_hf_llava(params, manifest, model_config_of_checkpoint(manifest), tmp_path / "seeded")
    finally:
        install_guard(previous)
    seeded = exported(tmp_path / "seeded")
    assert not any(np.array_equal(v, want[n]) for n, v in seeded.items())


def test_vision_fields_come_from_the_directory_and_a_mismatch_names_the_field(saved):
    runs = saved
    from kuangchao_core.engine.plan import explain_plan
    from kuangchao_core.engine.vlm_model import pretrained_vision

    def model(vision):
        cfg = {"task": {"name": "t"}, "model": {"checkpoint": str(runs["hf_dir"]), "vision": vision}}
        return config_from_dict(cfg)

    got = pretrained_vision(model({"freeze": True}).model)
    assert (got.image_size, got.patch_size, got.hidden_size, got.num_heads, got.intermediate_size) == (16, 8, 32, 2, 64)
    assert got.image_token_id == IMAGE_TOKEN and got.freeze  # the job's own choice kept
    assert pretrained_vision(model({"image_size": 16, "num_layers": 2}).model).num_layers == 2  # agreeing fields
    with pytest.raises(ConfigError) as info:
        pretrained_vision(model({"hidden_size": 64, "feature_layer": -1}).model)
    errors = dict(info.value.errors)
    assert set(errors) == {"model.vision.hidden_size", "model.vision.feature_layer"}
    assert (
        "vision_config.hidden_size" in errors["model.vision.hidden_size"] and "32" in errors["model.vision.hidden_size"]
    )
    assert "vision_feature_layer" in errors["model.vision.feature_layer"]
    # a text-only job given a LLaVA directory is refused, naming what to set; the plan shows the directory's tower
    text_only = config_from_dict({"task": {"name": "t"}, "model": {"checkpoint": str(runs["hf_dir"])}})
    with pytest.raises(ConfigError, match=r"is a LLaVA model .* set model.vision"):
        pretrained_vision(text_only.model)
    # the flow writes the resolved section into the config the ranks read (every field then set): it resolves again
    # to itself; the unresolved section written out would name its defaults as set and be refused
    from kuangchao_core.config.loader import load_config

    for resolve, ok in ((True, True), (False, False)):
        job = model({})
        if resolve:
            job.model.vision = pretrained_vision(job.model)  # as kuangchao_core.job.prepare does
        (runs["tmp"] / "job.yaml").write_text(job.to_yaml(), encoding="utf-8")
        read = load_config(runs["tmp"] / "job.yaml").model
        if ok:
            assert pretrained_vision(read) == job.model.vision
        else:
            with pytest.raises(ConfigError, match="model.vision"):
                pretrained_vision(read)
    # the encoder's TP size is checked against the directory's tower, not the section's defaults (4 heads)
    from kuangchao_core.config.vision_schema import vision_layout_errors

    etp = {"task": {"name": "t"}, "parallel": {"tensor_parallel_size": 8}}
    vision = {"parallel": "tp", "tensor_parallel_size": 8}
    with pytest.raises(ConfigError, match="model.vision.num_heads"):  # control: no checkpoint, the section's own
        config_from_dict({**etp, "model": {"vision": vision}})
    job = config_from_dict({**etp, "model": {"checkpoint": str(runs["hf_dir"]), "vision": vision}})
    errors = vision_layout_errors(pretrained_vision(job.model), 8)  # what the trainer's encoder_layout checks
    assert {p for p, _ in errors} == {"model.vision.num_heads"}  # the directory's 2 heads
    plan = explain_plan(model({}))
    assert plan["vision"]["parameters"]["tower"] == sum(
        p.numel() for n, p in runs["hf"].named_parameters() if n.startswith("model.vision_tower.")
    )
