"""Token issuance for a run: one capability token per module of the job, before launch (SPEC L5.1), plus the
run's identity (job id), its authority and where its audit log goes.

Modules: ``worker-<rank>`` (role ``trainer``), ``data_loader-<rank>`` (role ``data_loader``, used by the rank's
data loading) and ``monitor`` (role ``monitor``, the orchestrator's metrics reader). The authority and the tokens
stay in the orchestrating process's memory (:func:`open_authority`, :func:`issued_tokens`); nothing secret is
written. Under ``<run_dir>/`` go only public, signed files:

- ``authority/trust_store.json`` (public keys, trusted operators, revocations) and ``authority/policy.json`` (the
  roles), both signed by the authority — a worker verifies them against ``KC_TRUST_ROOT``;
- ``job_id``: the job id every token is bound to (stable across attempts of one run).

:func:`issue_tokens_for_run` returns the worker environment without tokens: ``KC_TRUST_STORE``, ``KC_TRUST_ROOT``,
``KC_POLICY_FILE``, ``KC_JOB_ID``, ``KC_ATTEMPT``, ``KC_AUDIT_LOG``, ``KC_PERMISSION_MODE``, ``KC_TOKEN_TTL``. The
launch adds the tokens of the ranks it starts (:func:`token_env`: ``KC_TOKENS``, read and removed from the
environment by each worker, which keeps only its own). First tokens live ``max(token_ttl_seconds,
STARTUP_GRACE_S)``; every renewal has the configured TTL.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from kuangchao_core.axes import MeshAxes
from kuangchao_core.config.access import setting
from kuangchao_core.perm.authority import Authority
from kuangchao_core.perm.layout import DEFAULT_REGIONS, dataset_resource_name, group_layout, groups_of_rank
from kuangchao_core.perm.roles import Policy
from kuangchao_core.perm.signed_doc import write_document
from kuangchao_core.perm.tokens import DEFAULT_MAX_TTL_S
from kuangchao_core.sched.node_share import ENV_TOKEN_BUNDLE, ENV_TOKENS

POLICY_TYP = "kuangchao/policy"
_AUTHORITIES: dict[str, Authority] = {}
_TOKENS: dict[tuple[str, int], dict[str, str]] = {}

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


def _key(run_dir: str | os.PathLike) -> str:
    return str(Path(run_dir).resolve())


def open_authority(cfg: Any, run_dir: str | os.PathLike, signing_key_pem: str | None = None) -> Authority:
    """Create the run's authority in this process (keys in memory only) and remember it for the tasks that follow.

    ``signing_key_pem``: the ``TokenSigningKey`` block's key (``permission.signing_key_block``), else a fresh key.
    The job trusts the operators of ``permission.operators`` and the local operator key of whoever starts it
    (created on first use, see :mod:`kuangchao_core.perm.operator`)."""
    from kuangchao_core.perm.operator import local_operator, parse_operator

    operators = [
        parse_operator(spec, f"permission.operators[{i}]")
        for i, spec in enumerate(setting(cfg, "permission.operators") or [])
    ]
    signing_key = None
    if signing_key_pem:
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        signing_key = load_pem_private_key(signing_key_pem.encode(), password=None)
    authority = Authority(Path(run_dir) / "authority", signing_key=signing_key, max_ttl_s=DEFAULT_MAX_TTL_S)
    mine = local_operator(create=True)
    authority.trust_operators([*operators, *([mine] if mine else [])])
    _AUTHORITIES[_key(run_dir)] = authority
    return authority


def authority_for(cfg: Any, run_dir: str | os.PathLike) -> Authority:
    """The run's authority in this process (opened by :func:`open_authority` on first use); only the orchestrating
    process (issue, launch) calls this. A config never raises the verifier's maximum TTL."""
    return _AUTHORITIES.get(_key(run_dir)) or open_authority(cfg, run_dir)


def close_authority(run_dir: str | os.PathLike) -> None:
    """Seal the job's audit log if a launch registered it (:mod:`~kuangchao_core.perm.audit_seal`: the job's last
    act, with the audit key still in memory), then forget the run's authority and its tokens (the job is over)."""
    from kuangchao_core.perm.audit_seal import seal_registered

    key = _key(run_dir)
    authority = _AUTHORITIES.get(key)
    seal_registered(run_dir, authority.audit_signing_key() if authority else None)
    _AUTHORITIES.pop(key, None)
    for k in [k for k in _TOKENS if k[0] == key]:
        del _TOKENS[k]


