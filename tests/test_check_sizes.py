"""The size rule of ``make lint`` (tools/check_sizes.py) on small made-up trees."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_sizes", ROOT / "tools" / "check_sizes.py")
check_sizes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_sizes)


def _tree(tmp_path: Path, files: dict[str, int]) -> Path:
    for name, lines in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x = 1\n" * lines)
    return tmp_path


def test_a_module_past_the_limit_fails_unless_listed_and_a_listed_one_may_not_grow(tmp_path):
    root = _tree(tmp_path, {"pkg/small.py": 400, "pkg/big.py": 401, "pkg/old.py": 450, ".venv/lib/huge.py": 9000})
    sizes = check_sizes.python_modules(root)
    assert sizes == {"pkg/small.py": 400, "pkg/big.py": 401, "pkg/old.py": 450}  # hidden folders are skipped
    found = check_sizes.problems(sizes, {"pkg/old.py": 450})
    assert len(found) == 1 and found[0].startswith("pkg/big.py: 401 lines, over the 400-line limit")
    grown = check_sizes.problems({**sizes, "pkg/big.py": 10}, {"pkg/old.py": 449})
    assert grown == ["pkg/old.py: 450 lines, over its listed ceiling of 449: listed files may only shrink"]


def test_unneeded_entries_fail_and_update_only_lowers(tmp_path):
    sizes = {"a.py": 420, "b.py": 300}
    found = check_sizes.problems(sizes, {"a.py": 430, "b.py": 410, "gone.py": 500})
    assert any(f.startswith("b.py: 300 lines, within the limit") for f in found)
    assert any(f.startswith("gone.py: listed with ceiling 500 but no longer exists") for f in found)
    assert check_sizes.lowered(sizes, {"a.py": 430, "b.py": 410, "gone.py": 500}) == {"a.py": 420}
    assert check_sizes.lowered({"a.py": 440}, {"a.py": 430}) == {"a.py": 430}  # never raised


def test_the_exception_list_round_trips(tmp_path):
    listed = tmp_path / "exceptions.txt"
    check_sizes.write_exceptions(listed, {"z.py": 401, "a/b.py": 999})
    assert check_sizes.read_exceptions(listed) == {"a/b.py": 999, "z.py": 401}
