"""Nothing diverged is published (issue 26 §2).

Attacks stopped, each with a real NaN (never an overwritten loss):

- a NaN in the starting weights of a token the data uses: the loss is NaN from step 1; by default the run stops
  there and saves nothing (before: ``loss_nan`` warned, every step was skipped, and a run shorter than
  ``train.max_bad_steps`` ended "successfully" with a NaN checkpoint);
- a NaN in the weights of a token the data never uses: every loss is finite, the weights are not; the run stops at
  its first checkpoint write and saves nothing (before: it finished, saved and published NaN weights);
- one rank's activations turning NaN at step 3 (a forward hook, as tests/test_bad_steps.py does): the default run
  stops at step 3 (before: it warned and went on);
- export of a checkpoint holding NaN weights, or whose final loss is NaN, and registration of such a model (a real
  MLflow sqlite store) are refused with the reason; nothing is exported or registered and no alias moves;
- the whole job (``kc train``, the real flow, workers under torchrun) started from a base with a NaN row exits
  non-zero with one line saying why, registers nothing and moves no alias.

Controls: a clean run finishes and saves; an unguarded run (the checkpoint check disabled) does save NaN weights.
"""

from __future__ import annotations

import json
import math
import shutil
import uuid
from pathlib import Path

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from kuangchao_core.obs.publish_gate import NotPublishable, check_publishable, publish_refusal
from kuangchao_core.obs.voice import message_of
from tests.engine_helpers import tiny_job
from tests.mp import run_distributed

SEEN, UNSEEN = ord("1"), ord("Z")  # byte tokens: a digit of every sum, and a letter the arithmetic data never has
ROOT = Path(__file__).resolve().parent.parent


def _job(tmp: Path, name: str, **train):
    return tiny_job(
        str(tmp / name),
        task={"name": name, "seed": 7},
        parallel={"data_parallel_size": 2, "micro_batch_size": 2},
        train={"steps": 6, **train},
        checkpoint={"interval": 2},
    )


def _train(rank: int, world_size: int, jobs: list[tuple[str, object, dict]]) -> dict:
    import torch

    from kuangchao_core.engine import checkpointing
    from kuangchao_core.engine.trainer import AnomalyStop
    from tests.engine_helpers import trainer_in_process

    out = {}
    honest = checkpointing.nonfinite_names
    for mode, cfg, how in jobs:
        trainer = trainer_in_process(cfg, rank, world_size)
        if "nan_row" in how:  # the starting weights (the same on every rank) hold a NaN row
            with torch.no_grad():
                trainer.model.model.embed_tokens.weight[how["nan_row"]] = float("nan")
        if "nan_at" in how and rank == 1:  # one rank's activations of one step turn NaN

            def poison(_m, _i, output, _t=trainer, _at=how["nan_at"]):
                return output * float("nan") if _t.state.step + 1 == _at else output

            trainer.model.model.embed_tokens.register_forward_hook(poison)
        if how.get("unguarded"):
            checkpointing.nonfinite_names = lambda _tensors: []
        try:
            trainer.run(resume="never")
            stopped = None
        except AnomalyStop as exc:
            stopped = str(exc)
        finally:
            checkpointing.nonfinite_names = honest
        steps = sorted(p for p in Path(cfg.checkpoint.dir).rglob("step_*") if p.is_dir())
        out[mode] = {
            "stopped": stopped,
            "losses": list(trainer.state.losses),
            "checkpoints": [p.name for p in steps],
            "paths": [str(p) for p in steps],
        }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diverged")
    jobs = [
        ("clean", _job(tmp, "clean"), {}),
        ("seen", _job(tmp, "seen"), {"nan_row": SEEN}),
        ("unseen", _job(tmp, "unseen"), {"nan_row": UNSEEN}),
        ("data", _job(tmp, "data"), {"nan_at": 3}),
        ("unguarded", _job(tmp, "unguarded"), {"nan_row": UNSEEN, "unguarded": True}),
        # loss_nan warn (configured): training goes on past the skipped steps; the last one is NaN
        ("nan_last", _job(tmp, "nan_last", anomaly={"actions": {"loss_nan": "warn"}}), {"nan_at": 6}),
    ]
    ranks = run_distributed(_train, 2, args=(jobs,), timeout=300)
    return {"tmp": tmp, "ranks": ranks}


