"""Token issuance for a run: one capability token per module of the job, before launch (SPEC L5.1), plus the
run's identity (job id), its authority and where its audit log goes.

Modules: ``worker-<rank>`` (role ``trainer``), ``data_loader-<rank>`` (role ``data_loader``) and ``monitor``
(role ``monitor``). Writes, under ``<run_dir>/``:

- ``authority/`` (0700): the signing keys (``keys.json``, 0600) — stays with the orchestrating process;
- ``tokens/<module>.token`` (0600 each), ``tokens/trust_store.json`` (public keys) and ``tokens/policy.json``;
- ``job_id``: the job id every token is bound to (stable across attempts of one run).

Returns the environment for the workers: ``KC_TOKEN_FILE`` (a ``{rank}`` template that
``install_worker_guard`` fills from ``RANK``), ``KC_TRUST_STORE``, ``KC_POLICY_FILE``, ``KC_JOB_ID``,
``KC_ATTEMPT``, ``KC_AUDIT_LOG``, ``KC_PERMISSION_MODE``, ``KC_TOKEN_TTL``. First tokens live
``max(token_ttl_seconds, STARTUP_GRACE_S)``; every renewal has the configured TTL.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from kuangchao_core.config.access import setting
from kuangchao_core.perm.authority import Authority
from kuangchao_core.perm.layout import DEFAULT_REGIONS, dataset_resource_name, group_layout, groups_of_rank
from kuangchao_core.perm.roles import Policy
from kuangchao_core.perm.tokens import DEFAULT_MAX_TTL_S

_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]+")
#: first tokens live at least this long, so a short ``token_ttl_seconds`` cannot expire during worker start-up;
#: renewals (``RenewalServer(ttl_s=token_ttl_seconds)``) bring the lifetime down to the configured TTL
STARTUP_GRACE_S = 120.0


def job_id_for(cfg: Any, run_dir: str | os.PathLike) -> str:
    """The job id of a run: ``<task>@<run dir name>``, created once and kept in ``<run_dir>/job_id``."""
    path = Path(run_dir) / "job_id"
    if path.exists():
        return path.read_text().strip()
    job_id = _UNSAFE.sub("-", f"{cfg.task.name}@{Path(run_dir).resolve().name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(job_id + "\n")
    return job_id


def audit_log_path(cfg: Any, job_id: str) -> Path:
    """Where the job's audit log goes: ``permission.audit_log`` (``{task}``/``{job_id}`` are filled in; a path
    without placeholders is a directory) or ``audit/<task>/<job_id>.jsonl``."""
    configured = setting(cfg, "permission.audit_log")
    task_name = cfg.task.name
    if configured and "{" in configured:
        return Path(configured.format(task=task_name, job_id=job_id))
    base = Path(configured) if configured else Path(os.environ.get("KC_AUDIT_DIR", "audit"))
    return base / task_name / f"{job_id}.jsonl"


def authority_for(cfg: Any, run_dir: str | os.PathLike) -> Authority:
    """Open (or create) the run's authority; only the orchestrating process (issue, launch) calls this."""
    return Authority(Path(run_dir) / "authority", max_ttl_s=DEFAULT_MAX_TTL_S)  # a config never raises it


