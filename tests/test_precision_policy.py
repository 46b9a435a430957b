"""Precision is a policy the optimizers are given, not a class per precision (issue 43 item 2).

- No ``class Master…`` anywhere in ``kuangchao_core``, and every optimizer's class chain is single inheritance
  (no diamond): the old ``MasterLoraZero3Optimizer(LoraZero3Optimizer, MasterZero3Optimizer)`` is gone.
- ``train.param_dtype`` and ``parallel.grad_reduce_dtype`` become one frozen ``PrecisionPolicy``.
- At every ZeRO stage (0, 1, 2, 3) the job with bf16 parameters runs the *same* optimizer classes as the fp32 job;
  only the policy differs, and it bites: after two steps the fp32 masters AdamW steps hold bits a bf16 parameter
  cannot (they differ from their bf16 rounding, which is what the model computes with), while without masters
  AdamW steps the model's fp32 parameters themselves (the same values inside and outside ``full_parameters``) —
  the negative control of the same comparison.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from kuangchao_core.config.settings import GradSyncSettings
from kuangchao_core.parallel.grad_sync import ReplicatedAdamW, ShardedAdamW
from kuangchao_core.parallel.precision_policy import PrecisionPolicy, precision_policy
from kuangchao_core.parallel.zero import ZeroOptimizer
from kuangchao_core.parallel.zero3 import Zero3Optimizer
from kuangchao_core.parallel.zero3_lora import LoraZero3Optimizer
from tests.engine_helpers import tiny_job
from tests.mp import run_distributed

CORE = Path(__file__).resolve().parent.parent / "kuangchao_core"
SETTINGS = GradSyncSettings(
    lr=1e-3,
    betas=(0.9, 0.999),
    eps=1e-8,
    weight_decay=0.0,
    weight_decay_exclude=(),
    zero_stage=0,
    bucket_size_mb=25.0,
    grad_compression="none",
    grad_reduce_dtype="fp32",
    topk_ratio=0.01,
    topk_warmup_steps=0,
)


def test_no_master_class_and_no_diamond():
    found = [
        f"{f.relative_to(CORE)}: {m.group(0).strip()}"
        for f in sorted(CORE.rglob("*.py"))
        for m in re.finditer(r"^\s*class Master\w*", f.read_text(encoding="utf-8"), re.M)
    ]
    assert found == [], found
    assert re.search(r"^\s*class Master\w*", "class Ok:\n    pass\n\nclass MasterX(Ok):\n", re.M)  # the grep bites
    for cls in (ReplicatedAdamW, ShardedAdamW, ZeroOptimizer, Zero3Optimizer, LoraZero3Optimizer):
        assert all(len(c.__bases__) == 1 for c in cls.__mro__[:-1]), cls.__mro__


def test_the_policy_comes_from_the_config_fields():
    assert precision_policy(SETTINGS) == PrecisionPolicy()
    assert not precision_policy(SETTINGS).masters
    bf16 = dataclasses.replace(SETTINGS, param_dtype="bf16")
    assert precision_policy(bf16) == PrecisionPolicy(torch.bfloat16, torch.float32, torch.float32)
    reduce16 = dataclasses.replace(bf16, grad_reduce_dtype="bf16")
    assert precision_policy(reduce16) == PrecisionPolicy(torch.bfloat16, torch.bfloat16, torch.float32)
    fp32_reduce16 = dataclasses.replace(SETTINGS, grad_reduce_dtype="bf16")  # ZeRO of fp32 parameters ignores it
    assert precision_policy(fp32_reduce16) == PrecisionPolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        precision_policy(bf16).master_dtype = None


def _seen(rank: int, world_size: int, cfgs: list) -> list[dict]:
    from tests.engine_helpers import trainer_in_process

    out = []
    for cfg in cfgs:
        trainer = trainer_in_process(cfg, rank, world_size)
        trainer.run(resume="never")
        sync = trainer.sync
        stepped = [p for g in sync.param_groups for p in g["params"]]
        opt = getattr(sync, "optimizer", None)
        with sync.full_parameters():
            inside = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        if type(opt).__name__ == "Zero3Optimizer":  # outside the block ZeRO-3 keeps what the forward gathers
            outside = {"shard": opt.param_shard.detach().clone()}
            inside = {"shard": opt.flat_shard.detach().clone()}
        else:
            outside = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        out.append(
            {
                "classes": (type(sync).__name__, type(opt).__name__),
                "stepped_dtypes": sorted({str(p.dtype) for p in stepped}),
                "outside_dtypes": sorted({str(t.dtype) for t in outside.values()}),
                "rounded_is_outside": all(torch.equal(inside[n].to(outside[n].dtype), outside[n]) for n in outside),
                "inside_beyond_outside": sum(int((inside[n] != outside[n].to(inside[n].dtype)).sum()) for n in outside),
            }
        )
        trainer.barrier()
    return out


def test_one_optimizer_class_per_stage_and_the_policy_decides_the_masters(tmp_path):
    cfgs = {
        (stage, param): tiny_job(
            str(tmp_path / f"z{stage}{param}"),
            parallel={"data_parallel_size": 1, "zero_stage": stage},
            train={"steps": 2, "warmup_steps": 1, "dtype": "bf16", "param_dtype": param},
        )
        for stage in (0, 1, 2, 3)
        for param in ("fp32", "bf16")
    }
    seen = dict(zip(cfgs, run_distributed(_seen, 1, args=(list(cfgs.values()),), timeout=300)[0], strict=True))
    for stage in (0, 1, 2, 3):
        plain, masters = seen[(stage, "fp32")], seen[(stage, "bf16")]
        assert plain["classes"] == masters["classes"], stage  # one optimizer path per stage
        assert plain["stepped_dtypes"] == masters["stepped_dtypes"] == ["torch.float32"], stage
        assert plain["outside_dtypes"] == ["torch.float32"] and masters["outside_dtypes"] == ["torch.bfloat16"]
        assert plain["rounded_is_outside"] and masters["rounded_is_outside"], stage
        assert plain["inside_beyond_outside"] == 0, stage  # no masters: AdamW stepped the parameters themselves
        assert masters["inside_beyond_outside"] > 0, stage  # fp32 masters below a bf16 parameter's resolution
