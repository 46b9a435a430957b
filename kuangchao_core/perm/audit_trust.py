"""What ``kc audit --verify`` trusts for a job's audit log, and the verification that uses it (issue 16).

With a run directory (:func:`trust_for_run`) the expected job is ``<run>/job_id``, the trust store
``<run>/authority/trust_store.json`` and the pins ``<run>/authority/audit_pins.json``; the mode is the pins'
(``enforcing`` if any pin says so), else the run's ``config.yaml`` ``permission.mode``, else ``enforcing``. Without
one (:func:`trust_for_log`) the trust store is ``<log>.trust.json`` beside the log — the log's writer can replace it,
so the trust is *unpinned* unless pins are given — and the mode is unknown unless asked for.

:func:`verify_with_trust` fails an enforcing job's log without a trust store, signed checkpoints, an expected job or
pins, and any log that disagrees with its pins; :func:`missing_log_report` reports pins or anchors without a log.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from kuangchao_core.perm.audit_chain import anchors_path_for
from kuangchao_core.perm.audit_pins import AuditPin, AuditPinError, load_pins_file, pins_path, verify_against_pins
from kuangchao_core.perm.audit_verify import VerifyReport, verify_log
from kuangchao_core.perm.tokens import TrustStore

MODES = ("enforcing", "trusted")


@dataclass
class AuditTrust:
    """The expected job, mode, trust store and pins one log is checked against, and where each came from."""

    job_id: str | None = None
    mode: str | None = None
    trust_store: TrustStore | None = None
    trust_source: Path | None = None
    pins: list[AuditPin] = field(default_factory=list)
    pins_sources: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)

    @property
    def pinned(self) -> bool:
        """Whether the log is checked against pins kept outside its directory."""
        return bool(self.pins)


def _load_trust_store(trust: AuditTrust, path: Path) -> None:
    trust.trust_source = path
    if not path.exists():
        return
    try:
        trust.trust_store = TrustStore.load(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        trust.problems.append(("bad_trust_store", f"trust store {path} is unreadable: {exc}"))


def _add_pins(trust: AuditTrust, path: Path) -> None:
    try:
        trust.pins.extend(load_pins_file(path))
    except AuditPinError as exc:
        trust.problems.append(("bad_pins", str(exc)))
    trust.pins_sources.append(path)


def _job_from_pins(trust: AuditTrust) -> None:
    jobs = {p.job_id for p in trust.pins}
    if trust.job_id is None and len(jobs) == 1:
        trust.job_id = jobs.pop()
        trust.notes.append(f"expected job {trust.job_id!r} taken from the pins")


def _config_mode(run_dir: Path) -> str | None:
    import yaml

    try:
        data = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        mode = data["permission"]["mode"]
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None
    return mode if mode in MODES else None


def trust_for_run(
    run_dir: str | os.PathLike,
    *,
    job_id: str | None = None,
    mode: str | None = None,
    trust_store: str | os.PathLike | None = None,
    pins_file: str | os.PathLike | None = None,
) -> AuditTrust:
    """The trust of the run in ``run_dir`` (see module docstring); ``ValueError`` if ``job_id`` contradicts it.

    ``trust_store`` replaces the run's trust store; ``pins_file`` (e.g. the MLflow ``audit/pins.json``) adds pins.
    """
    run = Path(run_dir)
    trust = AuditTrust()
    id_file = run / "job_id"
    run_job = id_file.read_text(encoding="utf-8").strip() if id_file.exists() else None
    if job_id and run_job and job_id != run_job:
        raise ValueError(f"--job-id {job_id!r} is not the job of {run} ({run_job!r} in {id_file})")
    trust.job_id = job_id or run_job
    _add_pins(trust, pins_path(run / "authority"))
    if pins_file:
        _add_pins(trust, Path(pins_file))
    _job_from_pins(trust)
    _load_trust_store(trust, Path(trust_store) if trust_store else run / "authority" / "trust_store.json")
    pin_modes = {p.mode for p in trust.pins if p.mode}
    if mode:
        trust.mode = mode
        if mode == "trusted" and "enforcing" in pin_modes:
            trust.notes.append("the pins say the job was enforcing; checked as trusted, as asked (--mode)")
    elif "enforcing" in pin_modes or pin_modes == {"trusted"}:
        trust.mode = "enforcing" if "enforcing" in pin_modes else "trusted"
    else:
        trust.mode = _config_mode(run) or "enforcing"
    return trust


def trust_for_log(
    log_path: str | os.PathLike,
    *,
    job_id: str | None = None,
    mode: str | None = None,
    trust_store: str | os.PathLike | None = None,
    pins_file: str | os.PathLike | None = None,
) -> AuditTrust:
    """The trust of a log verified without its run: ``trust_store`` or ``<log>.trust.json``, pins only from
    ``pins_file``, the mode only as asked (``None``: unknown, missing checkpoints only warn)."""
    trust = AuditTrust(job_id=job_id, mode=mode)
    if pins_file:
        _add_pins(trust, Path(pins_file))
    _job_from_pins(trust)
    _load_trust_store(trust, Path(trust_store) if trust_store else Path(f"{log_path}.trust.json"))
    return trust


def run_log_paths(run_dir: str | os.PathLike, trust: AuditTrust) -> list[Path]:
    """The job's log files: those the pins name, else the one the run's ``config.yaml`` puts it at (existing or not)."""
    paths: list[Path] = []
    for p in trust.pins:
        if Path(p.log_path) not in paths:
            paths.append(Path(p.log_path))
    if paths or trust.job_id is None:
        return paths
    config = Path(run_dir) / "config.yaml"
    if not config.exists():
        return []
    try:
        from kuangchao_core.config import load_config
        from kuangchao_core.perm.issuance import audit_log_path

        return [audit_log_path(load_config(str(config)), trust.job_id)]
    except Exception:  # an unreadable config only loses this guess; the pins or --log still name the log
        return []


def verify_with_trust(path: str | os.PathLike, trust: AuditTrust) -> VerifyReport:
    """:func:`verify_log` of ``path`` against ``trust``: chain, checkpoints, the expected job, pins and the mode's
    requirements; every shortfall of an enforcing job's evidence is a failure, of an unknown mode a warning."""
    enforcing = trust.mode == "enforcing"
    report = verify_log(
        path,
        log_id=trust.job_id,
        trust_store=trust.trust_store,
        hash_at=[p.seq for p in trust.pins],
        require_anchors=enforcing,
    )
    for problem, detail in trust.problems:
        report.add_problem(problem, detail)
    if enforcing and trust.trust_store is None:
        report.add_problem(
            "no_trust_store",
            f"enforcing job: no trust store at {trust.trust_source}, so the checkpoints' signatures cannot be checked",
        )
    if trust.job_id is None:
        if enforcing:
            report.add_problem(
                "no_job_id", "enforcing job: the expected job is unknown; pass --run RUN_DIR or --job-id"
            )
        else:
            report.warnings.append(f"job id {report.log_id!r} taken from the log itself (pass --run or --job-id)")
    if trust.pins:
        expected = trust.job_id or report.log_id or ""
        for problem in verify_against_pins(report, trust.pins, expected, trust_store=trust.trust_store):
            report.add_problem(problem.problem, problem.detail)
    elif enforcing:
        where = ", ".join(str(s) for s in trust.pins_sources) or "none given"
        report.add_problem(
            "no_pins",
            f"enforcing job: no audit pins ({where}), so a log rewritten with a new key cannot be told apart; "
            "pass --run RUN_DIR (or --pins FILE)",
        )
    if not trust.pins:
        report.warnings.append(
            f"trust unpinned: the trust store ({trust.trust_source}) is not checked against pins kept outside the "
            "log's directory; pass --run RUN_DIR"
        )
    report.warnings.extend(trust.notes)
    return report


def missing_log_report(path: str | os.PathLike, trust: AuditTrust) -> VerifyReport:
    """The failed report of a log that is gone while its pins, anchors or trust file remain."""
    path = Path(path)
    left = [f"pin at seq {p.seq}" for p in trust.pins if Path(p.log_path) == path.resolve()]
    for extra in (anchors_path_for(path), Path(f"{path}.trust.json")):
        if extra.exists():
            left.append(str(extra))
    report = VerifyReport(ok=True, log_id=trust.job_id, records=0)
    report.add_problem(
        "anchors_without_log",
        f"anchors without a log: {path} does not exist but {', '.join(left) or 'its pins'} remain; the log was deleted",
    )
    return report


def orphaned_logs(candidates: list[Path]) -> list[Path]:
    """The logs among ``candidates`` that are missing although their signed checkpoints (``.anchors``) exist."""
    return [p for p in candidates if not p.exists() and anchors_path_for(p).exists()]