def issue_tokens_for_run(
    cfg: Any, run_dir: str | os.PathLike, attempt: int, placement: dict[str, Any] | None = None
) -> dict[str, str]:
    """Issue every module's token for ``attempt`` and return the worker environment (see module docstring).

    ``placement`` (a :class:`~kuangchao_core.sched.rank_placement.RankPlacement` as ``to_dict``): which node and
    device slot each rank runs on — it decides the device each token names and the node-local / cross-node DP
    subgroups of a hierarchical all-reduce. Without it every rank is on one node, rank ``r`` on device ``r``."""
    run_dir = Path(run_dir)
    perm = setting(cfg, "permission")
    policy = Policy.from_config(perm)  # unknown interface or role names fail here, before any token exists
    authority = authority_for(cfg, run_dir)
    job_id = job_id_for(cfg, run_dir)
    ttl = float(setting(perm, "token_ttl_seconds", 3600))
    first_ttl = max(ttl, STARTUP_GRACE_S)
    par = cfg.parallel
    dp, tp, pp = int(par.data_parallel_size), int(par.tensor_parallel_size), int(par.pipeline_parallel_size)
    world = dp * tp * pp
    nproc = setting(cfg, "cluster.nproc_per_node") or world
    node_of_rank = list(placement["node_of_rank"]) if placement else [0] * world
    if placement:
        slot_of_rank = [0] * world
        for slot, r in enumerate(placement["rank_of_slot"]):
            slot_of_rank[r] = slot
        local_of_rank = [slot % int(placement["nproc"]) for slot in slot_of_rank]
    else:
        local_of_rank = [r % nproc for r in range(world)]
    layout = group_layout(dp, tp, pp, node_of_rank, str(setting(par, "hierarchical_allreduce", "off")))
    use_cuda = setting(cfg, "train.device", "auto") != "cpu"
    task_name = cfg.task.name
    datasets = [f"dataset:{d}" for d in {dataset_resource_name(cfg.data), "synthetic"} if d]
    tok_dir = run_dir / "tokens"
    tok_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(tok_dir, 0o700)

    def role_interfaces(role: str) -> list[str]:
        r = policy.role(role)
        return sorted(i for i in (r.interfaces if r else ()) if policy.interface_allowed(i))

    def write(module: str, token: str) -> Path:
        path = tok_dir / f"{module}.token"
        tmp = tok_dir / f".{module}.token.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        os.replace(tmp, path)
        return path

    for rank in range(world):
        devices = ["cpu"] + ([f"cuda:{local_of_rank[rank]}"] if use_cuda else [])
        write(
            f"worker-{rank}",
            authority.issue(
                f"worker-{rank}",
                "trainer",
                job_id,
                attempt,
                interfaces=role_interfaces("trainer"),
                devices=devices,
                regions=DEFAULT_REGIONS,
                groups=groups_of_rank(layout, rank),
                objects=[f"checkpoint:{task_name}", f"metrics:{task_name}", *datasets],
                ttl_s=first_ttl,
            ),
        )
        write(
            f"data_loader-{rank}",
            authority.issue(
                f"data_loader-{rank}",
                "data_loader",
                job_id,
                attempt,
                interfaces=role_interfaces("data_loader"),
                devices=["cpu"],
                objects=datasets,
                ttl_s=first_ttl,
            ),
        )
    write(
        "monitor",
        authority.issue(
            "monitor",
            "monitor",
            job_id,
            attempt,
            interfaces=role_interfaces("monitor"),
            objects=[f"metrics:{task_name}"],
            ttl_s=first_ttl,
        ),
    )
    trust = authority.export_trust_store(tok_dir / "trust_store.json")
    policy_file = policy.save(tok_dir / "policy.json")
    audit = audit_log_path(cfg, job_id)
    audit.parent.mkdir(parents=True, exist_ok=True)
    authority.export_trust_store(f"{audit}.trust.json")  # lets `kc audit --verify` check the signed checkpoints
    return {
        "KC_TOKEN_FILE": str((tok_dir / "worker-{rank}.token").resolve()),
        "KC_TRUST_STORE": str(trust.resolve()),
        "KC_POLICY_FILE": str(policy_file.resolve()),
        "KC_JOB_ID": job_id,
        "KC_ATTEMPT": str(int(attempt)),
        "KC_AUDIT_LOG": str(audit.resolve()),
        "KC_PERMISSION_MODE": str(setting(perm, "mode", "enforcing")),
        "KC_TOKEN_TTL": str(ttl),
    }


def node_token_env(env: dict[str, str], node: str, ranks: list[int]) -> dict[str, str]:
    """The worker environment of one node of a multi-node job: ``KC_TOKEN_FILE`` points into a directory that
    holds only the tokens of that node's ``ranks`` (the node never gets another node's tokens)."""
    src = Path(env["KC_TOKEN_FILE"])
    own = src.parent / "nodes" / node
    own.mkdir(parents=True, exist_ok=True)
    os.chmod(own, 0o700)
    for rank in ranks:
        for module in (f"worker-{rank}", f"data_loader-{rank}"):
            token = (src.parent / f"{module}.token").read_bytes()
            tmp = own / f".{module}.token.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(token)
            os.replace(tmp, own / f"{module}.token")
    return {**env, "KC_TOKEN_FILE": str(own / src.name)}
