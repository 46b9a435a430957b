"""Hostile input (issue 16, items 5-7 in part): configs (each attack exits 2 with the dotted path and no traceback,
and nothing of another file's content is echoed), credentials inside URLs, the renewal endpoint's requests, and
``allowed_interfaces`` as the original means it. Each test shows the attack input is real, then the refusal."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kuangchao.cli.main import app
from kuangchao_core.config import load_config
from kuangchao_core.errors import ConfigError
from kuangchao_core.perm.issuance import authority_for
from kuangchao_core.perm.tokens import DEFAULT_MAX_TTL_S

RUN = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
SECRET = "root:$6$S3CRETHASH:19000:0:99999:7:::"


def _validate(path) -> tuple[int, str]:
    out = RUN.invoke(app, ["config", "validate", str(path)])
    assert out.exception is None or isinstance(out.exception, SystemExit), out.exception  # no traceback
    return out.exit_code, out.output


def test_extends_of_a_non_config_file_is_refused_without_echoing_it(tmp_path):
    shadow = tmp_path / "shadow"
    shadow.write_text(f"{SECRET}\ndaemon:*:19000:0:99999:7:::\n")
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"extends: {shadow}\ntask: {{name: a}}\n")
    code, text = _validate(cfg)
    assert code == 2 and "extends" in text and "not a Kuangchao config" in text
    assert "S3CRETHASH" not in text and "daemon" not in text
    # a base file with broken YAML: named with the line, its content not quoted
    shadow.write_text("task: {name: [S3CRETHASH\n")
    code, text = _validate(cfg)
    assert code == 2 and "YAML syntax error at line" in text and str(shadow) in text and "S3CRETHASH" not in text
    # duplicate keys outside any section would name them: refused as a whole instead
    shadow.write_text("S3CRETHASH: 1\nS3CRETHASH: 2\n")
    code, text = _validate(cfg)
    assert code == 2 and "not a valid YAML config" in text and "S3CRETHASH" not in text
    # the control: a real base config still works
    shadow.write_text("train: {steps: 7}\n")
    assert load_config(cfg).train.steps == 7


def test_a_fifo_as_config_or_base_fails_at_once_instead_of_hanging(tmp_path):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    code, text = _validate(fifo)  # opening a FIFO for reading would block until a writer comes
    assert code == 2 and "not a regular file" in text
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"extends: {fifo.name}\ntask: {{name: a}}\n")
    code, text = _validate(cfg)
    assert code == 2 and "extends: " in text and "not a regular file" in text


@pytest.mark.parametrize("char", ["\x00", "\x1b", "\x07"])
def test_nul_and_control_characters_exit_2(tmp_path, char):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f'task: {{name: "a{char}b"}}\n')
    code, text = _validate(cfg)
    assert code == 2 and "(file)" in text and "Traceback" not in text


def test_token_ttl_and_other_counts_are_bounded_and_never_raise_the_verifiers_maximum(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("task: {name: a}\npermission: {token_ttl_seconds: 1e18}\ncluster: {max_restarts: 1e9}\n")
    code, text = _validate(cfg)
    assert code == 2 and "permission.token_ttl_seconds" in text and "cluster.max_restarts" in text
    cfg.write_text("task: {name: a}\ntrain: {steps: 1e15}\n")
    assert "train.steps" in _validate(cfg)[1]
    # the largest TTL the config accepts leaves the authority's maximum where it is
    ok = load_config(cfg, ["train.steps=10", f"permission.token_ttl_seconds={DEFAULT_MAX_TTL_S}"])
    assert authority_for(ok, tmp_path / "run").max_ttl_s == DEFAULT_MAX_TTL_S


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ({"num_hidden_layers": 1_000_000}, "num_hidden_layers 1000000 is outside"),
        ({"vocab_size": 1e12}, "vocab_size 1000000000000 is outside"),
        ({"hidden_size": "64; rm -rf"}, "hidden_size must be a whole number"),
        ([1, 2], "is not a JSON object"),
        ({"rope_scaling": "linear"}, "rope_scaling must be an object"),
    ],
)
def test_hf_config_json_sizes_are_validated_naming_the_key(tmp_path, content, needle):
    base = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(content if isinstance(content, list) else {**base, **content}))
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"task: {{name: a}}\nmodel: {{checkpoint: {hf}}}\n")
    out = RUN.invoke(app, ["plan", "--config", str(cfg)])
    assert out.exit_code == 2 and "model.checkpoint" in out.output and needle in out.output, out.output
    assert out.exception is None or isinstance(out.exception, SystemExit)
    (hf / "config.json").write_text(json.dumps(base))  # the control: the same directory, sane sizes, plans
    assert RUN.invoke(app, ["plan", "--config", str(cfg)]).exit_code == 0


def test_model_sizes_in_the_config_itself_are_bounded(tmp_path):
    from kuangchao_core.models.llama import config_from_model_section

    cfg = tmp_path / "job.yaml"
    cfg.write_text("task: {name: a}\nmodel: {preset: tiny, num_layers: 1000000}\n")
    with pytest.raises(ConfigError) as err:
        config_from_model_section(load_config(cfg).model)
    assert ("model.num_layers", "1000000 is above the limit 1024") in err.value.errors
    out = RUN.invoke(app, ["plan", "--config", str(cfg)])  # and kc plan says so instead of running away
    assert out.exit_code == 2 and "model.num_layers: 1000000 is above the limit 1024" in out.output


def test_credentials_inside_the_endpoint_url_never_reach_the_written_config_params_or_reprs(tmp_path):
    from flows.train import load_job_config
    from kuangchao_core.job.checkpoints import s3_settings_for

    url = "http://AKIAEXAMPLE:s3cr3t%2Fkey@127.0.0.1:9000/base"
    cfg_file = tmp_path / "job.yaml"
    cfg_file.write_text(f"task: {{name: a}}\ncheckpoint: {{uri: 's3://b/p', endpoint_url: '{url}'}}\n")
    assert "s3cr3t" in load_config(cfg_file).checkpoint.endpoint_url  # the attack input as written
    secrets: dict = {}
    cfg = load_job_config(str(cfg_file), [], secrets)
    assert cfg.checkpoint.endpoint_url == "http://127.0.0.1:9000/base"
    assert "s3cr3t" not in cfg.to_yaml() and "s3cr3t" not in json.dumps(cfg.flat(), default=str)  # the MLflow params
    settings = s3_settings_for(cfg, secrets)  # the orchestrator still reaches the bucket with them
    assert (settings.access_key_id, settings.secret_access_key) == ("AKIAEXAMPLE", "s3cr3t/key")
    assert "s3cr3t" not in repr(settings) and "AKIAEXAMPLE" not in repr(settings)
    shown = RUN.invoke(app, ["config", "show", str(cfg_file)])
    assert shown.exit_code == 0 and "s3cr3t" not in shown.output and "***@127.0.0.1:9000" in shown.output


def test_a_layout_needing_primitives_outside_allowed_interfaces_is_named_and_a_denial_is_not_retried(tmp_path):
    from kuangchao_core.engine.plan import interface_problems, required_primitives
    from kuangchao_core.errors import WorkerFailed
    from kuangchao_core.sched.recovery import RestartPolicy

    cfg = tmp_path / "job.yaml"
    cfg.write_text(
        "task: {name: a}\nmodel: {preset: tiny}\nparallel: {pipeline_parallel_size: 2, data_parallel_size: 2, "
        "zero_stage: 1}\npermission: {allowed_interfaces: [all_reduce, all_gather, broadcast]}\n"
    )
    job = load_config(cfg)
    assert {"send", "recv", "reduce_scatter"} <= set(required_primitives(job))
    problems = " ".join(m for _, m in interface_problems(job))
    assert "send, recv" in problems and "reduce_scatter" in problems
    code, text = _validate(cfg)
    assert code == 2 and "permission.allowed_interfaces" in text and "send, recv" in text
    from kuangchao_core.engine.plan import check_plan

    assert any(p == "permission.allowed_interfaces" for p, _ in check_plan(job))  # kc plan and the flow refuse
    ok = load_config(
        cfg, ["permission.allowed_interfaces=[all_reduce, all_gather, broadcast, send, recv, reduce_scatter]"]
    )
    assert interface_problems(ok) == []  # the control
    # the original design's example: as written (pp2 without send/recv) refused; as shipped it validates and plans
    example = ROOT / "configs" / "llama3-8b-finetune.yaml"
    assert _validate(example)[0] == 0 and not interface_problems(load_config(example))
    original = load_config(example, ["permission.allowed_interfaces=[all_reduce, all_gather, broadcast]"])
    assert "send, recv" in " ".join(m for _, m in interface_problems(original))
    assert (
        required_primitives(load_config(cfg, ["parallel.pipeline_parallel_size=1", "parallel.data_parallel_size=1"]))
        == {}
    )
    policy = RestartPolicy(max_restarts=3)
    assert not policy.retryable(WorkerFailed(0, "PermissionDenied: worker-0 denied send on group:pp[0,1]"))
    assert policy.retryable(WorkerFailed(0, "killed by SIGKILL"))


def test_the_renewal_endpoint_survives_bad_headers_and_idle_connections(tmp_path, capfd):
    import socket
    import time
    import urllib.request

    from kuangchao_core.perm.authority import Authority
    from kuangchao_core.perm.runtime import RenewalServer

    auth = Authority(tmp_path / "auth")
    token = auth.issue("worker-0", "trainer", "job-R", 0, interfaces=["all_reduce"], ttl_s=60)
    with RenewalServer(auth, "job-R", 0, ttl_s=30, read_timeout_s=1.0) as server:
        host, port = server.address.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(20)]  # never send a byte
        bad = socket.create_connection((host, int(port)))
        bad.sendall(b"POST /renew HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
        assert b" 400 " in bad.recv(4096).split(b"\r\n")[0] + b" "
        req = urllib.request.Request(
            server.address + "/renew",
            data=json.dumps({"token": token, "module_id": "worker-0"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        assert "token" in json.loads(urllib.request.urlopen(req, timeout=5).read())  # served despite the idle ones
        time.sleep(1.5)
        idle[0].settimeout(2)
        assert idle[0].recv(1) == b""  # the server closed the idle connection after its read timeout
        for s in [*idle, bad]:
            s.close()
    assert "Traceback" not in capfd.readouterr().err
