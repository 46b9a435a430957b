"""The shared fixtures (tests/conftest.py, tests/fixtures.py) are what they say: the tiny model of configs/tiny.yaml
in our terms and in transformers', a free port, a real S3 server over HTTP."""

import socket
from pathlib import Path

import yaml

from kuangchao_core.models.llama import config_from_model_section, load_hf_llama_config
from tests.fixtures import hf_llama_config

ROOT = Path(__file__).resolve().parent.parent


def test_the_tiny_model_is_that_of_the_demo_config_and_changes_stay_in_their_copy(tiny_model):
    demo = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())["model"]
    assert tiny_model() == config_from_model_section({"preset": demo["preset"]})
    deeper = tiny_model(num_layers=4)
    assert deeper.num_layers == 4 and tiny_model().num_layers == 2


def test_the_transformers_config_loads_back_as_the_same_model(tiny_model, tmp_path):
    cfg = tiny_model(num_kv_heads=1, tie_embeddings=True, rope_theta=500000.0)
    hf_llama_config(cfg).save_pretrained(tmp_path)
    assert load_hf_llama_config(tmp_path) == cfg


def test_the_free_port_can_be_bound(free_port):
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port))


def test_the_s3_endpoint_stores_and_returns_an_object(s3_endpoint, monkeypatch):
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket="kc-fixture")
    s3.put_object(Bucket="kc-fixture", Key="a/b", Body=b"payload")
    assert s3.get_object(Bucket="kc-fixture", Key="a/b")["Body"].read() == b"payload"


def test_a_new_s3_server_starts_with_no_bucket_an_earlier_one_held(monkeypatch):
    import boto3

    from tests.fixtures import moto_server

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with moto_server() as first:
        boto3.client("s3", endpoint_url=first, region_name="us-east-1").create_bucket(Bucket="kc-leak")
    with moto_server() as second:
        names = [
            b["Name"]
            for b in boto3.client("s3", endpoint_url=second, region_name="us-east-1").list_buckets()["Buckets"]
        ]
    assert "kc-leak" not in names


def test_a_prefect_console_handler_left_on_a_closed_stream_is_pointed_at_todays_stderr(tmp_path):
    """tests/conftest.py's guard: a Prefect log line to a stream an in-process command closed fails every later test
    of the worker (a whole module errored at setup); before each module and test the handler is re-pointed."""
    import logging
    import sys

    from prefect.logging.handlers import PrefectConsoleHandler

    from tests.conftest import _prefect_console_on_a_live_stream

    closed = open(tmp_path / "stderr.txt", "w")  # a real file: its flush raises once closed (a StringIO's does not)
    handler = PrefectConsoleHandler(stream=closed)
    closed.close()
    logger = logging.getLogger("kc-test-closed-console")
    logger.addHandler(handler)
    try:
        _prefect_console_on_a_live_stream()
        assert handler.stream is sys.stderr and handler.console.file is sys.stderr
        handler.emit(logger.makeRecord(logger.name, logging.INFO, __file__, 1, "a line", None, None))
    finally:
        logger.removeHandler(handler)
