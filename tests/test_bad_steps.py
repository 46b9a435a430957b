"""No non-finite step is ever applied (issue 25): a step whose loss or gradient norm is NaN/inf is skipped on every
rank, counted, and ``train.max_bad_steps`` of them in a row stop the run at its last good checkpoint.

The NaN is real: a forward hook on one rank's embedding turns that rank's activations of one step into NaN, which
flows through the loss, the backward and the data-parallel reduction. The poisoned run's weights must equal — bit
for bit, the same operations in the same order — a clean run whose optimizer was not called at that step.
Negative control: the same poisoned run with the finiteness check disabled ends with NaN weights (and, since issue 26,
is stopped before it can save them). These runs keep training past a NaN loss: ``loss_nan: warn`` or ``checkpoint``
(the default action, ``stop``, ends the run at the first one: tests/test_diverged_run.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tests.engine_helpers import tiny_job
from tests.mp import run_distributed

BAD_AT = 3  # the poisoned step (1-based)


def _job(tmp_path, name: str, dtype: str, **train):
    train = {"anomaly": {"actions": {"loss_nan": "warn"}}, **train}  # train on past a NaN loss (skipping it)
    return tiny_job(
        str(tmp_path / name),
        task={"name": name, "seed": 7},
        parallel={"data_parallel_size": 2, "micro_batch_size": 2},
        train={"steps": 6, "dtype": dtype, **train},
    )


def _params(model) -> dict[str, np.ndarray]:
    return {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()}


def _run(rank: int, world_size: int, jobs: list[tuple[str, object, set[int]]]) -> dict:
    import torch

    from kuangchao_core.engine import trainer as trainer_mod
    from tests.engine_helpers import trainer_in_process

    out = {}
    honest = trainer_mod.step_is_finite
    for mode, cfg, poisoned in jobs:
        trainer = trainer_in_process(cfg, rank, world_size)
        result: dict = {"before_bad": None}
        if rank == 1:  # one rank's activations turn NaN: every rank must still skip the step

            def poison(_module, _inputs, output, _t=trainer, _at=poisoned):
                return output * float("nan") if _t.state.step + 1 in _at else output

            trainer.model.model.embed_tokens.register_forward_hook(poison)
        if mode == "reference":  # the clean run whose optimizer is not called at the poisoned step
            step = trainer.sync.step
            trainer.sync.step = lambda _t=trainer, _s=step: None if _t.state.step + 1 == BAD_AT else _s()
        plain_step = trainer.train_step

        def recording(batches, _plain=plain_step, _t=trainer, _r=result):
            res = _plain(batches)
            if res.step == BAD_AT - 1:
                _r["before_bad"] = _params(_t.model)
            return res

        trainer.train_step = recording
        trainer_mod.step_is_finite = (lambda *_: True) if mode == "unguarded" else honest
        try:
            state = trainer.run(resume="never")
            result["stopped"] = None
        except (trainer_mod.BadStepsStop, trainer_mod.AnomalyStop) as exc:  # AnomalyStop: NaN weights never saved
            state, result["stopped"] = trainer.state, str(exc)
        finally:
            trainer_mod.step_is_finite = honest
        result.update(
            losses=list(state.losses),
            params=_params(trainer.model),
            skipped=trainer.precision.skipped_steps,
            metric=trainer.precision.metrics()["skipped_steps"],
        )
        step_dirs = sorted(p for p in Path(cfg.checkpoint.dir).rglob("step_*") if p.is_dir())
        result["checkpoints"] = [p.name for p in step_dirs]
        if mode == "checkpoint_action":  # what the anomaly's checkpoint at the bad step holds
            trainer.load_checkpoint(next(p for p in step_dirs if p.name.endswith(f"{BAD_AT:08d}")))
            result["saved_at_bad"] = _params(trainer.model)
        out[mode] = result
        torch.manual_seed(0)
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_poisoned_step_is_skipped_everywhere_and_never_saved(tmp_path, dtype):
    poisoned = {BAD_AT}
    jobs = [
        ("reference", _job(tmp_path, "ref", dtype), set()),
        ("checkpoint_action", _job(tmp_path, "bad", dtype, anomaly={"actions": {"loss_nan": "checkpoint"}}), poisoned),
        ("unguarded", _job(tmp_path, "unguarded", dtype), poisoned),
    ]
    ranks = run_distributed(_run, 2, args=(jobs,), timeout=300)
    for got in ranks:
        ref, bad, control = got["reference"], got["checkpoint_action"], got["unguarded"]
        assert math.isnan(bad["losses"][BAD_AT - 1]) and all(
            math.isfinite(x) for i, x in enumerate(bad["losses"]) if i != BAD_AT - 1
        )
        assert bad["skipped"] == 1 and bad["metric"] == 1.0 and ref["skipped"] == 0
        for name, want in ref["params"].items():  # the same weights as a run that never took that step
            np.testing.assert_array_equal(bad["params"][name], want, err_msg=name)
        # the anomaly's checkpoint at the bad step holds the weights from before it
        assert f"step_{BAD_AT:08d}" in bad["checkpoints"]
        for name, want in ref["before_bad"].items():
            np.testing.assert_array_equal(bad["saved_at_bad"][name], want, err_msg=name)
        # negative control: applied, the NaN step poisons every weight it reaches
        assert any(np.isnan(v).any() for v in control["params"].values())
        assert control["skipped"] == 0


def test_max_bad_steps_in_a_row_stop_the_run_at_its_last_good_checkpoint(tmp_path):
    cfg = tiny_job(
        str(tmp_path / "diverged"),
        task={"name": "diverged", "seed": 7},
        parallel={"data_parallel_size": 2, "micro_batch_size": 2},
        train={"steps": 8, "max_bad_steps": 2, "anomaly": {"actions": {"loss_nan": "warn"}}},
        checkpoint={"interval": 2},
    )
    ranks = run_distributed(_run, 2, args=([("stop", cfg, {3, 4, 5, 6, 7, 8})],), timeout=300)
    for got in ranks:
        res = got["stop"]
        assert res["stopped"] and "train.max_bad_steps 2" in res["stopped"] and "step 4" in res["stopped"]
        assert res["skipped"] == 2 and len(res["losses"]) == 3  # the step that stops the run is not recorded
        assert res["checkpoints"] == ["step_00000002"]  # the last good one, nothing after it
        assert all(np.isfinite(v).all() for v in res["params"].values())
