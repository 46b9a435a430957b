"""The job's usable result (issue 14 §6): the final checkpoint exported with its tokenizer, logged and registered.

- ``export_model`` writes a Hugging Face directory that ``transformers`` loads — the model with the engine's logits,
  the tokenizer (``AutoTokenizer``) encoding and decoding every text exactly as the byte tokenizer does and
  rendering sft chats as the built-in template does — and ``export.json`` naming the checkpoint by its manifest's
  sha256;
- ``register_model`` against a real MLflow sqlite store: each registration is a new version with ``newest`` on it;
  ``best`` moves only to a version with a lower eval loss; ``kc runs compare`` shows the eval loss and the version.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from kuangchao_core.data.sft import chat_spans
from kuangchao_core.data.tokenizer import ByteTokenizer
from kuangchao_core.engine.release import export_model
from kuangchao_core.obs.model_registry import ALIAS_CHAMPION, ALIAS_NEWEST, log_model_dir, register_model
from kuangchao_core.perm import guard_api
from tests.engine_helpers import only_lineage, run_trainers, tiny_job
from tests.mp import run_distributed
from tests.tolerances import assert_logits_match

transformers = pytest.importorskip("transformers")

TEXTS = ["12+34=46\n", "héllo wörld ☃ \t\x00\x7f  two  spaces", "a\nb\n\n", ""]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    cfg = tiny_job(str(tmp), train={"steps": 3, "warmup_steps": 0})
    result = run_distributed(run_trainers, 1, args=([{"cfg": cfg}],))[0][0]
    step = only_lineage(tmp / "ckpt" / "t") / "step_00000003"
    out = tmp / "model"
    previous = guard_api.install_guard(guard_api.AllowAll())  # as the flow, the job's authority, exports
    try:
        record = export_model(step, out, "byte", 128)
    finally:
        guard_api.install_guard(previous)
    return {"tmp": tmp, "step": step, "out": out, "record": record, "params": result["params"]}


def test_export_loads_in_transformers_with_the_engine_logits(trained):
    from kuangchao_core.models.llama import PRESETS, LlamaForCausalLM

    model = transformers.AutoModelForCausalLM.from_pretrained(trained["out"], attn_implementation="eager")
    ours = LlamaForCausalLM(PRESETS["tiny"])
    ours.load_state_dict({n: torch.from_numpy(v) for n, v in trained["params"].items()})
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_logits_match(model.double().eval()(input_ids=ids).logits, ours.double().eval()(ids))


def test_export_tokenizer_encodes_decodes_and_templates_like_ours(trained):
    tok = transformers.AutoTokenizer.from_pretrained(trained["out"])
    ours = ByteTokenizer()
    assert len(tok) == ours.vocab_size
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == ours.encode(text), text
        assert tok.decode(ids) == text
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    whole = [*chat, {"role": "assistant", "content": "4"}]
    assert tok.apply_chat_template(whole, tokenize=False) == "".join(t for t, _ in chat_spans(whole, ours))
    prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt == "".join(t for t, _ in chat_spans(chat, ours)) + "<|assistant|>\n"


def test_export_record_names_the_checkpoint_by_its_manifest(trained):
    record = trained["record"]
    on_disk = json.loads((trained["out"] / "export.json").read_text())
    assert on_disk == record
    assert record["manifest_sha256"] == hashlib.sha256((trained["step"] / "manifest.json").read_bytes()).hexdigest()
    assert record["format"] == "hf" and record["step"] == 3
    assert set(record["files"]) == {p.name for p in trained["out"].iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= set(record["files"])
    assert not list(trained["tmp"].glob(".model.tmp*")), "the temporary directory is renamed into place"


def _run_with_eval(client, exp, eval_loss, accuracy=None):
    run = client.create_run(exp, tags={"mlflow.runName": f"r{eval_loss}", "kuangchao.layout": "dp1-tp1-pp1-zero0"})
    metrics = [Metric("loss", 3.0, 0, 1)]
    if eval_loss is not None:
        metrics.append(Metric("eval_loss", eval_loss, 0, 1))
    if accuracy is not None:
        metrics.append(Metric("heldout_accuracy", accuracy, 0, 1))
    client.log_batch(run.info.run_id, metrics=metrics)
    return run.info.run_id


def test_register_model_moves_newest_always_and_champion_only_to_a_higher_accuracy(trained, tmp_path):
    from kuangchao.cli.main import app

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_job(str(tmp_path), task={"name": "reg"}, tracking={"uri": uri, "register_model": "tiny-reg"})
    client = MlflowClient(uri)
    exp = client.create_experiment("reg")
    seen = []
    for loss, accuracy in ((2.0, 0.2), (2.5, 0.1), (None, None), (1.5, 0.5)):
        run_id = _run_with_eval(client, exp, loss, accuracy)
        source = log_model_dir(cfg, run_id, trained["out"], trained["record"])
        got = register_model(cfg, run_id, "tiny-reg", source, trained["record"], loss)
        newest = client.get_model_version_by_alias("tiny-reg", ALIAS_NEWEST)
        champion = client.get_model_version_by_alias("tiny-reg", ALIAS_CHAMPION)
        seen.append((got["version"], int(newest.version), int(champion.version)))
        assert client.get_run(run_id).data.tags["kuangchao.model_version"] == str(got["version"])
    assert seen == [(1, 1, 1), (2, 2, 1), (3, 3, 1), (4, 4, 4)]
    version = client.get_model_version("tiny-reg", "4")
    assert version.tags["kuangchao.manifest_sha256"] == trained["record"]["manifest_sha256"]
    artifacts = {a.path for a in client.list_artifacts(version.run_id, "model")}
    assert {"model/model.safetensors", "model/tokenizer.json", "model/export.json"} <= artifacts

    res = CliRunner().invoke(app, ["runs", "compare", "reg", "--tracking-uri", uri, "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in json.loads(res.output)}
    assert rows["r1.5"]["model_version"] == "tiny-reg v4" and rows["r1.5"]["eval_loss"] == 1.5
    assert rows["rNone"]["eval_loss"] is None and rows["rNone"]["model_version"] == "tiny-reg v3"
    table = CliRunner().invoke(app, ["runs", "compare", "reg", "--tracking-uri", uri])
    assert "tiny-reg v4" in table.output and "1.5000" in table.output


def test_register_without_log_model_is_said_unused(tmp_path):
    from kuangchao_core.config.unused import unused_settings

    cfg = tiny_job(str(tmp_path), tracking={"log_model": False, "register_model": "x"})
    assert "tracking.register_model" in dict(unused_settings(cfg))
    np.testing.assert_equal(dict(unused_settings(tiny_job(str(tmp_path)))).get("tracking.register_model"), None)


def test_a_registered_model_resolves_to_its_files_and_adapters_are_refused(trained, tmp_path):
    from kuangchao_core.errors import ConfigError
    from kuangchao_core.obs.model_registry import resolve_model_uri

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_job(str(tmp_path), task={"name": "res"}, tracking={"uri": uri})
    client = MlflowClient(uri)
    exp = client.create_experiment("res")
    run_id = _run_with_eval(client, exp, 2.0, 0.5)
    source = log_model_dir(cfg, run_id, trained["out"], trained["record"])
    register_model(cfg, run_id, "base", source, trained["record"], 2.0)
    for ref in ("models:/base@newest", "models:/base@champion", "models:/base/1"):
        local, info = resolve_model_uri(ref, uri, tmp_path / "dl")
        assert (local / "model.safetensors").read_bytes() == (trained["out"] / "model.safetensors").read_bytes()
        assert info["version"] == 1 and info["manifest_sha256"] == trained["record"]["manifest_sha256"]
    for bad, message in (("models:/base", "use models:/NAME@ALIAS"), ("models:/base@nope", "no such model version")):
        with pytest.raises(ConfigError, match=message):
            resolve_model_uri(bad, uri, tmp_path / "dl")
    register_model(cfg, run_id, "base", source, {**trained["record"], "format": "peft"}, 1.0)
    with pytest.raises(ConfigError, match="peft adapters, not a whole model"):
        resolve_model_uri("models:/base@newest", uri, tmp_path / "dl")


def test_a_relative_store_read_from_another_directory_is_named_and_not_created(tmp_path, monkeypatch):
    from kuangchao_core.errors import ConfigError
    from kuangchao_core.obs.model_registry import resolve_model_uri

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the demo's store is sqlite:///mlflow.db, made in the directory `make demo` ran in
    with pytest.raises(ConfigError, match=r"relative path, read from the working directory .*elsewhere.*absolute path"):
        resolve_model_uri("models:/kc-tiny-demo@champion", "sqlite:///mlflow.db", tmp_path / "dl")
    assert not (elsewhere / "mlflow.db").exists()  # no empty store left behind
    with pytest.raises(ConfigError, match="no such model version"):  # control: an existing store is opened and read
        MlflowClient(f"sqlite:///{tmp_path / 'real.db'}").search_experiments()
        resolve_model_uri("models:/kc-tiny-demo@champion", f"sqlite:///{tmp_path / 'real.db'}", tmp_path / "dl")


def test_kc_train_hands_a_registered_base_to_the_flow(monkeypatch):
    """`kc train --config configs/finetune-demo.yaml` (base `models:/kc-tiny-demo@champion`) gets past its pre-flight
    checks to the launch: the flow resolves the base and checks the plan then. Control: a local base that cannot be
    read is still refused before any launch."""
    from pathlib import Path

    from kuangchao.cli.main import app

    config = str(Path(__file__).resolve().parent.parent / "configs" / "finetune-demo.yaml")
    launched = []
    monkeypatch.setattr("kuangchao.cli.train.prefect_api_problem", lambda *a, **k: launched.append(1) or "stop")
    out = CliRunner().invoke(app, ["train", "--config", config])
    assert out.exit_code == 1 and launched == [1], out.output  # stopped at the Prefect check, after the pre-flight
    missing = CliRunner().invoke(app, ["train", "--config", config, "--set", "model.checkpoint=/nonexistent/base"])
    assert missing.exit_code == 2 and launched == [1] and "model.checkpoint" in missing.output, missing.output
