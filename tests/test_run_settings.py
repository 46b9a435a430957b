"""The run's typed settings (issue 28, a shorter config walk): the worker builds them once from the validated config
(``kuangchao_core.config.settings``) and the step loop's modules read those, never the config's fields."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kuangchao_core.config.settings import lineage_key, run_settings
from tests.engine_helpers import tiny_job

ROOT = Path(__file__).resolve().parent.parent
#: the modules between the worker's settings and the step: none of them may read a field of the raw config
STEP_LOOP = (
    "kuangchao_core/engine/trainer.py",
    "kuangchao_core/engine/checkpointing.py",
    "kuangchao_core/engine/parallel_model.py",
    "kuangchao_core/engine/evaluation.py",
    "kuangchao_core/engine/live_config.py",
    "kuangchao_core/parallel/grad_sync.py",
    "kuangchao_core/parallel/mixed_precision.py",
    "kuangchao_core/ckpt/lineage.py",
    "kuangchao_core/ckpt/lineage_lease.py",
)


def raw_config_reads(text: str) -> list[str]:
    """Every ``cfg.<section>...`` read and every ``cfg`` name in ``text`` (``llama_cfg`` and the like are others)."""
    return re.findall(r"\bcfg\b(?:\.\w+)*", text)


def test_settings_carry_the_configs_values(tmp_path):
    cfg = tiny_job(
        str(tmp_path),
        parallel={"micro_batch_size": 2, "gradient_accumulation_steps": 3, "zero_stage": 1, "backend": "gloo"},
        train={"steps": 9, "warmup_steps": 2, "device": "cpu", "log_interval": 4, "dtype": "fp16"},
        checkpoint={"dir": str(tmp_path / "ck"), "interval": 5, "keep_last": 2, "async": True, "resume": "never"},
    )
    run = run_settings(cfg)
    assert (run.train.steps, run.train.warmup_steps, run.train.log_interval, run.train.seed) == (9, 2, 4, 7)
    assert run.train.lr == pytest.approx(3e-3) and run.grad_sync.weight_decay == pytest.approx(0.01)
    assert (run.batches.micro_batch_size, run.batches.gradient_accumulation_steps) == (2, 3)
    assert run.grad_sync.zero_stage == run.build.zero_stage == 1 and run.build.lora is None
    assert run.precision.dtype == run.build.dtype == "fp16"
    ck = run.checkpoint
    assert (ck.dir, ck.task, ck.interval, ck.keep_last, ck.async_) == (str(tmp_path / "ck"), "t", 5, 2, True)
    assert ck.config_hash == cfg.config_hash() and ck.lineage == lineage_key(cfg)
    assert run.batches.no_eval_reason == ""  # the synthetic corpus holds out 16 problems
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.train.steps = 10  # built once; nothing downstream changes them


def test_lineage_key_fingerprints_model_data_and_seed_not_steps(tmp_path):
    base = lineage_key(tiny_job(str(tmp_path)))
    longer = lineage_key(tiny_job(str(tmp_path), train={"steps": 80, "device": "cpu"}))
    reseeded = lineage_key(tiny_job(str(tmp_path), task={"name": "t", "seed": 8}))
    assert longer.fingerprint == base.fingerprint and longer.steps == 80 != base.steps
    assert reseeded.fingerprint != base.fingerprint


def test_no_held_out_data_is_said_with_its_field(tmp_path):
    cfg = tiny_job(str(tmp_path), data={"format": "synthetic", "seq_len": 32, "synthetic": {"num_eval": 0}})
    assert run_settings(cfg).batches.no_eval_reason == "data.synthetic.num_eval is 0"


def test_the_step_loop_modules_never_read_the_raw_config():
    found = {f: raw_config_reads((ROOT / f).read_text(encoding="utf-8")) for f in STEP_LOOP}
    assert not {f: reads for f, reads in found.items() if reads}


def test_the_raw_config_check_sees_a_read():
    """Negative control: the check above finds a field read, a whole-config parameter, and skips ``llama_cfg``."""
    assert raw_config_reads("steps = cfg.train.steps\nx = llama_cfg.hidden_size") == ["cfg.train.steps"]
    assert raw_config_reads("def f(cfg, mesh):") == ["cfg"]
