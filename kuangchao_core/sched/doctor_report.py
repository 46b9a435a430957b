"""What ``kc doctor`` reports: one :class:`Check` per probe, gathered in a :class:`DoctorReport`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Check:
    """One doctor check: ``fix`` says what to do when ``ok`` is false, or when ``warn`` marks a passed check that
    deserves attention (it does not fail the report); ``transient`` when the failure is one a later try may pass (a
    service or node that did not answer in time, a refused connection), so the flow's ``doctor`` task retries it
    (issue 44 item 4)."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    transient: bool = False
    warn: bool = False


@dataclass
class DoctorReport:
    """All checks of one doctor run."""

    checks: list[Check] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True when every check passed."""
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        """The checks that failed."""
        return [c for c in self.checks if not c.ok]

    def failure_kind(self) -> tuple[bool, str]:
        """``(transient, reason)`` of this report's failure (issue 44 item 4): transient only when every failed
        check is; one that a retry cannot mend makes the whole failure permanent."""
        lasting = [c.name for c in self.failed if not c.transient]
        if lasting or not self.failed:
            return False, f"failed doctor checks a retry cannot mend: {', '.join(lasting) or 'none named'}"
        return True, f"failed doctor checks that may pass on a later try: {', '.join(c.name for c in self.failed)}"

    @property
    def warnings(self) -> list[Check]:
        """The checks that passed with a warning."""
        return [c for c in self.checks if c.ok and c.warn]

    def check(self, name: str) -> Check:
        """The check called ``name``."""
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"ok": self.ok, "elapsed_s": round(self.elapsed_s, 3), "checks": [asdict(c) for c in self.checks]}

    def to_markdown(self) -> str:
        """Markdown table (for a Prefect artifact)."""
        lines = [
            f"# kc doctor: {'all checks passed' if self.ok else f'{len(self.failed)} check(s) FAILED'}",
            "",
            "| check | result | detail | fix |",
            "|---|---|---|---|",
        ]
        for c in self.checks:
            result = "**FAIL**" if not c.ok else "warn" if c.warn else "ok"
            cells = [c.name, result, c.detail, c.fix if not c.ok or c.warn else ""]
            lines.append("| " + " | ".join(x.replace("|", "\\|").replace("\n", " ") for x in cells) + " |")
        return "\n".join(lines) + "\n"