def test_a_nan_in_weights_or_activations_stops_a_default_run_and_nothing_diverged_is_saved(runs):
    for got in runs["ranks"]:  # every rank decides the same
        clean, seen, unseen, data = got["clean"], got["seen"], got["unseen"], got["data"]
        assert clean["stopped"] is None and clean["checkpoints"] == ["step_00000002", "step_00000004", "step_00000006"]
        # a NaN loss from step 1: stopped there, and its NaN weights are never written
        assert seen["stopped"] and "diverged" in seen["stopped"] and "embed_tokens" in seen["stopped"], seen
        assert math.isnan(seen["losses"][0]) and seen["checkpoints"] == []
        # every loss finite, a weight not: stopped at the first checkpoint write, nothing written
        assert all(math.isfinite(x) for x in unseen["losses"]) and len(unseen["losses"]) == 2, unseen
        assert unseen["stopped"] and "step 2" in unseen["stopped"] and "not finite" in unseen["stopped"]
        assert unseen["checkpoints"] == []
        # a NaN from one rank's activations at step 3: the default action stops the run there
        assert data["stopped"] and "loss_nan" in data["stopped"] and len(data["losses"]) == 3, data
        assert data["checkpoints"] == ["step_00000002", "step_00000003"]  # the skipped step kept the good weights
        # control: without the check the same run finishes and saves its NaN weights
        assert got["unguarded"]["stopped"] is None and got["unguarded"]["checkpoints"][-1] == "step_00000006"
        # configured to go on, the run ends on a skipped NaN step: its final loss is NaN
        assert got["nan_last"]["stopped"] is None and math.isnan(got["nan_last"]["losses"][-1])


@pytest.fixture
def as_the_flow():
    """The job's authority exports and registers, as the flow does (every checkpoint read allowed)."""
    from kuangchao_core.perm import guard_api

    previous = guard_api.install_guard(guard_api.AllowAll())
    yield
    guard_api.install_guard(previous)


def test_export_refuses_nan_weights_and_a_nan_final_loss_and_writes_nothing(runs, tmp_path, as_the_flow):
    from kuangchao_core.engine.release import export_model

    nan_step = Path(runs["ranks"][0]["unguarded"]["paths"][-1])
    with pytest.raises(NotPublishable, match=r"not finite: model\.safetensors:model\.embed_tokens\.weight"):
        export_model(nan_step, tmp_path / "model", "byte", 128)
    assert not (tmp_path / "model").exists() and not list(tmp_path.glob(".model*"))
    # the last step was skipped with a NaN loss, which the checkpoint recorded: refused, though the weights are fine
    last = Path(runs["ranks"][0]["nan_last"]["paths"][-1])
    with pytest.raises(NotPublishable, match="final training loss is nan"):
        export_model(last, tmp_path / "model", "byte", 128)
    clean = Path(runs["ranks"][0]["clean"]["paths"][-1])
    with pytest.raises(NotPublishable, match="final training loss is inf"):  # the run's own final loss, given
        export_model(clean, tmp_path / "model", "byte", 128, final_loss=float("inf"))
    assert not (tmp_path / "model").exists()
    record = export_model(clean, tmp_path / "model", "byte", 128, final_loss=2.0)  # control
    assert record["step"] == 6 and (tmp_path / "model" / "model.safetensors").is_file()


