"""Data validation: the great-expectations suite, the file readers, and the Prefect task with its artifact and MLflow log."""

from __future__ import annotations

import json
import random

import pytest

from kuangchao_core.config import config_from_dict
from kuangchao_core.data import validation as V
from kuangchao_core.errors import DataError


def _good_docs(n: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["tide", "river", "stone", "wind", "lamp", "cloud", "field", "ember", "shore", "quartz"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) + f" #{i}" for i in range(n)]


def _cfg(tmp_path, path=None, steps=10, seq_len=16, **data):
    d = {
        "task": {"name": "val"},
        "model": {"preset": "tiny"},
        "data": {"path": str(path) if path else None, "seq_len": seq_len, **data},
        "train": {"steps": steps},
        "parallel": {"data_parallel_size": 2, "micro_batch_size": 2, "gradient_accumulation_steps": 2},
        "checkpoint": {"dir": str(tmp_path / "ckpt")},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    }
    return config_from_dict(d)


def test_good_data_passes_every_expectation():
    docs = _good_docs()
    rep = V.validate_records(docs, planned_tokens=5000, seq_len=16)
    assert rep.success, rep.summary
    assert [r.name for r in rep.results] == list(V.EXPECTATION_NAMES)
    assert rep.num_records == len(docs)
    assert rep.total_tokens == sum(len(d.encode()) for d in docs)
    assert json.loads(json.dumps(rep.to_dict()))["success"] is True


@pytest.mark.parametrize(
    "records, kwargs, failing",
    [
        ([], {}, "not_empty"),
        (_good_docs(50) + ["", "   \n"], {}, "no_empty_records"),
        (_good_docs(50) + ["x" * 5000], {"max_record_bytes": 4096}, "no_oversize_records"),
        (_good_docs(50) + [b"caf\xc3 au lait", b"\xff\xfe bad"], {}, "valid_utf8"),
        (_good_docs(50), {"planned_tokens": 10**7}, "enough_tokens"),
        (_good_docs(10) * 3, {}, "duplicate_share"),
    ],
    ids=["empty-dataset", "empty-records", "oversize", "invalid-utf8", "too-few-tokens", "duplicates"],
)
def test_bad_data_fails_with_the_named_expectation(records, kwargs, failing):
    rep = V.validate_records(records, **kwargs)
    assert not rep.success
    assert failing in {r.name for r in rep.failed}, rep.summary
    assert f"FAIL {failing}" in rep.summary
    if failing != "not_empty":  # an empty table fails the aggregate checks too; otherwise exactly one fails
        assert [r.name for r in rep.failed] == [failing], rep.summary


def test_token_requirement_honours_max_epochs():
    docs = _good_docs(20)
    total = sum(len(d.encode()) for d in docs)
    assert V.validate_records(docs, planned_tokens=total * 4, max_epochs=4).success
    rep = V.validate_records(docs, planned_tokens=total * 4 + 8, max_epochs=4)
    assert [r.name for r in rep.failed] == ["enough_tokens"]
    assert V.validate_records(docs, planned_tokens=total * 4 + 8, max_epochs=1).result("enough_tokens").success is False


def test_duplicate_limit_is_configurable():
    docs = _good_docs(10) * 3  # 2/3 duplicates
    assert not V.validate_records(docs).success
    assert V.validate_records(docs, max_duplicate_share=0.7).success


def test_tokenizer_counts_tokens_instead_of_bytes():
    class WordTokenizer:
        def encode(self, text):
            return text.split()

    docs = _good_docs(30)
    rep = V.validate_records(docs, tokenizer=WordTokenizer())
    assert rep.total_tokens == sum(len(d.split()) for d in docs)


