"""The suite's outcomes remembered per records and suite (kuangchao_core/data/validation_cache.py): the same records
and thresholds read the cached outcomes and give the same report; other records, thresholds or a bad entry run
the suite again."""

from __future__ import annotations

import json
import logging

import pytest

from kuangchao_core.data import validation as V
from kuangchao_core.data.validation_cache import FIELDS

CACHED = "the suite's outcomes are the cached ones"
RECORDS = [f"{i} + {i} = {2 * i}" for i in range(200)]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "validation"


def _run(records, caplog, **kwargs):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=V.__name__):
        report = V.validate_records(records, **kwargs)
    return report, CACHED in caplog.text


def test_the_same_records_and_suite_read_the_cached_outcomes_and_report_the_same(caplog, cache):
    first, cached = _run(RECORDS, caplog, planned_tokens=1000)
    assert first.success and not cached
    assert len(list(cache.glob("*.json"))) == 1
    again, cached = _run(list(RECORDS), caplog, planned_tokens=1000)
    assert cached and again.to_dict() == first.to_dict()


def test_other_records_or_thresholds_run_the_suite_again(caplog, cache):
    assert _run(RECORDS, caplog, planned_tokens=1000)[0].success
    # the controls: one blank record more, or a token need the records cannot meet, is checked afresh and fails
    blank, cached = _run([*RECORDS, "   "], caplog, planned_tokens=1000)
    assert not cached and [r.name for r in blank.failed] == ["no_empty_records"]
    short, cached = _run(RECORDS, caplog, planned_tokens=10**9)
    assert not cached and [r.name for r in short.failed] == ["enough_tokens"]
    assert len(list(cache.glob("*.json"))) == 3


def test_an_unreadable_or_malformed_entry_is_computed_again(caplog, cache):
    first, _ = _run(RECORDS, caplog, planned_tokens=1000)
    (entry,) = cache.glob("*.json")
    for bad in ("not json", json.dumps([{"name": "not_empty", "success": "yes"}]), "[]"):
        entry.write_text(bad)
        report, cached = _run(RECORDS, caplog, planned_tokens=1000)
        assert not cached and report.to_dict() == first.to_dict()
        assert {tuple(o) for o in json.loads(entry.read_text())} == {FIELDS}  # the entry rewritten whole