def _nan_copy(model_dir: Path, dst: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, dst)
    weights = load_file(str(dst / "model.safetensors"))
    weights["model.embed_tokens.weight"][UNSEEN, 0] = float("nan")
    weights["lm_head.weight"][3] = torch.inf
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_registration_refuses_a_diverged_model_and_moves_no_alias(runs, tmp_path, as_the_flow):
    from kuangchao_core.engine.release import export_model
    from kuangchao_core.obs.model_registry import ALIAS_CHAMPION, ALIAS_NEWEST, log_model_dir, register_model

    clean = Path(runs["ranks"][0]["clean"]["paths"][-1])
    good_dir = tmp_path / "good"
    record = export_model(clean, good_dir, "byte", 128)
    bad_dir = _nan_copy(good_dir, tmp_path / "bad")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_job(str(tmp_path), task={"name": "gate"}, tracking={"uri": uri, "register_model": "gate"})
    client = MlflowClient(uri)
    exp = client.create_experiment("gate", artifact_location=str(tmp_path / "artifacts"))

    def run_with(loss: float, model_dir: Path, accuracy: float = 0.5) -> tuple[str, str]:
        run_id = client.create_run(exp).info.run_id
        metrics = [
            Metric("loss", loss, 0, 6),
            Metric("eval_loss", 1.0, 0, 6),
            Metric("heldout_accuracy", accuracy, 0, 6),
        ]
        client.log_batch(run_id, metrics=metrics)
        return run_id, log_model_dir(cfg, run_id, model_dir, record)

    run_id, source = run_with(2.0, good_dir)
    assert register_model(cfg, run_id, "gate", source, record, 1.0)["version"] == 1
    # non-finite weights (read from the logged artifacts), then a finite model whose run's last loss is NaN
    for loss, model_dir, why in (
        (2.0, bad_dir, r"2 weight tensor\(s\) are not finite: model\.safetensors:lm_head\.weight"),
        (float("nan"), good_dir, "the final training loss is nan"),
    ):
        run_id, source = run_with(loss, model_dir, accuracy=1.0)
        with pytest.raises(NotPublishable, match=why) as err:
            register_model(cfg, run_id, "gate", source, record, 0.5)  # its accuracy would have taken champion
        assert "registration of gate" in str(err.value) and "not published" in str(err.value)
        assert [int(v.version) for v in client.search_model_versions("name='gate'")] == [1]
        assert int(client.get_model_version_by_alias("gate", ALIAS_NEWEST).version) == 1
        assert int(client.get_model_version_by_alias("gate", ALIAS_CHAMPION).version) == 1
        assert "kuangchao.model_version" not in client.get_run(run_id).data.tags
    # the gate itself, as any later alias mover calls it
    assert publish_refusal(good_dir, 1.5) is None
    with pytest.raises(NotPublishable, match="not finite"):
        check_publishable(bad_dir, None)
    assert "no weight file" in publish_refusal(tmp_path / "artifacts" / "nothing-here", None)


def test_kc_train_of_a_diverging_job_exits_nonzero_registers_nothing_and_moves_no_alias(
    prefect_api, tmp_path, monkeypatch
):
    """The real job: `kc train` (flow, enforcing permissions, two workers under torchrun) fine-tuning a base whose
    embedding row of a token the data never holds is NaN — every loss finite, the weights not."""
    from typer.testing import CliRunner

    from kuangchao.cli.main import app
    from kuangchao_core.obs.model_registry import ALIAS_NEWEST, register_model

    base = _nan_copy(ROOT / "tests" / "data" / "kc-tiny-demo", tmp_path / "nan-base")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    name = f"kc-diverged-{uuid.uuid4().hex[:6]}"
    cfg = tiny_job(str(tmp_path), task={"name": name}, tracking={"uri": uri})
    client = MlflowClient(uri)
    exp = client.create_experiment(name, artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(exp).info.run_id
    good = ROOT / "tests" / "data" / "kc-tiny-demo"
    record = json.loads((good / "export.json").read_text(encoding="utf-8"))
    register_model(cfg, run_id, name, str(good), record, None)  # moves `newest`, which a diverged run must not
    monkeypatch.setenv("KC_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    overrides = {
        "task.name": name,
        "model.checkpoint": str(base),
        "train.steps": 4,
        "train.warmup_steps": 0,
        "train.log_interval": 1,
        "train.eval_interval": 1000,
        "checkpoint.interval": 2,
        "checkpoint.dir": str(tmp_path / "ckpt"),
        "checkpoint.resume": "never",
        "data.synthetic.num_train": 512,
        "parallel.micro_batch_size": 2,
        "permission.audit_log": str(tmp_path / "audit"),
        "tracking.uri": uri,
        "tracking.register_model": name,
        "tracking.system_metrics": "false",
        "cluster.max_restarts": 2,
    }
    args = ["train", "--config", str(ROOT / "configs" / "tiny.yaml")]
    for key, value in overrides.items():
        args += ["--set", f"{key}={value}"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1, res.output
    failed = [line for line in res.output.splitlines() if message_of(line).startswith("kc train failed:")]
    assert len(failed) == 1 and "diverged" in failed[0] and "AnomalyStop" in failed[0], res.output
    assert "attempt 1" not in failed[0]  # a diverged run is never retried
    assert [int(v.version) for v in client.search_model_versions(f"name='{name}'")] == [1]
    assert int(client.get_model_version_by_alias(name, ALIAS_NEWEST).version) == 1
    assert not list((tmp_path / "ckpt").rglob("step_*")), "nothing diverged is saved"
    assert not list((tmp_path / "runs").rglob("model/model.safetensors")), "nothing exported"
