"""``kc train``'s preparation of a job that starts from a LLaVA directory (issue 31), run for real, no training.

The directory is what transformers writes for a ``LlavaConfig`` (``config.json`` only: nothing here reads weights):
a CLIP tower of 2 heads and MLP width 66 — not the ``model.vision`` section's defaults (4 heads, width 256), so a
check that used the defaults instead of the directory would pass where these fail.

- The flow's phase one (``job/prepare.prepare_run``) writes the config every rank reads with ``model.vision: {}``
  resolved to the directory's tower; the ranks' own resolution (``with_pretrained_vision``) and plan check accept
  it. Control: the preparation without the resolution writes the section's defaults, which the ranks refuse.
- The encoder TP size (``model.vision.parallel: tp``) is checked against the directory's heads and MLP width before
  launch (``kc train``'s ``refuse_early`` and ``prepare_run``, through ``engine.plan.check_plan``), naming the field
  that set the size and the directory's value. Controls: a size dividing both passes; without the check
  (``plan_vision.pretrained_tower_problems`` removed) ``kc train`` lets the impossible split through to launch.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kuangchao_core.config import ConfigError, load_config
from kuangchao_core.errors import PlanError
from tests.fixtures import hf_llama_config, tiny_llama

transformers = pytest.importorskip("transformers")
yaml = pytest.importorskip("yaml")

HEADS, MLP = 2, 66  # 4 divides neither (the defaults 4 and 256 it does); 2 divides both


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A LLaVA ``config.json`` as transformers writes it (tiny Llama decoder, 16 px CLIP tower)."""
    path = tmp_path_factory.mktemp("llava_prepare") / "hf"
    vc = transformers.CLIPVisionConfig(
        num_attention_heads=HEADS, intermediate_size=MLP, image_size=16, patch_size=8, hidden_size=32
    )
    tc = hf_llama_config(tiny_llama())
    transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=255).save_pretrained(path)
    return path


def _config_file(tmp: Path, hf_dir: Path, vision: dict, tp: int = 1) -> Path:
    """A job file as a user writes it: only what the job sets (``model.vision`` fields absent take the directory's)."""
    job = {
        "task": {"name": "llava-prepare", "seed": 7},
        "model": {"checkpoint": str(hf_dir), "vision": vision},
        "data": {"format": "synthetic", "seq_len": 32},
        "parallel": {"tensor_parallel_size": tp, "backend": "gloo"},
        "train": {"steps": 2, "device": "cpu"},
        "permission": {"mode": "trusted"},
        "checkpoint": {"dir": str(tmp / "ckpt"), "resume": "never"},
        "tracking": {"uri": f"sqlite:///{tmp}/mlflow.db"},
    }
    path = tmp / f"job-{len(list(tmp.glob('job-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return path


def _prepare(config: Path, monkeypatch, tmp: Path):
    """``kc train``'s phase one as the flow calls it (``flows/train.py``), the runs under ``tmp``."""
    from kuangchao_core.job.prepare import prepare_run

    monkeypatch.setenv("KC_RUNS_DIR", str(tmp / "runs"))
    cfg = load_config(config)  # as the flow loads the user's file
    return prepare_run(cfg, {}, None, None, "error", None, logging.getLogger("test"), [])


def _written_tower(resolved: Path) -> tuple:
    """The tower the ranks' config describes: heads, MLP width, image size, width, placeholder token."""
    v = load_config(resolved).model.vision
    return v.num_heads, v.intermediate_size, v.image_size, v.hidden_size, v.image_token_id


def _ranks_build(resolved: Path) -> None:
    """What a rank does with the written config before it builds: read it, check the plan, resolve the tower."""
    from kuangchao_core.config.settings import run_settings
    from kuangchao_core.engine.plan import raise_for_plan
    from kuangchao_core.engine.vlm_model import with_pretrained_vision

    read = load_config(resolved)
    raise_for_plan(read, 1)  # engine/worker.py
    assert with_pretrained_vision(run_settings(read)).model.vision == read.model.vision  # engine/trainer.py


def test_prepare_writes_the_directorys_tower_into_the_ranks_config(hf_dir, tmp_path, monkeypatch):
    directory = (HEADS, MLP, 16, 32, 255)
    job = _prepare(_config_file(tmp_path, hf_dir, {}), monkeypatch, tmp_path)
    assert _written_tower(job.resolved) == directory
    _ranks_build(job.resolved)
    # control: the preparation without the resolution writes the section's defaults, and the ranks refuse them
    import kuangchao_core.job.prepare as prepare

    monkeypatch.setattr(prepare, "pretrained_vision", lambda model: model.vision)
    unresolved = _prepare(_config_file(tmp_path, hf_dir, {}), monkeypatch, tmp_path / "control")
    assert _written_tower(unresolved.resolved) == (4, 256, 32, 64, None)  # the section's defaults
    with pytest.raises(ConfigError, match="model.vision"):
        _ranks_build(unresolved.resolved)


def test_encoder_tp_size_checked_against_the_directorys_tower_before_launch(hf_dir, tmp_path, monkeypatch):
    from kuangchao.cli.train import refuse_early  # kc train's checks before any Prefect run starts

    for vision, field in (
        ({"parallel": "tp", "tensor_parallel_size": 4}, "model.vision.tensor_parallel_size"),
        ({"parallel": "tp"}, "parallel.tensor_parallel_size"),  # unset: the decoder's TP size 4
    ):
        config = _config_file(tmp_path, hf_dir, vision, tp=4)
        load_config(config)  # the config's own checks cannot see the directory's sizes
        with pytest.raises(PlanError) as info:
            refuse_early(str(config), [], None, "error")
        errors = [(p, m) for p, m in info.value.errors if p == field]
        assert len(errors) == 2, info.value.errors
        (_, heads), (_, mlp) = errors
        assert f"num_heads {HEADS} in {hf_dir}" in heads and "vision_config.num_attention_heads" in heads
        assert f"intermediate_size {MLP} in {hf_dir}" in mlp and "vision_config.intermediate_size" in mlp
        assert heads.startswith("the encoder's TP size 4 ") and heads.endswith("one that fits: 1, 2")
        with pytest.raises(PlanError, match=field):  # the flow's phase one too, before it makes a run directory
            _prepare(config, monkeypatch, tmp_path)
        assert not (tmp_path / "runs").exists()
    # control: a size dividing the directory's heads and MLP width passes
    refuse_early(
        str(_config_file(tmp_path, hf_dir, {"parallel": "tp", "tensor_parallel_size": 2}, tp=4)), [], None, "error"
    )
    # control: without the check, kc train lets the impossible split through (the trainer refused it after launch)
    import kuangchao_core.engine.plan as plan
    from kuangchao_core.config.vision_schema import vision_layout_errors
    from kuangchao_core.engine.vlm_model import pretrained_vision

    monkeypatch.setattr(plan, "pretrained_tower_problems", lambda cfg: [])
    config = _config_file(tmp_path, hf_dir, {"parallel": "tp", "tensor_parallel_size": 4}, tp=4)
    refuse_early(str(config), [], None, "error")
    assert vision_layout_errors(pretrained_vision(load_config(config).model), 4)  # encoder_layout's, in the ranks
