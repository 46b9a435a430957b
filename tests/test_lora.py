"""LoRA (issue 14 §4): adapters trained at every layout equal one process, the base stays bitwise frozen, checkpoints
hold the adapters and the base's identity, and the PEFT export loads in ``peft`` with our logits.

The base is a tiny random ``transformers.LlamaForCausalLM`` (2 layers, grouped-query attention) saved with
``save_pretrained``; every job fine-tunes it (``model.checkpoint``) with adapters on all seven projections, rank 4:

- fp64: the losses and the gathered adapters of tp2, dp2 with ZeRO-1, dp2×pp2, tp4 (key/value heads replicated over
  TP ranks) and dp2×tp2 with ``zero_stage: 3`` (the base sharded too) equal one process within ``FP64_REL``; fp32: the
  losses of tp2 and dp2×pp2 within ``FP32_LOSS_REL`` (tolerances from the arithmetic, tests/tolerances.py);
- negative control: at tp2 the replicated ``A`` of a column-parallel projection without its gradient summed over
  TP fails the same comparison;
- the base parameters after training are the Hugging Face tensors bit for bit in every layout, and only adapters
  have gradients, optimizer state and checkpoint tensors; a step written at tp2 resumes at dp2 and continues the
  one-process run;
- the PEFT export (``kc checkpoint convert --format peft``) loads with ``peft.PeftModel.from_pretrained`` onto
  ``transformers.LlamaForCausalLM`` with our adapted model's logits; the merged export (``--format hf``) gives them
  as a plain transformers model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from kuangchao.cli.main import app
from kuangchao_core.ckpt.layout import shard_name
from kuangchao_core.ckpt.lineage import new_lineage_id
from kuangchao_core.config.unused import unused_settings
from tests.engine_helpers import gather_full, run_trainers, save_random_hf_llama, tiny_job
from tests.mp import run_distributed
from tests.tolerances import FP32_LOSS_REL, FP64_REL, NEGATIVE_MIN, assert_logits_match, rel_norm, worst_rel

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 4
#: logits of two implementations with 2 layers: (2L+1) fp32 RMSNorms at ~5e-7 each (tests/tolerances.py, HF_REL)
PEFT_REL = 1e-5


def _save_hf_model(path: Path, seed: int = 5):
    return save_random_hf_llama(path, 2, seed)


def _job(root: Path, hf_dir: Path, parallel: dict, dtype: str = "fp64", interval: int = 100):
    return tiny_job(
        str(root),
        task={"name": "lora", "seed": 3},
        model={
            "preset": None,
            "num_layers": None,
            "checkpoint": str(hf_dir),
            "lora": {"rank": 4, "alpha": 8, "targets": TARGETS},
        },
        data={"seq_len": 16},
        parallel={"micro_batch_size": 2, "gradient_accumulation_steps": 2, **parallel},
        train={"steps": STEPS, "warmup_steps": 0, "dtype": dtype},
        optimizer={"lr": 1e-2},
        checkpoint={"interval": interval},
    )


#: the one-process global batch (2 sequences × 2 micro-batches) at dp2: 1 × 2 per replica
DP2 = {"micro_batch_size": 1}
FP64_LAYOUTS = {
    "tp2": (2, {"tensor_parallel_size": 2}),
    "dp2_zero1": (2, {"data_parallel_size": 2, "zero_stage": 1, **DP2}),
    "dp2pp2": (4, {"data_parallel_size": 2, "pipeline_parallel_size": 2, **DP2}),
    "tp4": (4, {"tensor_parallel_size": 4}),
    "dp2tp2_zero3": (4, {"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3, **DP2}),
}
FP32_LAYOUTS = {"tp2": (2, {"tensor_parallel_size": 2}), "dp2pp2": FP64_LAYOUTS["dp2pp2"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    hf_dir = tmp / "hf"
    hf = _save_hf_model(hf_dir)
    out: dict = {"hf": hf, "hf_dir": hf_dir, "tmp": tmp, "fp64": {}, "fp32": {}}
    one = run_distributed(
        run_trainers,
        1,
        args=([{"cfg": _job(tmp / "one64", hf_dir, {})}, {"cfg": _job(tmp / "one32", hf_dir, {}, "fp32")}],),
    )[0]
    out["ref64"], out["ref32"] = one
    out["ref_root"] = tmp / "one64"
    for world in (2, 4):
        jobs, labels = [], []
        for label, (w, par) in FP64_LAYOUTS.items():
            if w == world:
                labels.append(("fp64", label))
                jobs.append({"cfg": _job(tmp / f"{label}64", hf_dir, par)})
        for label, (w, par) in FP32_LAYOUTS.items():
            if w == world:
                labels.append(("fp32", label))
                jobs.append({"cfg": _job(tmp / f"{label}32", hf_dir, par, "fp32")})
        if world == 2:
            lineage = new_lineage_id()
            step2 = tmp / "resume_src" / "ckpt" / "lora" / lineage / "step_00000002"
            labels += [("control", "tp2"), ("resume_src", "tp2"), ("resumed", "dp2")]
            jobs += [
                {"cfg": _job(tmp / "control", hf_dir, FP64_LAYOUTS["tp2"][1]), "sabotage": "unsummed_lora_a"},
                {"cfg": _job(tmp / "resume_src", hf_dir, FP64_LAYOUTS["tp2"][1], interval=2), "lineage": lineage},
                {"cfg": _job(tmp / "resumed", hf_dir, {"data_parallel_size": 2, **DP2}), "resume": str(step2)},
            ]
            out["step2"] = step2
        per_rank = run_distributed(run_trainers, world, args=(jobs,), timeout=400)
        for j, (kind, label) in enumerate(labels):
            out.setdefault(kind, {})[label] = [per_rank[r][j] for r in range(world)]
    return out


def _adapters(params: dict) -> dict:
    return {n: v for n, v in params.items() if ".lora_" in n}


def _ref_step(runs) -> Path:
    steps = sorted((runs["ref_root"] / "ckpt" / "lora").glob("run-*/step_*"))
    assert steps, "the one-process LoRA run wrote no checkpoint"
    return steps[-1]


@pytest.mark.parametrize("layout", sorted(FP64_LAYOUTS))
def test_lora_layout_trains_like_one_process_in_fp64(runs, layout):
    results = runs["fp64"][layout]
    ref = runs["ref64"]
    losses = np.array(results[0]["losses"])
    assert rel_norm(losses, ref["losses"]) <= FP64_REL, (losses, ref["losses"])
    got = _adapters(gather_full(results))
    want = _adapters(ref["params"])
    assert len(want) == 2 * len(TARGETS) * 2  # A and B of seven projections in two layers
    name, worst = worst_rel(got, want)
    assert worst <= FP64_REL, f"{layout}: {name} differs by {worst:.2e}"
    moved = rel_norm(want["model.layers.1.mlp.down_proj.lora_B.weight"], np.zeros(1))
    assert moved > 0, "B never left zero: the adapters did not train"


@pytest.mark.parametrize("layout", sorted(FP32_LAYOUTS))
def test_lora_layout_losses_match_one_process_in_fp32(runs, layout):
    losses = np.array(runs["fp32"][layout][0]["losses"])
    assert rel_norm(losses, runs["ref32"]["losses"]) <= FP32_LOSS_REL


def test_negative_control_unsummed_adapter_gradient_fails_the_comparison(runs):
    got = _adapters(gather_full(runs["control"]["tp2"], check_replicas=False))
    _, worst = worst_rel(got, _adapters(runs["ref64"]["params"]))
    assert worst >= NEGATIVE_MIN, worst


@pytest.mark.parametrize("layout", sorted(FP64_LAYOUTS))
def test_base_weights_stay_bitwise_the_hf_weights(runs, layout):
    hf_state = {n: p.detach().double().numpy() for n, p in runs["hf"].named_parameters()}
    full = gather_full(runs["fp64"][layout])
    base = {n: v for n, v in full.items() if ".lora_" not in n}
    assert set(base) == set(hf_state)
    for name, value in base.items():
        np.testing.assert_array_equal(value, hf_state[name], err_msg=f"{layout}: base {name} changed")


def test_only_adapters_have_gradients_optimizer_state_and_checkpoint_tensors(runs):
    adapters = set(_adapters(runs["ref64"]["params"]))
    for res in runs["fp64"]["tp2"]:
        assert set(res["first_grads"]) == {n for n in res["regions"] if ".lora_" in n}
    step = _ref_step(runs)
    with safe_open(str(step / shard_name(0)), framework="pt") as shard:
        keys = set(shard.keys())
    params = {k.removeprefix("param.") for k in keys if k.startswith("param.")}
    assert params == adapters
    optim = {k.removeprefix("optim.").rsplit(".", 1)[0] for k in keys if k.startswith("optim.")}
    assert optim == adapters
    manifest = json.loads((step / "manifest.json").read_text())
    lora = manifest["lora"]
    assert (lora["rank"], lora["alpha"], sorted(lora["targets"])) == (4, 8.0, sorted(TARGETS))
    h = hashlib.sha256()
    hf_dir = runs["hf_dir"]
    for f in [hf_dir / "config.json", *sorted(hf_dir.glob("*.safetensors"))]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    assert lora["base"] == {"source": str(hf_dir), "sha256": h.hexdigest()}


def test_lora_checkpoint_resumes_in_another_layout_and_continues(runs):
    resumed = runs["resumed"]["dp2"]
    ref = runs["ref64"]
    assert resumed[0]["steps_run"] == STEPS - 2
    assert rel_norm(resumed[0]["losses"], ref["losses"]) <= FP64_REL
    _, worst = worst_rel(_adapters(gather_full(resumed)), _adapters(ref["params"]))
    assert worst <= FP64_REL


def test_resume_on_another_base_is_refused_naming_both(runs, tmp_path):
    other = tmp_path / "other_hf"
    _save_hf_model(other, seed=11)
    cfg = _job(tmp_path / "other", other, {})
    with pytest.raises(RuntimeError, match="adapters were trained on the base"):
        run_distributed(run_trainers, 1, args=([{"cfg": cfg, "resume": str(_ref_step(runs))}],))


def _our_logits(runs, ids: torch.Tensor) -> torch.Tensor:
    from kuangchao_core.ckpt.hf import load_hf_weights_for_layout
    from kuangchao_core.models.layout import TargetLayout
    from kuangchao_core.models.llama import LlamaForCausalLM, load_hf_llama_config
    from kuangchao_core.models.lora import LoraSettings, attach_lora

    cfg = load_hf_llama_config(runs["hf_dir"])
    model = LlamaForCausalLM(cfg)
    attach_lora(model, LoraSettings(4, 8.0, 0.0, tuple(TARGETS)), TargetLayout().param_slices(cfg), 0)
    weights = load_hf_weights_for_layout(runs["hf_dir"], cfg)
    weights.update({n: torch.from_numpy(v) for n, v in _adapters(runs["ref64"]["params"]).items()})
    model.load_state_dict(weights)
    with torch.no_grad():
        return model.double().eval()(ids)


def test_peft_export_loads_in_peft_with_our_logits(runs, tmp_path):
    out = tmp_path / "adapter"
    result = CliRunner().invoke(app, ["checkpoint", "convert", str(_ref_step(runs)), str(out), "--format", "peft"])
    assert result.exit_code == 0, result.output
    base = transformers.LlamaForCausalLM.from_pretrained(runs["hf_dir"], attn_implementation="eager")
    model = peft.PeftModel.from_pretrained(base, out).double().eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
        plain = transformers.LlamaForCausalLM.from_pretrained(runs["hf_dir"]).double().eval()(input_ids=ids).logits
    ours = _our_logits(runs, ids)
    assert_logits_match(theirs, ours, rel=PEFT_REL)
    # negative control: the base without the adapters is far from the adapted logits
    assert float((plain - ours).abs().max() / ours.abs().max()) >= NEGATIVE_MIN


def test_job_end_export_of_a_lora_run_is_the_peft_adapters_with_the_tokenizer(runs, tmp_path):
    from kuangchao_core.engine.release import export_model
    from kuangchao_core.perm import guard_api

    previous = guard_api.install_guard(guard_api.AllowAll())  # as the flow, the job's authority, exports
    try:
        record = export_model(_ref_step(runs), tmp_path / "model", "byte", 128)
    finally:
        guard_api.install_guard(previous)
    assert record["format"] == "peft"
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= set(record["files"])
    assert "model.safetensors" not in record["files"]


def test_merged_export_is_a_plain_hf_model_with_the_adapted_logits(runs, tmp_path):
    out = tmp_path / "merged"
    result = CliRunner().invoke(app, ["checkpoint", "convert", str(_ref_step(runs)), str(out), "--format", "hf"])
    assert result.exit_code == 0, result.output
    merged = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").double().eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = merged(input_ids=ids).logits
    assert_logits_match(theirs, _our_logits(runs, ids), rel=PEFT_REL)


def test_zero3_with_lora_is_not_said_to_run_as_zero2(tmp_path):
    par = {"data_parallel_size": 2, "zero_stage": 3}
    for train in ({}, {"dtype": "bf16", "param_dtype": "bf16"}):  # the base is sharded (tests/test_zero3_lora.py)
        cfg = tiny_job(str(tmp_path), model={"lora": {"rank": 2}}, parallel=par, train=train)
        assert "parallel.zero_stage" not in dict(unused_settings(cfg))