def issued_tokens(run_dir: str | os.PathLike, attempt: int) -> dict[str, str]:
    """The tokens issued in this process for ``attempt`` of the run (module -> token); empty if none."""
    return dict(_TOKENS.get((_key(run_dir), int(attempt)), {}))


def latest_attempt(run_dir: str | os.PathLike) -> int:
    """The newest attempt of the run whose tokens were issued in this process (0 when none was)."""
    attempts = [a for key, a in _TOKENS if key == _key(run_dir)]
    return max(attempts) if attempts else 0


def token_env(run_dir: str | os.PathLike, attempt: int, ranks: list[int] | None = None) -> dict[str, str]:
    """``{"KC_TOKENS": ...}`` with the worker and data-loader tokens of ``ranks`` (all ranks when None), for the
    environment of the processes that run them; KuangchaoError when no token was issued for ``attempt``."""
    import json

    from kuangchao_core.errors import KuangchaoError

    tokens = issued_tokens(run_dir, attempt)
    if not tokens:
        raise KuangchaoError(
            f"no tokens issued in this process for attempt {attempt} of {run_dir}: issue them with "
            "issue_tokens_for_run in the process that launches the workers"
        )
    if ranks is not None:
        wanted = {f"{m}-{r}" for r in ranks for m in ("worker", "data_loader")}
        tokens = {m: t for m, t in tokens.items() if m in wanted}
    return {ENV_TOKENS: json.dumps(tokens, sort_keys=True)}


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
    axes = MeshAxes.from_parallel(par)
    world = axes.world_size
    nproc = setting(cfg, "cluster.nproc_per_node") or setting(cfg, "cluster.slurm.tasks_per_node") or world
    node_of_rank = list(placement["node_of_rank"]) if placement else [0] * world
    if placement:
        slot_of_rank = [0] * world
        for slot, r in enumerate(placement["rank_of_slot"]):
            slot_of_rank[r] = slot
        local_of_rank = [slot % int(placement["nproc"]) for slot in slot_of_rank]
    else:
        local_of_rank = [r % nproc for r in range(world)]
    hierarchical = str(setting(par, "hierarchical_allreduce", "off"))
    layout = group_layout(axes.sizes, node_of_rank, hierarchical)
    use_cuda = setting(cfg, "train.device", "auto") != "cpu"
    task_name = cfg.task.name
    datasets = [f"dataset:{d}" for d in {dataset_resource_name(cfg.data), "synthetic"} if d]
    issued: dict[str, str] = {}

    def role_interfaces(role: str) -> list[str]:
        r = policy.role(role)
        return sorted(i for i in (r.interfaces if r else ()) if policy.interface_allowed(i))

    def write(module: str, token: str) -> None:
        issued[module] = token

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
                objects=[f"checkpoint:{task_name}", f"metrics:{task_name}"],  # datasets: the data loader's
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
    _TOKENS[(_key(run_dir), int(attempt))] = issued
    for stale in [k for k in _TOKENS if k[0] == _key(run_dir) and k[1] < int(attempt)]:
        del _TOKENS[stale]  # an earlier attempt's tokens are never handed out again
    authority_dir = authority.key_dir
    trust = authority.export_trust_store(authority_dir / "trust_store.json")
    policy_file = write_document(authority_dir / "policy.json", authority.sign(POLICY_TYP, policy.to_json()))
    audit = audit_log_path(cfg, job_id)
    audit.parent.mkdir(parents=True, exist_ok=True)
    authority.export_trust_store(f"{audit}.trust.json")  # lets `kc audit --verify` check the signed checkpoints
    return {
        "KC_TRUST_STORE": str(trust.resolve()),
        "KC_TRUST_ROOT": authority.trust_root,
        "KC_POLICY_FILE": str(policy_file.resolve()),
        "KC_JOB_ID": job_id,
        "KC_ATTEMPT": str(int(attempt)),
        "KC_AUDIT_LOG": str(audit.resolve()),
        "KC_PERMISSION_MODE": str(setting(perm, "mode", "enforcing")),
        "KC_TOKEN_TTL": str(ttl),
    }


