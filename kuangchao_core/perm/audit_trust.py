"""What ``kc audit --verify`` trusts for a job's audit log, and the verification that uses it (issues 16, 26).

Trust comes from the pins kept outside the run directory (:mod:`~kuangchao_core.perm.audit_external`: the MLflow
run, the Prefect artifact, or a file given with ``--pins``): the expected job, the mode and the audit key (its public
key and fingerprint) are the pins'. The run's own files — ``job_id``, ``config.yaml``,
``authority/trust_store.json``, ``authority/audit_pins.json``, ``<log>.trust.json`` — are only compared with them: a
worker's uid can rewrite every one of them. Without external pins the mode is ``--mode``, else ``enforcing`` for a
run (:func:`trust_for_run`) and for a log that shows an authority's hand (signed checkpoints, a trust file beside it,
records naming a token), else unknown (:func:`trust_for_log`).

:func:`verify_with_trust` fails an enforcing job's log without external pins, without signed checkpoints, with a
record after its sealed pin or — unless ``allow_unsealed`` (a job still running) — without a sealed pin at all, so
no record after the last signed checkpoint goes unvouched; :func:`missing_log_report` reports pins or anchors
without a log.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from kuangchao_core.perm.audit_chain import anchors_path_for
from kuangchao_core.perm.audit_external import ExternalPins
from kuangchao_core.perm.audit_pins import AuditPin, AuditPinError, load_pins_file, pins_path
from kuangchao_core.perm.audit_verify import VerifyReport, read_records, verify_log
from kuangchao_core.perm.pin_check import verify_against_pins
from kuangchao_core.perm.tokens import PURPOSE_AUDIT, TrustedKey, TrustStore

MODES = ("enforcing", "trusted")


@dataclass
class AuditTrust:
    """The expected job, mode, keys and pins one log is checked against, and where each came from.

    ``external``: the pins found outside the run directory (they decide); ``pins``: every pin the log is checked
    against (the run's own ``audit_pins.json`` too); ``pinned_store``: the audit keys the external pins carry.
    """

    job_id: str | None = None
    mode: str | None = None
    trust_store: TrustStore | None = None
    trust_source: Path | None = None
    pins: list[AuditPin] = field(default_factory=list)
    pins_sources: list[str] = field(default_factory=list)
    external: list[AuditPin] = field(default_factory=list)
    external_sources: list[str] = field(default_factory=list)
    pinned_store: TrustStore | None = None
    allow_unsealed: bool = False
    notes: list[str] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)

    @property
    def pinned(self) -> bool:
        """Whether the log is checked against pins kept outside the run directory."""
        return bool(self.external)


def _load_trust_store(trust: AuditTrust, path: Path) -> None:
    trust.trust_source = path
    if not path.exists():
        return
    try:
        trust.trust_store = TrustStore.load(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        trust.problems.append(("bad_trust_store", f"trust store {path} is unreadable: {exc}"))


def _file_pins(path: Path, trust: AuditTrust) -> list[AuditPin]:
    try:
        return load_pins_file(path)
    except AuditPinError as exc:
        trust.problems.append(("bad_pins", str(exc)))
        return []


def _add_external(trust: AuditTrust, found: list[tuple[AuditPin, str]]) -> None:
    for pin, source in found:
        if pin not in trust.external:
            trust.external.append(pin)
            trust.pins.append(pin)
        if source not in trust.external_sources:
            trust.external_sources.append(source)


def _settle(trust: AuditTrust, job_id: str | None, mode: str | None, fallback_mode: str | None) -> None:
    """The expected job, the mode and the pinned keys, from the external pins; ``job_id``/``mode``: as asked."""
    jobs = sorted({p.job_id for p in trust.external})
    if job_id and jobs and jobs != [job_id]:
        trust.problems.append(
            ("pin_wrong_job", f"the job is {job_id!r}, but the pins outside the run name {', '.join(jobs)}")
        )
    trust.job_id = job_id or (jobs[0] if len(jobs) == 1 else None)
    if jobs and not job_id:
        trust.notes.append(f"expected job {trust.job_id!r} taken from the pins outside the run")
    pin_modes = {p.mode for p in trust.external if p.mode}
    if mode:
        trust.mode = mode
        if mode == "trusted" and "enforcing" in pin_modes:
            trust.notes.append("the pins say the job was enforcing; checked as trusted, as asked (--mode)")
    elif pin_modes:
        trust.mode = "enforcing" if "enforcing" in pin_modes else "trusted"
    elif trust.external:
        trust.mode = "enforcing"
    else:
        trust.mode = fallback_mode
    keys = {p.audit_kid: p.public_key() for p in trust.external if p.audit_key}
    if keys:
        trust.pinned_store = TrustStore(keys={k: TrustedKey(k, PURPOSE_AUDIT, raw) for k, raw in keys.items()})


def trust_for_run(
    run_dir: str | os.PathLike,
    *,
    job_id: str | None = None,
    mode: str | None = None,
    trust_store: str | os.PathLike | None = None,
    pins_file: str | os.PathLike | None = None,
    external: ExternalPins | None = None,
    allow_unsealed: bool = False,
) -> AuditTrust:
    """The trust of the run in ``run_dir`` (see module docstring); ``ValueError`` if ``job_id`` contradicts the
    run's ``job_id`` file. ``external``: the pins found outside (``None``: none looked for); ``pins_file``: more
    external pins (e.g. MLflow's ``audit/pins.json`` saved by hand); ``trust_store`` replaces the run's."""
    run = Path(run_dir)
    trust = AuditTrust(allow_unsealed=allow_unsealed)
    id_file = run / "job_id"
    run_job = id_file.read_text(encoding="utf-8").strip() if id_file.exists() else None
    if job_id and run_job and job_id != run_job:
        raise ValueError(f"--job-id {job_id!r} is not the job of {run} ({run_job!r} in {id_file})")
    if external is not None:
        _add_external(trust, external.for_run(run, job_id or run_job) + external.for_job(job_id or run_job))
        trust.external_sources.extend(s for s in external.sources if s not in trust.external_sources)
        trust.notes.extend(external.notes)
    if pins_file:
        _add_external(trust, [(p, str(pins_file)) for p in _file_pins(Path(pins_file), trust)])
    local = pins_path(run / "authority")
    trust.pins.extend(p for p in _file_pins(local, trust) if p not in trust.pins)
    trust.pins_sources.append(str(local))
    _settle(trust, job_id, mode, "enforcing")
    if trust.external and run_job and trust.job_id and run_job != trust.job_id:
        trust.problems.append(
            ("job_id_mismatch", f"{id_file} says {run_job!r}, the pins outside the run say {trust.job_id!r}")
        )
    if not trust.external and trust.job_id is None:
        trust.job_id = run_job
    if not trust.external and run_job:
        trust.notes.append(f"expected job {run_job!r} read from {id_file} (no pins outside the run)")
    _load_trust_store(trust, Path(trust_store) if trust_store else run / "authority" / "trust_store.json")
    return trust


def log_job_ids(log_path: str | os.PathLike) -> list[str]:
    """The job ids a log names (its records' and its anchors' ``log_id``): how its pins are found wherever it lies."""
    ids: list[str] = []
    for path in (log_path, anchors_path_for(log_path)):
        try:
            for rec in read_records(path):
                if isinstance(rec.get("log_id"), str) and rec["log_id"] not in ids:
                    ids.append(rec["log_id"])
        except (OSError, RecursionError):  # no anchors, or a line nested too deep: the ids read so far
            continue
    return ids


def job_pins(external: ExternalPins, log_path: str | os.PathLike) -> list[tuple[AuditPin, str]]:
    """The external pins of every job the log at ``log_path`` names (:func:`log_job_ids`), wherever they say it is."""
    return [found for job in log_job_ids(log_path) for found in external.for_job(job)]


def with_log_job_pins(trust: AuditTrust, log_path: str | os.PathLike, external: ExternalPins | None) -> AuditTrust:
    """``trust`` (of a run) for a log given with it: the pins of another job that the log names make it fail
    (``pin_wrong_job``) and are checked against it, so a job's sealed log copied beside another run never passes."""
    extra = [(p, s) for p, s in (job_pins(external, log_path) if external else []) if p not in trust.pins]
    if not extra:
        return trust
    jobs = sorted({p.job_id for p, _ in extra})
    problem = (
        "pin_wrong_job",
        f"{log_path} names job {', '.join(jobs)}, whose pins outside the run ({extra[0][1]}) are not the run's "
        f"job {trust.job_id!r}",
    )
    return replace(trust, pins=trust.pins + [p for p, _ in extra], problems=[*trust.problems, problem])


def _looks_enforcing(log_path: Path) -> bool:
    """Whether a log shows an authority's hand: signed checkpoints or a trust file beside it, or records naming a
    token (only an enforcing job's modules hold tokens)."""
    if anchors_path_for(log_path).exists() or Path(f"{log_path}.trust.json").exists():
        return True
    try:
        return any(r.get("jti") or str(r.get("resource", "")).startswith("token:") for r in read_records(log_path))
    except OSError:
        return False


def trust_for_log(
    log_path: str | os.PathLike,
    *,
    job_id: str | None = None,
    mode: str | None = None,
    trust_store: str | os.PathLike | None = None,
    pins_file: str | os.PathLike | None = None,
    external: ExternalPins | None = None,
    allow_unsealed: bool = False,
) -> AuditTrust:
    """The trust of a log verified without its run: the external pins that name the log or a job the log names (a
    copy at another path meets its job's pins, issue 38), and ``pins_file``;
    the keys, job and mode are theirs. Without any: ``--mode``, else enforcing when the log looks like an enforcing
    job's (see :func:`_looks_enforcing`), else unknown (missing evidence only warns). The trust store is
    ``trust_store`` or ``<log>.trust.json``, compared with the pins."""
    trust = AuditTrust(allow_unsealed=allow_unsealed)
    if external is not None:
        _add_external(trust, external.for_log(log_path) + job_pins(external, log_path))
        here = str(Path(log_path).resolve())
        for where in sorted({p.log_path for p in trust.external if p.log_path != here}):
            trust.notes.append(f"the log's job was pinned at {where}: checked against those pins, not its path")
        trust.external_sources.extend(s for s in external.sources if s not in trust.external_sources)
        trust.notes.extend(external.notes)
    if pins_file:
        _add_external(trust, [(p, str(pins_file)) for p in _file_pins(Path(pins_file), trust)])
    fallback = "enforcing" if _looks_enforcing(Path(log_path)) else None
    _settle(trust, job_id, mode, fallback)
    _load_trust_store(trust, Path(trust_store) if trust_store else Path(f"{log_path}.trust.json"))
    return trust


def run_log_paths(run_dir: str | os.PathLike, trust: AuditTrust) -> list[Path]:
    """The job's log files: those the external pins name (else the run's own pins), else the one the run's
    ``config.yaml`` puts it at (existing or not)."""
    paths: list[Path] = []
    for p in trust.external or trust.pins:
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
    """:func:`verify_log` of ``path`` against ``trust``: chain, checkpoints (signed by a pinned key), the expected
    job, pins, the seal and the mode's requirements; every shortfall of an enforcing job's evidence is a failure, of
    an unknown mode a warning."""
    enforcing = trust.mode == "enforcing"
    report = verify_log(
        path,
        log_id=trust.job_id,
        trust_store=trust.pinned_store or trust.trust_store,
        hash_at=[p.seq for p in trust.pins],
        require_anchors=enforcing,
    )
    for problem, detail in trust.problems:
        report.add_problem(problem, detail)
    if enforcing and trust.pinned_store is None and trust.trust_store is None:
        report.add_problem(
            "no_trust_store",
            f"enforcing job: no pinned audit key and no trust store at {trust.trust_source}, so the checkpoints' "
            "signatures cannot be checked",
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
    if not trust.external and enforcing:
        where = "; ".join(trust.external_sources) or "none reachable"
        report.add_problem(
            "no_pins",
            f"enforcing job: no audit pins outside the run directory (looked in: {where}), so a log rewritten and "
            "re-anchored with a new key, its trust store and pins replaced beside it, cannot be told apart; pass "
            "--tracking-uri (the job's MLflow store) or --pins FILE",
        )
    elif trust.external and enforcing and not any(p.sealed for p in trust.external):
        _unsealed(report, trust)
    if not trust.external:
        report.warnings.append(
            "trust unpinned: nothing outside the run directory vouches for this log (its job, mode and key); "
            "pass --tracking-uri or --pins FILE"
        )
    report.warnings.extend(trust.notes)
    return report


def _unsealed(report: VerifyReport, trust: AuditTrust) -> None:
    last = max(p.seq for p in trust.external)
    tail = max(0, report.records - last)
    detail = (
        f"the job never sealed its log (still running, or its orchestrator was killed): the pins outside the run end "
        f"at seq {last}, and the {tail} records after it are vouched for by no pin"
    )
    if trust.allow_unsealed:
        report.warnings.append(f"unsealed: {detail} (accepted: --allow-unsealed)")
    else:
        report.add_problem("unsealed", detail + "; pass --allow-unsealed for a job still running")


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