def test_files_are_read_per_record(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    docs = _good_docs(40)
    (d / "a.txt").write_text("\n\n".join(docs[:20]) + "\n")
    with open(d / "b.jsonl", "wb") as f:
        for doc in docs[20:]:
            f.write(json.dumps({"text": doc}).encode() + b"\n")
        f.write(b'{"text": ""}\n')
        f.write(b'{"text": "caf\xe9"}\n')  # latin-1 byte: invalid UTF-8 on one record only
    cfg = _cfg(tmp_path, d, steps=5, txt_documents="blank_lines")  # a record per blank-line document
    records, source = V.load_records(cfg.data)
    assert len(records) == 42 and source == str(d)
    rep = V.validate_dataset(cfg)
    assert {r.name for r in rep.failed} == {"no_empty_records", "valid_utf8"}, rep.summary
    assert rep.result("valid_utf8").observed == 1


@pytest.mark.parametrize(
    ("line", "fragment"),
    [(b'{"text": 5}', "field 'text' is int, expected a string"), (b'{"text": null}', "is NoneType")],
    ids=["number", "null"],
)
def test_validation_refuses_what_training_refuses_with_the_same_words(tmp_path, line, fragment):
    from kuangchao_core.data.files import read_documents

    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(json.dumps({"text": doc}).encode() for doc in _good_docs(30)) + b"\n" + line + b"\n")
    with pytest.raises(DataError) as training:
        list(read_documents(path))
    with pytest.raises(DataError) as validation:  # it used to stringify the value and pass the data
        V.validate_dataset(_cfg(tmp_path, path, steps=2))
    assert fragment in str(training.value) and str(validation.value) == str(training.value)
    assert "d.jsonl:31" in str(training.value)


def test_parquet_records(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _good_docs(30)
    pq.write_table(pa.table({"body": docs}), tmp_path / "d.parquet")
    cfg = _cfg(tmp_path, tmp_path / "d.parquet", text_field="body", steps=2)
    rep = V.validate_dataset(cfg)
    assert rep.success, rep.summary
    assert rep.num_records == 30
    # the planned budget comes from the config: 10**5 steps x 8 sequences x 16 tokens is far beyond 30 records
    big = _cfg(tmp_path, tmp_path / "d.parquet", text_field="body", steps=10**5)
    assert [r.name for r in V.validate_dataset(big).failed] == ["enough_tokens"]


def test_synthetic_corpus_passes(tmp_path):
    rep = V.validate_dataset(_cfg(tmp_path, None, steps=20))
    assert rep.success, rep.summary
    assert rep.source == "synthetic corpus" and rep.num_records == 4096


def test_missing_path_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        V.validate_dataset(_cfg(tmp_path, tmp_path / "nope.txt"))


def test_a_vision_jobs_image_records_are_their_image_paths_and_turns(tmp_path):
    """A ``model.vision`` job's LLaVA records (the vision demo's set) pass as their image paths and turns: kc train's
    data check used to read them as sft records and stop the flow ("an sft record needs ... 'prompt'"). The four
    questions asked of every image repeat their text across images; the image's path keeps them distinct records."""
    from kuangchao_core.data.shapes import make_shape_set

    make_shape_set(tmp_path / "shapes", num_train=8, num_heldout=2, seed=0, size=16)
    path = tmp_path / "shapes" / "train.jsonl"
    cfg = _cfg(tmp_path, path, format="sft")
    vision = config_from_dict({**cfg.model_dump(), "model": {"preset": "tiny", "vision": {"image_size": 16}}})
    rep = V.validate_dataset(vision)
    assert rep.success and rep.num_records == 32 and rep.result("duplicate_share").observed == 0, rep.summary
    (text, where), *_ = V.load_located_records(vision.data, images=True)[0]
    first = json.loads(path.read_text().splitlines()[0])
    turns = [t["value"] for t in first["conversations"]]
    assert text == "\n".join([first["image"], *turns]) and where == f"{path}:1"
    with pytest.raises(DataError, match="an sft record needs"):  # control: the same job without model.vision
        V.validate_dataset(cfg)
    without_paths = [t.split("\n", 1)[1] for t, _ in V.load_located_records(vision.data, images=True)[0]]
    assert not V.validate_records(without_paths, seq_len=16).result("duplicate_share").success  # control: no paths
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({**first, "conversations": [*first["conversations"][:1], {"from": "gpt", "value": "<image>"}]})
    )
    with pytest.raises(DataError, match=r"bad.jsonl:1: conversations\[1\] is an answer holding <image>"):
        V.validate_dataset(
            config_from_dict({**vision.model_dump(), "data": {**vision.data.model_dump(), "path": str(bad)}})
        )


