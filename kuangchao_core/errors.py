"""One error hierarchy for the whole system.

Every message says what was wrong, where, and what to do about it.
"""

from __future__ import annotations


class KuangchaoError(Exception):
    """Base class of every error raised on purpose by Kuangchao."""


class ConfigError(KuangchaoError):
    """A job configuration is invalid.

    ``errors`` is a list of ``(dotted_path, message)`` pairs; ``source`` names the file.
    """

    def __init__(self, errors: list[tuple[str, str]], source: str | None = None):
        self.errors = list(errors)
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"{path}: {msg}" for path, msg in self.errors]
        super().__init__(f"invalid configuration{where}:\n  " + "\n  ".join(lines))


class PlanError(ConfigError):
    """A parallel plan cannot run (sizes, divisibility, schedule limits)."""


class CommError(KuangchaoError):
    """A communication primitive failed."""


class CommTimeout(CommError):
    """A collective or point-to-point op did not complete within its group's timeout."""

    def __init__(self, group: str, op: str, seq: int, missing_ranks: list[int], timeout_ms: int):
        self.group = group
        self.op = op
        self.seq = seq
        self.missing_ranks = list(missing_ranks)
        self.timeout_ms = timeout_ms
        super().__init__(
            f"communication timeout: group={group!r} op={op} seq={seq} after {timeout_ms} ms; "
            f"ranks that did not arrive: {self.missing_ranks or 'unknown'}"
        )


class PermissionDenied(KuangchaoError):
    """An operation was refused by the permission layer (default deny)."""

    def __init__(self, interface: str, resource: str, reason: str, module_id: str | None = None):
        self.interface = interface
        self.resource = resource
        self.reason = reason
        self.module_id = module_id
        who = f"{module_id}: " if module_id else ""
        super().__init__(f"{who}permission denied for {interface} on {resource}: {reason}")


class CheckpointError(KuangchaoError):
    """A checkpoint could not be written or read."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint failed its integrity checks (missing manifest, sha256 or size mismatch)."""


class NothingToTrain(ConfigError):
    """The checkpoint a run would resume from is already at or past ``train.steps``."""

    def __init__(self, step: int, steps: int, checkpoint: str):
        self.step, self.steps, self.checkpoint = step, steps, checkpoint
        super().__init__(
            [
                (
                    "train.steps",
                    f"already at step {step} of {steps} ({checkpoint}); pass --resume never to train from scratch, "
                    f"raise train.steps above {step} to continue, or --if-finished skip to accept a run that "
                    "trains nothing",
                )
            ]
        )


class TrackingStoreError(KuangchaoError):
    """The MLflow tracking store cannot be used: ``kind`` is ``locked`` (held by another process past the job's
    wait), ``corrupt`` (not a database MLflow can read), ``schema`` (another MLflow version's database) or
    ``unreachable`` (a server that does not answer, a directory that cannot be opened). One line naming the config
    field, the store and what to do; the job's checkpoints are never touched by it."""

    def __init__(self, kind: str, uri: str, problem: str, fix: str, field: str = "tracking.uri"):
        self.kind, self.uri, self.problem, self.fix, self.field = kind, uri, problem, fix, field
        super().__init__(f"{field}: the MLflow store {uri} {problem}; {fix}")

    def __reduce__(self):
        return (type(self), (self.kind, self.uri, self.problem, self.fix, self.field))


class DataError(KuangchaoError):
    """A dataset is missing, malformed or too small for the planned job."""


class WorkerFailed(KuangchaoError):
    """A worker process died or hung; ``rank`` and ``cause`` say which and why. ``node`` names the machine when
    a whole node was lost (its agent and every rank on it gone), so recovery can leave it out."""

    def __init__(
        self,
        rank: int | None,
        cause: str,
        exit_code: int | None = None,
        node: str | None = None,
        fault: str | None = None,
    ):
        self.rank = rank
        self.cause = cause
        self.exit_code = exit_code
        self.node = node
        #: the failure as the rank reported it itself (its error and step: ``sched.recovery`` stops retrying a
        #: fault that repeats identically); None when the rank said nothing (killed, hung, lost)
        self.fault = fault
        who = f"node {node}" if node is not None and rank is None else f"worker rank {rank}"
        super().__init__(f"{who} failed: {cause}" + (f" (exit code {exit_code})" if exit_code is not None else ""))

    def __reduce__(self):
        return (type(self), (self.rank, self.cause, self.exit_code, self.node, self.fault))
