"""A registry a fine-tune can trust (issue 27 §1): ``champion`` moves only when a run beats it on the same held-out
evaluation, ``newest`` follows every run that passes the publish gate, the fine-tune demo and the nightly deployment
start from ``@champion``, MLflow's own pyfunc loader answers a prompt, and the run summary says which alias moved.

A real MLflow sqlite store in ``tmp_path``; the registered model is the shipped demo base
``tests/data/kc-tiny-demo/`` (made an MLflow pyfunc model by ``write_pyfunc_files``), each "run" an MLflow run whose
``heldout_accuracy`` is logged by the test (the demo's own figure for the strong run, the README's 100-step figure
for the weak one). One flow-level test trains 4 steps through ``train_flow`` on top of a registered champion.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest
import yaml
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from kuangchao_core.config import load_config
from kuangchao_core.obs.champion import ALIAS_CHAMPION, ALIAS_NEWEST, EVAL_SET_TAG, evaluation_identity
from kuangchao_core.obs.mlflow_model import write_pyfunc_files
from kuangchao_core.obs.model_registry import log_model_dir, register_model, resolve_model_uri

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "tests" / "data" / "kc-tiny-demo"
TINY = ROOT / "configs" / "tiny.yaml"
STRONG, WEAK = 0.973, 0.004  # the demo's held-out exact match; the README's 100-step run's


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> tuple[Path, dict]:
    """The shipped demo base as an MLflow pyfunc model directory, and its export record."""
    out = tmp_path_factory.mktemp("demo") / "model"
    shutil.copytree(BASE, out)
    record = json.loads((out / "export.json").read_text(encoding="utf-8"))
    return out, write_pyfunc_files(out, record)


class Store:
    """A real MLflow sqlite store and the runs the tests register into it."""

    def __init__(self, tmp: Path, name: str = "kc-tiny-demo"):
        self.uri = f"sqlite:///{tmp / 'mlflow.db'}"
        self.name = name
        self.client = MlflowClient(self.uri)
        self.exp = self.client.create_experiment(name, artifact_location=(tmp / "artifacts").as_uri())

    def cfg(self, *overrides: str):
        """``configs/tiny.yaml`` (the demo) writing to this store."""
        return load_config(str(TINY), [f"tracking.uri={self.uri}", f"tracking.register_model={self.name}", *overrides])

    def register(self, model: tuple[Path, dict], accuracy: float | None, *overrides: str) -> dict:
        """A finished run with held-out accuracy ``accuracy`` whose model is registered under the config."""
        model_dir, record = model
        cfg = self.cfg(*overrides)
        run_id = self.client.create_run(self.exp).info.run_id
        metrics = [Metric("loss", 1.0, 0, record["step"])]
        if accuracy is not None:
            metrics.append(Metric("heldout_accuracy", accuracy, 0, record["step"]))
        self.client.log_batch(run_id, metrics=metrics)
        source = log_model_dir(cfg, run_id, model_dir, record)
        return register_model(cfg, run_id, self.name, source, record, 0.5, final_loss=1.0, model_dir=model_dir)

    def at(self, alias: str) -> int | None:
        """The version the alias points at (None when unset)."""
        from mlflow.exceptions import MlflowException

        try:
            return int(self.client.get_model_version_by_alias(self.name, alias).version)
        except MlflowException:
            return None


def test_a_weak_run_after_a_strong_one_moves_only_newest(tmp_path, demo_model):
    store = Store(tmp_path)
    first = store.register(demo_model, STRONG)
    assert first["aliases"] == [ALIAS_NEWEST, ALIAS_CHAMPION] and "first champion" in first["decision"]
    weak = store.register(demo_model, WEAK)  # the README's 100-step run of configs/tiny.yaml
    assert weak["version"] == 2 and weak["aliases"] == [ALIAS_NEWEST]
    assert (store.at(ALIAS_NEWEST), store.at(ALIAS_CHAMPION)) == (2, 1)
    assert "champion stays at v1: heldout_accuracy 0.0040 <= 0.9730" in weak["decision"], weak["decision"]
    # what a fine-tune's models:/kc-tiny-demo@champion resolves to: the strong version
    _, info = resolve_model_uri(f"models:/{store.name}@champion", store.uri, tmp_path / "dl")
    assert info["version"] == 1
    tags = store.client.get_run(store.client.get_model_version(store.name, "2").run_id).data.tags
    assert tags["kuangchao.registry_decision"] == weak["decision"]


def test_a_stronger_run_takes_champion_and_a_tie_keeps_it(tmp_path, demo_model):
    store = Store(tmp_path)
    store.register(demo_model, 0.9)
    stronger = store.register(demo_model, STRONG)
    assert stronger["aliases"] == [ALIAS_NEWEST, ALIAS_CHAMPION]
    assert "champion moved from v1: heldout_accuracy 0.9730 > 0.9000" in stronger["decision"]
    tie = store.register(demo_model, STRONG)
    assert tie["aliases"] == [ALIAS_NEWEST] and "champion stays at v2" in tie["decision"]
    assert (store.at(ALIAS_NEWEST), store.at(ALIAS_CHAMPION)) == (3, 2)
    no_metric = store.register(demo_model, None)
    assert no_metric["aliases"] == [ALIAS_NEWEST] and "logged no heldout_accuracy" in no_metric["decision"]
    assert store.at(ALIAS_CHAMPION) == 2


def test_a_run_on_another_evaluation_never_moves_champion(tmp_path, demo_model):
    store = Store(tmp_path)
    store.register(demo_model, 0.5)
    for other in ("data.synthetic.num_eval=16", "data.synthetic.seed=1", "data.synthetic.task=addition"):
        perfect = store.register(demo_model, 1.0, other)
        assert perfect["aliases"] == [ALIAS_NEWEST], other
        assert "runs on different evaluations are not compared" in perfect["decision"], perfect["decision"]
    assert store.at(ALIAS_CHAMPION) == 1
    # the control: the same evaluation (a different training set size changes no held-out problem) moves it
    same = store.register(demo_model, 0.6, "data.synthetic.num_train=1000")
    assert same["aliases"] == [ALIAS_NEWEST, ALIAS_CHAMPION] and store.at(ALIAS_CHAMPION) == 5
    version = store.client.get_model_version(store.name, "5")
    assert version.tags[EVAL_SET_TAG] == evaluation_identity(store.cfg())[0]


def test_the_identity_of_held_out_files_is_their_bytes(tmp_path):
    held = tmp_path / "heldout.jsonl"
    held.write_text('{"prompt": "1+1=", "completion": "2"}\n', encoding="utf-8")
    cfg = load_config(str(TINY), ["data.format=sft", f"data.path={held}", f"data.eval_path={held}"])
    before = evaluation_identity(cfg)
    assert before[0] is not None and "heldout.jsonl" in before[1]
    assert evaluation_identity(cfg) == before
    held.write_text('{"prompt": "1+1=", "completion": "3"}\n', encoding="utf-8")
    assert evaluation_identity(cfg)[0] != before[0]
    assert evaluation_identity(load_config(str(TINY), ["data.synthetic.num_eval=0"]))[0] is None


def test_the_gate_settings_register_only_champions_and_set_a_floor(tmp_path, demo_model):
    store = Store(tmp_path)
    low = store.register(demo_model, WEAK, "tracking.champion_min=0.5")
    assert low["aliases"] == [ALIAS_NEWEST] and "below tracking.champion_min 0.5" in low["decision"]
    assert store.at(ALIAS_CHAMPION) is None  # a first model becomes champion only through the gate
    store.register(demo_model, STRONG, "tracking.champion_min=0.5")
    assert store.at(ALIAS_CHAMPION) == 2
    skipped = store.register(demo_model, WEAK, "tracking.register_if=champion")
    assert skipped["version"] is None and skipped["aliases"] == []
    assert skipped["decision"].startswith("not registered (tracking.register_if: champion)")
    assert len(store.client.search_model_versions(f"name='{store.name}'")) == 2


def test_the_finetune_demo_and_the_nightly_deployment_start_from_the_champion():
    cfg = load_config(str(ROOT / "configs" / "finetune-demo.yaml"))
    assert cfg.model.checkpoint == "models:/kc-tiny-demo@champion"
    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text(encoding="utf-8"))
    nightly = next(d for d in spec["deployments"] if d["name"] == "nightly-finetune")
    params = nightly["parameters"]
    deployed = load_config(str(ROOT / params["config_path"]), params["overrides"])
    assert deployed.model.checkpoint == "models:/kc-tiny-demo@champion"
    assert "@newest" not in (ROOT / "configs" / "finetune-demo.yaml").read_text(encoding="utf-8")


def test_mlflow_pyfunc_loader_answers_a_prompt_from_the_champion(tmp_path, demo_model):
    import mlflow

    store = Store(tmp_path)
    store.register(demo_model, STRONG)
    store.register(demo_model, WEAK)
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(store.uri)
    try:
        model = mlflow.pyfunc.load_model(f"models:/{store.name}@champion")
        assert model.predict(["12+34=", "57+8="]) == ["46", "65"]
    finally:
        mlflow.set_tracking_uri(previous)
    logged = {
        a.path for a in store.client.list_artifacts(store.client.get_model_version(store.name, "1").run_id, "model")
    }
    assert {"model/MLmodel", "model/kc_pyfunc.py", "model/model.safetensors"} <= logged
    assert not [p for p in logged if p.endswith((".pkl", ".pickle"))]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_run_summary_says_which_alias_moved_and_why(prefect_api, tmp_path, demo_model, monkeypatch):
    """One real flow (two workers, 4 steps) on top of a registered champion: only ``newest`` moves, and the summary
    (dict and markdown) says so and why."""
    from flows.train import train_flow
    from kuangchao_core.job.finish import summary_markdown

    name = f"kc-alias-{uuid.uuid4().hex[:6]}"
    store = Store(tmp_path, name)
    store.register(demo_model, STRONG, f"task.name={name}")
    monkeypatch.setenv("KC_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    overrides = [
        f"task.name={name}",
        "train.steps=4",
        "train.warmup_steps=0",
        "train.log_interval=1",
        "train.eval_interval=1000",
        "checkpoint.interval=4",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "checkpoint.resume=never",
        "data.synthetic.num_train=512",
        "parallel.micro_batch_size=2",
        "permission.mode=trusted",
        f"tracking.uri={store.uri}",
        f"tracking.register_model={name}",
        "tracking.system_metrics=false",
        "tracking.prometheus_port=null",
    ]
    summary = train_flow(str(TINY), overrides)
    assert summary["model_version"] == 2
    assert (store.at(ALIAS_NEWEST), store.at(ALIAS_CHAMPION)) == (2, 1)
    assert summary["registry"].startswith(f"{name} v2: newest moved; champion stays at v1: heldout_accuracy")
    markdown = summary_markdown(store.cfg(f"task.name={name}"), summary)
    assert "| registry |" in markdown and "champion stays at v1" in markdown
    assert (Path(summary["model_dir"]) / "MLmodel").is_file()
    assert os.path.isfile(Path(summary["model_dir"]) / "kc_pyfunc.py")