# ------------------------------------------------------------------ Prefect task, artifact and MLflow


def _mlflow_run(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("val", artifact_location=str(tmp_path / "artifacts"))
    return client, uri, client.create_run(exp).info.run_id


def test_task_logs_artifact_and_mlflow_and_stops_on_bad_data(prefect_api, tmp_path):
    from prefect import flow
    from prefect.client.orchestration import get_client

    from tasks.validate_data import validate_data as validate_data_task

    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": t}) + "\n" for t in _good_docs(60)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"text": t}) + "\n" for t in _good_docs(5) * 4))
    client, uri, run_good = _mlflow_run(tmp_path)
    run_bad = client.create_run(client.get_experiment_by_name("val").experiment_id).info.run_id
    started = []
    runs = []  # this test's flow runs: the session's Prefect server also holds other tests' artifacts

    @flow
    def pipeline(path, run_id):
        from prefect.runtime import flow_run

        runs.append(flow_run.get_id())
        report = validate_data_task(_cfg(tmp_path, path, steps=5), mlflow_run_id=run_id, tracking_uri=uri)
        started.append(path)  # stands for the launch step: reached only when validation passed
        return report

    out = pipeline(str(good), run_good)
    assert out["success"] is True and started == [str(good)]
    with pytest.raises(DataError) as err:
        pipeline(str(bad), run_bad)
    assert "duplicate_share" in str(err.value) and "FAIL duplicate_share" in str(err.value)
    assert started == [str(good)]  # the bad dataset never reached the step after validation

    for run_id, ok in ((run_good, True), (run_bad, False)):
        run = client.get_run(run_id)
        assert run.data.metrics["data_valid"] == (1.0 if ok else 0.0)
        assert run.data.tags["data_valid"] == str(ok).lower()
        local = client.download_artifacts(run_id, "data_validation/report.json", str(tmp_path / run_id))
        saved = json.loads(open(local).read())
        assert saved["success"] is ok
        assert {r["name"] for r in saved["results"]} == set(V.EXPECTATION_NAMES)

    import asyncio

    async def artifacts():
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

        async with get_client() as c:
            return await c.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["kc-data-validation"]))
            )

    arts = [a for a in asyncio.run(artifacts()) if str(a.flow_run_id) in runs]
    assert len(arts) == 2
    assert any("duplicate_share | **FAIL**" in a.data for a in arts)


def _peak_growth(fn) -> tuple[object, int]:
    """``(fn(), the peak growth of allocated bytes while it ran)``, traced by tracemalloc (numpy and pandas report
    their buffers to it): exact whatever memory the process freed before, unlike the resident size, which a worker
    that ran other tests may not grow at all."""
    import tracemalloc

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_the_check_streams_its_records(tmp_path):
    """Issue 38: the check reads each record once and keeps about 27 bytes of it (``record_facts``), so 8 MB of
    4 KB records add far less than their size; control: holding the records as the check did before (a list of
    them, ``load_located_records``) grows by at least their size."""
    path = tmp_path / "big.jsonl"
    body = "tide river stone " * 240
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(2000):
            fh.write(json.dumps({"text": f"{i:06d} {body}"}) + "\n")
    size = path.stat().st_size
    assert size > 8_000_000
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"text": body}) + "\n", encoding="utf-8")
    V.validate_dataset(_cfg(tmp_path, small, steps=1))  # imports and GX's context made before measuring
    cfg = _cfg(tmp_path, path, steps=10)
    rep, grew = _peak_growth(lambda: V.validate_dataset(cfg))
    assert rep.success and rep.num_records == 2000 and rep.total_tokens > 8_000_000 - 2000 * 40
    assert grew < size // 2, (grew, size)
    held, grew_held = _peak_growth(lambda: V.load_located_records(cfg.data))
    assert len(held[0]) == 2000 and grew_held >= size - 2000 * 40, (grew_held, size)  # control