def issue_script_tokens(
    cfg: Any, run_dir: str | os.PathLike, ranks: list[int], *, role: str = "trainer", nproc_per_node: int = 1
) -> dict[str, str]:
    """Tokens for a user's script under ``kc launch``: ``worker-<rank>`` for each of ``ranks`` with ``role``, every
    communication group of the job (``groups: ["*"]``: the script's own groups cannot be named in advance), the
    rank's CPU and local CUDA device, the memory regions, and the job's metrics and checkpoints. Returns the
    worker environment (as :func:`issue_tokens_for_run`), with ``KC_TOKENS`` holding the tokens."""
    import json

    from kuangchao_core.errors import ConfigError
    from kuangchao_core.perm.tokens import ANY_GROUP

    run_dir = Path(run_dir)
    perm = setting(cfg, "permission")
    policy = Policy.from_config(perm)
    if policy.role(role) is None:
        raise ConfigError([("--role", f"unknown role {role!r}; the job's roles are {sorted(policy.roles)}")])
    authority = authority_for(cfg, run_dir)
    job_id = job_id_for(cfg, run_dir)
    ttl = float(setting(perm, "token_ttl_seconds", 3600))
    interfaces = sorted(i for i in policy.role(role).interfaces if policy.interface_allowed(i))
    use_cuda = setting(cfg, "train.device", "auto") != "cpu"
    task = cfg.task.name
    tokens = {
        f"worker-{r}": authority.issue(
            f"worker-{r}",
            role,
            job_id,
            0,
            interfaces=interfaces,
            devices=["cpu"] + ([f"cuda:{r % nproc_per_node}"] if use_cuda else []),
            regions=DEFAULT_REGIONS,
            groups=[ANY_GROUP],
            objects=[f"checkpoint:{task}", f"metrics:{task}"],
            ttl_s=max(ttl, STARTUP_GRACE_S),
        )
        for r in ranks
    }
    _TOKENS[(_key(run_dir), 0)] = tokens
    trust = authority.export_trust_store(authority.key_dir / "trust_store.json")
    policy_file = write_document(authority.key_dir / "policy.json", authority.sign(POLICY_TYP, policy.to_json()))
    audit = audit_log_path(cfg, job_id)
    audit.parent.mkdir(parents=True, exist_ok=True)
    return {
        "KC_TRUST_STORE": str(trust.resolve()),
        "KC_TRUST_ROOT": authority.trust_root,
        "KC_POLICY_FILE": str(policy_file.resolve()),
        "KC_JOB_ID": job_id,
        "KC_ATTEMPT": "0",
        "KC_AUDIT_LOG": str(audit.resolve()),
        "KC_PERMISSION_MODE": "enforcing",
        "KC_TOKEN_TTL": str(ttl),
        ENV_TOKENS: json.dumps(tokens, sort_keys=True),
    }


def node_token_env(env: dict[str, str], run_dir: str | os.PathLike, attempt: int, node: str, ranks: list[int]) -> dict:
    """The worker environment of one node of a multi-node job. Flow-run parameters are stored by Prefect, so the
    tokens do not travel in them: they go to a bundle file (0600, in a 0700 directory) holding only that node's
    ``ranks``, which the node agent reads into its ranks' environment and deletes before starting them
    (:func:`~kuangchao_core.sched.node_share.take_token_bundle`)."""
    import json

    own = Path(run_dir) / "tokens" / node
    own.mkdir(parents=True, exist_ok=True)
    os.chmod(own.parent, 0o700)
    os.chmod(own, 0o700)
    path = own / f"attempt_{int(attempt)}.json"
    tmp = own / f".{path.name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(json.loads(token_env(run_dir, attempt, ranks)[ENV_TOKENS])))
    os.replace(tmp, path)
    return {**env, ENV_TOKEN_BUNDLE: str(path.resolve())}


def monitor_guard(cfg: Any, run_dir: str | os.PathLike, attempt: int):
    """The guard of the job's ``monitor`` module in the orchestrating process (metrics reads: run summaries, the
    exporter), from the token issued for ``attempt`` — re-issued with the same scope once it has expired."""
    from kuangchao_core.perm import reasons as R
    from kuangchao_core.perm.audit import AuditLog
    from kuangchao_core.perm.guard import TokenGuard

    authority = authority_for(cfg, run_dir)
    job_id = job_id_for(cfg, run_dir)
    policy = Policy.from_config(setting(cfg, "permission"))
    token = issued_tokens(run_dir, attempt).get("monitor")
    verifier = authority.verifier(job_id, attempt)
    try:
        if token is None:
            raise R.TokenRejected(R.NO_TOKEN)
        claims = verifier.verify(token, subject="monitor")
    except R.TokenRejected:
        role = policy.role("monitor")
        token = authority.issue(
            "monitor",
            "monitor",
            job_id,
            attempt,
            interfaces=sorted(i for i in (role.interfaces if role else ()) if policy.interface_allowed(i)),
            objects=[f"metrics:{cfg.task.name}"],
            ttl_s=STARTUP_GRACE_S,
        )
        claims = verifier.verify(token, subject="monitor")
    return TokenGuard(claims, policy, audit=AuditLog(audit_log_path(cfg, job_id), job_id))
