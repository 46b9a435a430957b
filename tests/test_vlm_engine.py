"""The vision-language model trained by the real engine (issue 31): every layout equals one process in float64.

A tiny LLaVA (CLIP tower width 32, 2 layers, 16 px images in 8 px patches: 4 features per image; the tiny decoder
with 2 layers, hidden 64) trains 3 steps of the generated shape set (one image per record) in ``train.dtype:
fp64``, global batch 4 rows. Each layout's per-step losses, final parameters (reassembled from every rank's regions;
tower and projector included), held-out loss and greedy exact-match answers must equal the one-process run's
within ``FP64_REL`` (tests/tolerances.py derives it from float64 rounding over these sizes):

- ``dp2_zero2``: data parallel with ZeRO-2 (the encoder is replicated over DP like the decoder);
- ``tp2``: the default encoder layout beside decoder TP — each TP rank encodes its share of the micro-batch's images,
  the features are all-gathered for the TP-sharded decoder, the encoder's gradients are summed over TP before the
  DP reduction (so over exactly the ranks that replicate it); at evaluation one image is split 1 + 0 over the two
  ranks, the empty-share path;
- ``tp2_frozen_lora``: ``model.vision.freeze`` and LoRA on the decoder at tp2, against the one-process frozen+LoRA
  run; the frozen tower has no gradient and equals its initial weights;
- ``tp2_encoder_tp2``: ``model.vision.parallel: tp`` with the encoder's TP size 2 — the tower's attention and MLP
  split over the decoder's TP group, every rank encoding every image;
- ``tp4_encoder_tp2`` (4 processes): two encoder TP groups of 2 inside the decoder's TP group of 4, each encoding
  its share of the images, features all-gathered and gradients summed over the share group;
- ``pp2``: decoder pp2, the encoder on the first stage (its images ride with each micro-batch to stage 0); the
  greedy answers run through the pipeline (each decoding step through both stages, the question's image to the
  first, the last stage's token broadcast);
- ``pp2_tp2`` (4 processes): the encoder on the first stage, data-parallel over that stage's TP group as in ``tp2``,
  its gradients summed over that TP group; greedy answers through the TP-sharded pipeline;
- ``pp2_tp2_encoder_tp2`` (4 processes): the same with ``parallel: tp``: the tower split over the first stage's TP
  group, every rank of it encoding every image;
- a checkpoint written by one process at step 2 resumed at decoder tp2 + encoder tp2 for step 3 equals the
  uninterrupted run (the checkpoint holds whole tensors; each rank reads its slices of the tower, decoder).

Negative controls (each must fail the same comparison by >= NEGATIVE_MIN): ZeRO-2's first bucket unreduced; the
encoder's gradients reduced over DP only (the TP sum skipped) at tp2 and at pp2 x tp2; LoRA's replicated ``A``
gradient not summed over TP; a pipeline that skips a micro-batch; the encoder's row-parallel ``out_proj`` not
all-reduced (tp2 and pp2 x tp2 with encoder tp2); at tp4 + encoder tp2 the share group's gradient sum skipped.
The greedy comparison's control: pp2's answers with each next token taken from the first stage instead of the last
differ from one process's (training untouched).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from kuangchao_core.errors import PlanError
from tests.engine_helpers import gather_full, only_lineage, run_trainers, tiny_job
from tests.mp import run_distributed
from tests.tolerances import FP64_REL, NEGATIVE_MIN, max_rel_diff, worst_rel

STEPS = 3
VISION = {
    "image_size": 16,
    "patch_size": 8,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 2,
    "num_heads": 2,
}
LORA = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"]}
#: the encoder's own tensor parallelism (``model.vision.parallel: tp``) over the decoder's TP group
ENCODER_TP2 = {"parallel": "tp", "tensor_parallel_size": 2}
#: layout -> (world size, parallel section, frozen encoder + LoRA, more of ``model.vision``)
LAYOUTS = {
    "dp2_zero2": (2, {"data_parallel_size": 2, "zero_stage": 2}, False, {}),
    "tp2": (2, {"tensor_parallel_size": 2}, False, {}),
    "tp2_frozen_lora": (2, {"tensor_parallel_size": 2}, True, {}),
    "pp2": (2, {"pipeline_parallel_size": 2}, False, {}),
    "tp2_encoder_tp2": (2, {"tensor_parallel_size": 2}, False, ENCODER_TP2),
    "tp4_encoder_tp2": (4, {"tensor_parallel_size": 4}, False, ENCODER_TP2),
    "pp2_tp2": (4, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, False, {}),
    "pp2_tp2_encoder_tp2": (4, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, False, ENCODER_TP2),
}
NEGATIVE = {
    "dp2_zero2_unreduced_bucket": ("dp2_zero2", "unreduced_zero_bucket"),
    "tp2_encoder_reduced_over_dp_only": ("tp2", "encoder_reduced_over_dp_only"),
    "tp2_frozen_lora_unsummed_lora_a": ("tp2_frozen_lora", "unsummed_lora_a"),
    "pp2_skipped_micro_batch": ("pp2", "skipped_micro_batch"),
    "tp2_encoder_tp2_out_proj_unreduced": ("tp2_encoder_tp2", "encoder_out_proj_unreduced"),
    "tp4_encoder_tp2_share_group_unsummed": ("tp4_encoder_tp2", "encoder_reduced_over_dp_only"),
    "pp2_tp2_encoder_reduced_over_dp_only": ("pp2_tp2", "encoder_reduced_over_dp_only"),
    "pp2_tp2_encoder_tp2_out_proj_unreduced": ("pp2_tp2_encoder_tp2", "encoder_out_proj_unreduced"),
}
#: controls of the greedy answers only (training untouched): layout, sabotage
NEGATIVE_GREEDY = {"pp2_greedy_token_from_first_stage": ("pp2", "greedy_token_from_first_stage")}


def _job(tmp: Path, shapes: Path, name: str, parallel: dict, frozen: bool, vision: dict, ckpt: dict | None = None):
    dp = parallel.get("data_parallel_size", 1)
    model = {"preset": "tiny", "num_layers": 2, "vision": {**VISION, "freeze": frozen, **vision}}
    if frozen:
        model["lora"] = LORA
    return tiny_job(
        str(tmp / name),
        task={"name": name, "seed": 7},
        model=model,
        data={
            "format": "sft",
            "path": str(shapes / "train.jsonl"),
            "eval_path": str(shapes / "heldout.jsonl"),
            "seq_len": 64,
            "images": {"decode_workers": 0},
        },
        parallel={"micro_batch_size": 2, "gradient_accumulation_steps": 2 // dp, **parallel},
        train={"steps": STEPS, "dtype": "fp64", "eval_interval": STEPS},
        checkpoint=ckpt or {},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    from kuangchao_core.data.shapes import make_shape_set

    tmp = tmp_path_factory.mktemp("vlm_engine")
    shapes = tmp / "shapes"
    make_shape_set(shapes, num_train=16, num_heldout=4, seed=1, size=16)
    resume_ckpt = {"dir": str(tmp / "resume_ckpt"), "interval": 2}
    one = {
        "ref": {"cfg": _job(tmp, shapes, "ref", {}, False, {})},
        "ref_frozen_lora": {"cfg": _job(tmp, shapes, "ref_frozen_lora", {}, True, {})},
        "first_two": {"cfg": _job(tmp, shapes, "resume", {}, False, {}, resume_ckpt), "max_steps": 2},
    }
    by_world: dict[int, dict[str, dict]] = {1: one}
    for n, (world, par, frozen, vis) in LAYOUTS.items():
        by_world.setdefault(world, {})[n] = {"cfg": _job(tmp, shapes, n, par, frozen, vis)}
    for name, (layout, sabotage) in {**NEGATIVE, **NEGATIVE_GREEDY}.items():
        world, par, frozen, vis = LAYOUTS[layout]
        by_world[world][name] = {"cfg": _job(tmp, shapes, name, par, frozen, vis), "sabotage": sabotage}
    out: dict[str, list[dict]] = {}
    for world, jobs in sorted(by_world.items()):
        per_rank = run_distributed(run_trainers, world, args=(list(jobs.values()),), timeout=400)
        for i, n in enumerate(jobs):
            out[n] = [per_rank[r][i] for r in range(world)]
    lineage = only_lineage(tmp / "resume_ckpt" / "resume").name
    resumed = _job(
        tmp, shapes, "resume", {"tensor_parallel_size": 2}, False, ENCODER_TP2, {**resume_ckpt, "resume": "auto"}
    )
    per_rank = run_distributed(run_trainers, 2, args=([{"cfg": resumed, "lineage": lineage, "resume": "auto"}],))
    out["resumed_tp2"] = [r[0] for r in per_rank]
    out["tmp"] = tmp  # type: ignore[assignment]
    return out


def _ref(layout: str) -> str:
    return "ref_frozen_lora" if LAYOUTS[layout][2] else "ref"


#: the key projection's bias has a gradient that is zero in exact arithmetic (it adds the same score to every key
#: of a query, and softmax ignores a shift): it starts at zero and AdamW only moves it by its eps-damped rounding
#: noise (about lr x 1e-17 / 1e-8 per step), so its relative difference is meaningless; it is compared absolutely
ZERO_GRADIENT = "self_attn.k_proj.bias"


def _compare(full: dict, ref: dict) -> tuple[str, float]:
    import numpy as np

    name, diff = worst_rel(*({n: v for n, v in d.items() if ZERO_GRADIENT not in n} for d in (full, ref)))
    flat = [(n, float(np.abs(v - ref[n]).max())) for n, v in full.items() if ZERO_GRADIENT in n]
    worst_abs = max(flat, key=lambda x: x[1], default=("", 0.0))
    return (name, diff) if diff >= worst_abs[1] else worst_abs


def _differences(runs, layout: str, got: list[dict], check_replicas: bool = True) -> tuple[float, str, float]:
    ref = runs[_ref(layout)][0]
    loss_diff = max(max_rel_diff(r["losses"], ref["losses"]) for r in got)
    name, param_diff = _compare(gather_full(got, check_replicas=check_replicas), ref["params"])
    return loss_diff, name, param_diff


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_vlm_layout_trains_like_one_process_in_fp64(runs, layout):
    ref = runs[_ref(layout)][0]
    assert len(ref["losses"]) == STEPS and runs["ref"][0]["losses"][-1] < runs["ref"][0]["losses"][0]
    assert any(n.startswith("vision_tower.") for n in ref["params"]) and all(
        p.dtype.name == "float64" for p in ref["params"].values()
    )
    loss_diff, name, param_diff = _differences(runs, layout, runs[layout])
    assert loss_diff <= FP64_REL, f"{layout}: losses differ from one process by {loss_diff:.2e}"
    assert param_diff <= FP64_REL, f"{layout}: {name} differs from one process by {param_diff:.2e}"
    print(f"{layout}: losses within {loss_diff:.1e}, worst parameter {name} {param_diff:.1e} (tolerance {FP64_REL})")
    for r in runs[layout]:
        assert abs(r["eval_loss"] - ref["eval_loss"]) <= FP64_REL * ref["eval_loss"]
        assert r["samples"] == ref["samples"]  # the same greedy answers (and exact match) on every rank


@pytest.mark.parametrize("control", list(NEGATIVE))
def test_vlm_negative_control_fails_the_same_comparison(runs, control):
    layout, _ = NEGATIVE[control]
    loss_diff, name, param_diff = _differences(runs, layout, runs[control], check_replicas=False)
    assert max(loss_diff, param_diff) >= NEGATIVE_MIN, (control, loss_diff, name, param_diff)
    print(f"{control}: losses differ by {loss_diff:.1e}, {name} by {param_diff:.1e}")


def test_frozen_encoder_has_no_gradient_and_keeps_its_weights(runs):
    import numpy as np

    trained, frozen = runs["ref"][0], runs["ref_frozen_lora"][0]
    tower = [n for n in frozen["params"] if n.startswith(("vision_tower.", "multi_modal_projector."))]
    assert tower and not any(n in frozen["first_grads"] for n in tower)
    assert any(n in trained["first_grads"] for n in tower)  # control: a trained encoder has gradients
    # both runs start from the same seed: the trained tower moved away from the frozen one, which is the same at tp2
    tp2 = gather_full(runs["tp2_frozen_lora"])
    moved = [n for n in tower if not np.array_equal(trained["params"][n], frozen["params"][n])]
    assert moved and all(np.array_equal(tp2[n], frozen["params"][n]) for n in tower)


def test_checkpoint_of_one_process_resumes_at_tp2(runs):
    ref, got = runs["ref"][0], runs["resumed_tp2"]
    assert [r["steps_run"] for r in got] == [1, 1]
    assert max_rel_diff(got[0]["losses"][-1:], ref["losses"][-1:]) <= FP64_REL
    name, diff = _compare(gather_full(got), ref["params"])
    assert diff <= FP64_REL, (name, diff)


@pytest.mark.parametrize("control", list(NEGATIVE_GREEDY))
def test_greedy_negative_control_fails_the_same_comparison(runs, control):
    """The control leaves training alone (the parameters equal one process's) yet its greedy answers differ from
    one process's on every rank, so the answers' comparison in the layout test bites."""
    layout, _ = NEGATIVE_GREEDY[control]
    ref = runs[_ref(layout)][0]
    _, name, param_diff = _differences(runs, layout, runs[control])
    assert param_diff <= FP64_REL, (name, param_diff)
    assert all(r["samples"] != ref["samples"] for r in runs[control]), (runs[control][0]["samples"], ref["samples"])


@pytest.mark.parametrize("layout", ["pp2", "pp2_tp2"])
def test_encoder_only_on_the_first_stage(runs, layout):
    """The tower on the first stage's ranks only (its TP group under pp2 x tp2), whose tower parameters are whole
    and equal (the TP sum makes the replicas bitwise equal; ``gather_full`` checks replicas too)."""
    holders = [r for r in runs[layout] if any(n.startswith("vision_tower.") for n in r["params"])]
    assert len(holders) == LAYOUTS[layout][0] // 2
    gather_full(runs[layout])


def test_encoder_tensor_parallel_splits_the_tower(runs):
    """``parallel: tp``: each rank of an encoder TP group holds its half of q/k/v (weights and biases), out_proj's
    and fc2's input columns and fc1's rows; norms and row-parallel biases whole; at decoder tp4 the two encoder
    TP groups {0,1} and {2,3} hold the same slices (share groups {0,2} and {1,3})."""
    layer = "vision_tower.encoder.layers.0."
    split = {
        "self_attn.q_proj.weight": 0,
        "self_attn.v_proj.bias": 0,
        "self_attn.out_proj.weight": 1,
        "mlp.fc1.weight": 0,
        "mlp.fc2.weight": 1,
    }
    for layout, place in (("tp2_encoder_tp2", [0, 1]), ("tp4_encoder_tp2", [0, 1, 0, 1])):
        for rank, (r, at) in enumerate(zip(runs[layout], place, strict=True)):
            for name, dim in split.items():
                meta = r["regions"][layer + name]
                assert meta["shape"][dim] * 2 == meta["full_shape"][dim], (layout, rank, name, meta)
                assert meta["offsets"][dim] == at * meta["shape"][dim], (layout, rank, name, meta)
            for name in ("self_attn.out_proj.bias", "mlp.fc2.bias", "layer_norm1.weight"):
                meta = r["regions"][layer + name]
                assert meta["shape"] == meta["full_shape"], (layout, rank, name, meta)


def test_plan_refuses_a_vision_tower_only_with_sequence_or_context_parallelism():
    """pp2 x tp2 with a vision tower passes the unbuilt check; sequence parallelism (and CP) with it are refused,
    named by ``model.vision``; a text-only job with sequence parallelism is not (the control)."""
    from kuangchao_core.config import config_from_dict
    from kuangchao_core.engine.plan import unbuilt_problems

    def problems(vision, **par):
        model = {"preset": "tiny", **({"vision": vision} if vision else {})}
        par = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, **par}
        return unbuilt_problems(config_from_dict({"task": {"name": "t"}, "model": model, "parallel": par}))

    assert problems(VISION) == []
    refused = problems(VISION, sequence_parallel=True)
    assert [f for f, _ in refused] == ["model.vision"] and "sequence_parallel" in refused[0][1]
    assert problems(None, sequence_parallel=True) == []


@pytest.mark.parametrize("layout", ["tp2", "tp2_frozen_lora", "tp2_encoder_tp2"])
def test_checkpoint_converts_to_a_llava_directory(runs, layout, tmp_path):
    """``kc checkpoint convert --format hf`` of a tp2 VLM checkpoint: a LLaVA directory (read back through
    ``load_hf_llava``, which tests/test_vlm.py checks against transformers) holding the final parameters of the
    one-process run within fp32 rounding (relative 2^-24 per element, so 1e-7 of a tensor's norm); the untrained
    tower layer (``feature_layer`` -2) drawn from the seed equals the model's. A LoRA checkpoint is refused."""
    from kuangchao_core.ckpt.convert import export_hf
    from kuangchao_core.ckpt.hf_llava import load_hf_llava
    from kuangchao_core.errors import CheckpointError
    from kuangchao_core.perm.guard_api import AllowAll, install_guard

    lineage = only_lineage(runs["tmp"] / layout / "ckpt" / layout)
    step = sorted(lineage.glob("step_*"))[-1]
    previous = install_guard(AllowAll())  # offline reads, as `kc checkpoint convert` does them
    try:
        if layout == "tp2_frozen_lora":
            with pytest.raises(CheckpointError, match="LoRA"):
                export_hf(step, tmp_path / "hf")
            return
        model = load_hf_llava(export_hf(step, tmp_path / "hf"))
    finally:
        install_guard(previous)
    got = {n: p.detach().double().numpy() for n, p in model.named_parameters()}
    name, diff = _compare(got, runs["ref"][0]["params"])
    assert diff <= 1e-7, (name, diff)


def test_plan_shows_the_encoder_layout_and_memory():
    """``kc plan`` of a VLM job: the encoder's layout, its parameter count (equal to a built tower's), memory with
    no gradients or optimizer state when frozen, its TP traffic; a text-only job has no encoder section."""
    from kuangchao_core.config import config_from_dict
    from kuangchao_core.engine.plan import explain_plan, format_plan
    from kuangchao_core.models.vision import VisionTower, vision_config
    from kuangchao_core.models.vision_tp import shard_tower

    def plan(vision, tp=2):
        model = {"preset": "tiny"} if vision is None else {"preset": "tiny", "vision": vision}
        par = {"tensor_parallel_size": tp, "micro_batch_size": 3}
        return explain_plan(config_from_dict({"task": {"name": "t"}, "model": model, "parallel": par}))

    got = plan(VISION)["vision"]
    built = sum(p.numel() for p in VisionTower(vision_config(VISION, 256)).parameters())
    assert got["parameters"]["tower"] == built and got["images_per_rank_per_micro_batch"] == 2
    assert got["memory_bytes"]["optimizer"] == 2 * got["memory_bytes"]["params"] > 0
    assert got["traffic_bytes_per_step"]["feature_all_gather_tp"] > 0
    frozen = plan({**VISION, "freeze": True})["vision"]["memory_bytes"]
    assert frozen["grads"] == frozen["optimizer"] == 0 and frozen["params"] == got["memory_bytes"]["params"]
    assert "vision encoder (data parallel)" in format_plan(plan(VISION))
    assert plan(None)["vision"] is None and "vision encoder" not in format_plan(plan(None))
    # parallel: tp — per-rank tower parameters equal a split tower's (split while built: no collective runs), the
    # images shared only between encoder TP groups, the hidden states all-reduced inside each
    split = shard_tower(VisionTower(vision_config(VISION, 256)), SimpleNamespace(size=2, rank=1))
    per_rank = sum(p.numel() for p in split.parameters())
    assert per_rank < built
    for tp, images, shared in ((2, 3, False), (4, 2, True)):
        got = plan({**VISION, "parallel": "tp", "tensor_parallel_size": 2}, tp)["vision"]
        assert got["parameters"]["tower_per_rank"] == per_rank and got["images_per_rank_per_micro_batch"] == images
        traffic = got["traffic_bytes_per_step"]
        assert traffic["hidden_all_reduce_encoder_tp"] > 0
        assert (traffic["gradient_all_reduce_tp"] > 0) == (traffic["feature_all_gather_tp"] > 0) == shared
    assert "vision encoder (tensor parallel 2)" in format_plan(plan({**VISION, "parallel": "tp"}))


def test_encoder_tensor_parallel_refusals_name_the_field():
    """The config refuses an encoder TP size that does not divide the decoder's, heads or MLP width it cannot split,
    and a TP size under ``parallel: data``, each naming its ``model.vision.…`` field; the engine's layout refuses
    the same (PlanError). Control: a layout that fits has no error."""
    from kuangchao_core.config import config_from_dict
    from kuangchao_core.engine.vlm_layout import encoder_layout
    from kuangchao_core.errors import ConfigError

    def fields(vision, tp=2):
        model = {"preset": "tiny", "vision": {**VISION, **vision}}
        try:
            config_from_dict({"task": {"name": "t"}, "model": model, "parallel": {"tensor_parallel_size": tp}})
        except ConfigError as exc:
            return {path for path, _ in exc.errors}
        return set()

    tp = {"parallel": "tp"}
    assert fields({**tp, "tensor_parallel_size": 4, "num_heads": 4}) == {"model.vision.tensor_parallel_size"}
    assert fields({**tp, "num_heads": 1}) == {"model.vision.num_heads"}
    assert fields({**tp, "intermediate_size": 63}) == {"model.vision.intermediate_size"}
    assert fields({"tensor_parallel_size": 2}) == {"model.vision.tensor_parallel_size"}
    assert fields(tp) == fields({**tp, "tensor_parallel_size": 1}) == fields({}, tp=1) == set()
    assert fields({**tp, "tensor_parallel_size": 2}, tp=4) == set()
    with pytest.raises(PlanError, match="model.vision.num_heads"):
        encoder_layout(
            SimpleNamespace(**tp, tensor_parallel_size=None, num_heads=1, intermediate_size=64), SimpleNamespace(tp=2)
        )
