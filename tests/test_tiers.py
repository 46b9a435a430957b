"""Every test has exactly one tier (tests/tiers.py): the mapping covers every test file, names only real tests, and
the rules pick the tier in their documented order."""

import ast
from pathlib import Path

import pytest

from tests import tiers

TESTS = Path(__file__).resolve().parent


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_test_file_has_a_tier_and_every_entry_names_a_real_file_or_test():
    on_disk = {p.name for p in TESTS.glob("test_*.py")}
    assert sorted(on_disk - set(tiers.FILE_TIERS)) == [], "add these files to FILE_TIERS in tests/tiers.py"
    assert sorted(set(tiers.FILE_TIERS) - on_disk) == [], "these FILE_TIERS entries name no file: remove them"
    assert set(tiers.FILE_TIERS.values()) <= set(tiers.TIERS)
    for key, tier in tiers.TEST_TIERS.items():
        file, test = key.split("::")
        assert test in _test_functions(TESTS / file), f"TEST_TIERS names {key}, which is no test"
        assert tier in tiers.TIERS, f"{key}: {tier!r} is no tier"


def test_the_tier_comes_from_the_marker_then_the_test_then_the_fixture_then_the_file(monkeypatch):
    monkeypatch.setattr(tiers, "FILE_TIERS", {"test_a.py": "unit"})
    monkeypatch.setattr(tiers, "TEST_TIERS", {"test_a.py::test_flowish": "e2e"})
    assert tiers.tier_of("test_a.py", "test_plain", [], ["tmp_path"]) == "unit"
    assert tiers.tier_of("test_a.py", "test_plain", [], ["prefect_api"]) == "flows"
    assert tiers.tier_of("test_a.py", "test_flowish", [], ["prefect_api"]) == "e2e"
    assert tiers.tier_of("test_a.py", "test_flowish", ["distributed"], ["prefect_api"]) == "distributed"
    assert tiers.tier_of("test_new.py", "test_x", ["unit", "unit"], []) == "unit"  # module and test say the same


def test_no_tier_two_tiers_or_an_unknown_one_is_an_error_naming_the_test(monkeypatch):
    monkeypatch.setattr(tiers, "FILE_TIERS", {"test_a.py": "fast"})
    with pytest.raises(tiers.TierError, match=r"test_new.py::test_x has no tier: add 'test_new.py' to FILE_TIERS"):
        tiers.tier_of("test_new.py", "test_x", [], [])
    with pytest.raises(tiers.TierError, match=r"test_a.py::test_x is marked with 2 tiers \(e2e, unit\)"):
        tiers.tier_of("test_a.py", "test_x", ["unit", "e2e"], [])
    with pytest.raises(tiers.TierError, match=r"test_a.py::test_x has tier 'fast', not one of unit, distributed"):
        tiers.tier_of("test_a.py", "test_x", [], [])


def test_pyproject_declares_every_tier_marker():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    ini = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    declared = {m.split(":", 1)[0] for m in ini["markers"]}
    assert set(tiers.TIERS) <= declared


def test_this_session_marked_this_test_unit(request):
    assert [m.name for m in request.node.iter_markers() if m.name in tiers.TIERS] == ["unit"]
