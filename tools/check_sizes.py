"""The size rule: no Python module grows past 400 lines.

Modules already longer are listed in ``tools/size_exceptions.txt`` as ``path ceiling``: the ceiling is the file's
line count when it was listed, so a listed file may shrink but never grow. The check fails when a module passes its
limit, and when the list holds an entry that is no longer needed (the file is gone or back within 400 lines).
``--update`` lowers every ceiling to its file's line count and drops unneeded entries; it never raises a ceiling.

Run from the repository root: ``python tools/check_sizes.py`` (``make lint`` does).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

LIMIT = 400
ROOT = Path(__file__).resolve().parent.parent
EXCEPTIONS = ROOT / "tools" / "size_exceptions.txt"
SKIP_DIRS = {"__pycache__", "build", "dist", "node_modules"}


def python_modules(root: Path) -> dict[str, int]:
    """Every ``.py`` file under ``root`` (hidden folders, virtual environments and build output skipped), by its
    path relative to ``root``, with its line count."""
    sizes: dict[str, int] = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(
            d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS and not d.endswith(".egg-info")
        )
        for name in files:
            if name.endswith(".py"):
                path = Path(folder) / name
                with open(path, "rb") as f:
                    sizes[path.relative_to(root).as_posix()] = sum(1 for _ in f)
    return sizes


def read_exceptions(path: Path) -> dict[str, int]:
    """The exception list: ``{module path: ceiling}``. Blank lines and ``#`` comments are ignored."""
    ceilings: dict[str, int] = {}
    if not path.exists():
        return ceilings
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            raise SystemExit(f"{path}:{number}: expected 'path ceiling', got {line!r}")
        if parts[0] in ceilings:
            raise SystemExit(f"{path}:{number}: {parts[0]} is listed twice")
        ceilings[parts[0]] = int(parts[1])
    return ceilings


def problems(sizes: dict[str, int], ceilings: dict[str, int], limit: int = LIMIT) -> list[str]:
    """Every breach of the rule, one sentence each (empty when the tree keeps it)."""
    found = []
    for path, lines in sorted(sizes.items()):
        ceiling = ceilings.get(path)
        if ceiling is None and lines > limit:
            found.append(f"{path}: {lines} lines, over the {limit}-line limit: split it into smaller modules")
        elif ceiling is not None and lines > ceiling:
            found.append(f"{path}: {lines} lines, over its listed ceiling of {ceiling}: listed files may only shrink")
    for path, ceiling in sorted(ceilings.items()):
        if path not in sizes:
            found.append(f"{path}: listed with ceiling {ceiling} but no longer exists: remove its entry")
        elif sizes[path] <= limit:
            found.append(f"{path}: {sizes[path]} lines, within the limit now: remove its entry from the list")
    return found


def lowered(sizes: dict[str, int], ceilings: dict[str, int], limit: int = LIMIT) -> dict[str, int]:
    """The exception list after ``--update``: ceilings lowered to today's counts, unneeded entries dropped."""
    return {path: min(ceiling, sizes[path]) for path, ceiling in ceilings.items() if sizes.get(path, 0) > limit}


def write_exceptions(path: Path, ceilings: dict[str, int]) -> None:
    """Write the exception list, sorted by path, with its header."""
    header = (
        f"# Modules longer than the {LIMIT}-line limit of tools/check_sizes.py, each with its ceiling (its line count\n"
        "# when listed). Entries may only be lowered or removed: `python tools/check_sizes.py --update` does both.\n"
    )
    path.write_text(header + "".join(f"{p} {c}\n" for p, c in sorted(ceilings.items())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="lower the ceilings to today's counts (never raise)")
    args = parser.parse_args(argv)
    sizes = python_modules(ROOT)
    ceilings = read_exceptions(EXCEPTIONS)
    if args.update:
        write_exceptions(EXCEPTIONS, lowered(sizes, ceilings))
        ceilings = read_exceptions(EXCEPTIONS)
    found = problems(sizes, ceilings)
    for line in found:
        print(line, file=sys.stderr)
    if found:
        return 1
    shrunk = [p for p, c in ceilings.items() if sizes[p] < c]
    if shrunk:
        print(f"{len(shrunk)} listed module(s) shrank: `python tools/check_sizes.py --update` lowers their ceilings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
