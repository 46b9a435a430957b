"""Every requirement and issue the code cites resolves to a section of docs/architecture.md (the spec is not in the
repository, so the map there is what a citation points to), and the modules those sections name exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
#: where code lives (the tests cite requirements and issues too)
CODE_DIRS = ("kuangchao_core", "kuangchao", "flows", "tasks", "blocks", "deployments", "benchmarks", "tests")

SPEC_ID = r"(?:L[1-6](?:\.\d+)?|OPS\.\d+|RT\.\d+)"
#: ``SPEC L2.5``, ``SPEC L1.1, L1.4``, ``SPEC L2.5/L2.6``, ``SPEC L4.4, first step of L4.6``
SPEC_CITATION = re.compile(rf"\bSPEC\s+({SPEC_ID}(?:(?:\s*(?:,|/|\band\b|first step of))*\s*{SPEC_ID})*)")
#: a sub-requirement id anywhere (``(L3.6)``, ``OPS.4``, ``L5.2/L5.4``): the layer-only form needs ``SPEC`` before it
BARE_ID = re.compile(r"(?<![\w.])(L[1-6]\.\d+|OPS\.\d+|RT\.\d+)(?![\w])")
#: ``issue 26``, ``Issue 27 §3``, ``issues 16, 26``
ISSUE_CITATION = re.compile(r"\b[Ii]ssues?\s+#?(\d+)((?:\s*(?:,|\band\b)\s*#?\d+)*)")
HEADING = re.compile(r"^#{2,6}\s+(?:(?P<spec>" + SPEC_ID + r")|Issue\s+(?P<issue>\d+))(?:\s|$)")


def citations() -> tuple[dict[str, set[str]], dict[int, set[str]]]:
    """(spec id -> citing files, issue number -> citing files) over every Python file of the code."""
    spec: dict[str, set[str]] = {}
    issues: dict[int, set[str]] = {}
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            text = path.read_text(encoding="utf-8")
            for m in SPEC_CITATION.finditer(text):
                for sid in re.findall(SPEC_ID, m.group(1)):
                    spec.setdefault(sid, set()).add(rel)
            for m in BARE_ID.finditer(text):
                spec.setdefault(m.group(1), set()).add(rel)
            for m in ISSUE_CITATION.finditer(text):
                for number in [m.group(1), *re.findall(r"\d+", m.group(2))]:
                    issues.setdefault(int(number), set()).add(rel)
    return spec, issues


def sections(text: str) -> tuple[set[str], set[int]]:
    """The spec ids and issue numbers that head a section of the page."""
    spec: set[str] = set()
    issues: set[int] = set()
    for line in text.splitlines():
        m = HEADING.match(line)
        if m and m.group("spec"):
            spec.add(m.group("spec"))
        elif m:
            issues.add(int(m.group("issue")))
    return spec, issues


def test_every_spec_and_issue_citation_in_the_code_has_a_section_in_docs_architecture():
    cited_spec, cited_issues = citations()
    assert len(cited_spec) > 30 and len(cited_issues) > 10  # the scan sees the code's citations
    have_spec, have_issues = sections(ARCHITECTURE.read_text(encoding="utf-8"))
    missing = {sid: sorted(files)[:3] for sid, files in cited_spec.items() if sid not in have_spec}
    assert not missing, f"cited in the code, no section in docs/architecture.md: {missing}"
    missing_issues = {n: sorted(files)[:3] for n, files in cited_issues.items() if n not in have_issues}
    assert not missing_issues, f"issues cited in the code, no section in docs/architecture.md: {missing_issues}"


def test_the_check_catches_a_citation_without_a_section():
    """The negative control: the same resolution over a page missing one cited id and one cited issue fails."""
    page = ARCHITECTURE.read_text(encoding="utf-8")
    cut = re.sub(r"^#### L2\.5 .*$", "#### (removed)", page, flags=re.M)
    cut = re.sub(r"^### Issue 26$", "### (removed)", cut, flags=re.M)
    have_spec, have_issues = sections(cut)
    cited_spec, cited_issues = citations()
    assert "L2.5" in cited_spec and "L2.5" not in have_spec
    assert 26 in cited_issues and 26 not in have_issues
    assert SPEC_CITATION.search("(SPEC L4.4, first step of L4.6)").group(1).endswith("L4.6")


def test_the_modules_the_map_names_exist():
    page = ARCHITECTURE.read_text(encoding="utf-8")
    start = page.index("## Requirement map")
    named = set(re.findall(r"`([\w/]+\.py)`", page[start:]))
    assert len(named) > 40
    missing = [
        p
        for p in sorted(named)
        if not any((ROOT / base / p).is_file() for base in ("", "kuangchao_core", "kuangchao_core/engine"))
    ]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
