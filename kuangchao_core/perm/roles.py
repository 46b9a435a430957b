"""Roles (L5.3): what each kind of module may do at most. The effective right is token ∩ role.

A role is ``{interfaces: [...], resources: [...], deny: [...]}``: ``interfaces`` may hold ``*`` (all); a resource
pattern is ``*``, a whole kind (``group:*``), an exact canonical name (``group:world``) or a glob within a kind
(``group:dp*``); a ``deny`` entry (``interface`` or ``interface@resource``) beats any allow. A role may also be a
plain list of interfaces (on every resource). Patterns live only in the policy: tokens hold exact names, and an
operation must match both. In the job config, ``permission.roles`` entries override or extend the built-in roles
below (:meth:`Policy.from_config`); a policy object or file with ``roles: {}`` has no role, so everything is denied.
Unknown interface names are a configuration error at load time, never a surprise at request time.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

from kuangchao_core.config.bounded_json import read_json_file
from kuangchao_core.errors import ConfigError
from kuangchao_core.perm.names import INTERFACE_KINDS, INTERFACES, KINDS, is_canonical_resource

_ALL_COLLECTIVES = [name for name, kind in INTERFACE_KINDS.items() if kind == "group"]

DEFAULT_ROLES: dict[str, dict] = {
    "trainer": {
        "interfaces": [
            "device_init",
            "stream_create",
            "memory_alloc",
            "memory_free",
            *_ALL_COLLECTIVES,
            "checkpoint_read",
            "checkpoint_write",
            "dataset_read",
            "metrics_write",
        ],
        "resources": ["device:*", "memory:*", "group:*", "checkpoint:*", "dataset:*", "metrics:*"],
    },
    "data_loader": {"interfaces": ["dataset_read", "device_init"], "resources": ["dataset:*", "device:cpu"]},
    "monitor": {"interfaces": ["metrics_read"], "resources": ["metrics:*"]},
    "debug": {
        "interfaces": ["device_init", "metrics_read", "checkpoint_read", "dataset_read"],
        "resources": ["device:*", "metrics:*", "checkpoint:*", "dataset:*"],
    },
    "admin": {"interfaces": ["config_write", "metrics_read"], "resources": ["config:*", "metrics:*"]},
}


@dataclass(frozen=True)
class Role:
    """One role's maximum rights."""

    name: str
    interfaces: frozenset[str]
    exact: frozenset[str] = frozenset()
    kinds: frozenset[str] = frozenset()
    patterns: tuple[str, ...] = ()
    deny_interfaces: frozenset[str] = frozenset()
    deny_pairs: frozenset[tuple[str, str]] = field(default_factory=frozenset)

    def allows(self, interface: str, resource: str) -> bool:
        """Whether the role permits ``interface`` on ``resource`` (explicit denies win)."""
        if interface not in self.interfaces or self.denies(interface, resource):
            return False
        kind = resource.partition(":")[0]
        if INTERFACE_KINDS.get(interface) != kind:
            return False
        if resource in self.exact or kind in self.kinds:
            return True
        return any(fnmatchcase(resource, p) for p in self.patterns)

    def denies(self, interface: str, resource: str) -> bool:
        """Whether an explicit deny entry matches."""
        return interface in self.deny_interfaces or (interface, resource) in self.deny_pairs


def _as_mapping(spec):
    if hasattr(spec, "model_dump"):  # a config RoleSpec
        return spec.model_dump()
    if isinstance(spec, (list, tuple)):
        return {"interfaces": list(spec), "resources": ["*"]}
    return spec


def _parse_role(name: str, spec, where: str) -> tuple[Role | None, list[tuple[str, str]]]:
    errors: list[tuple[str, str]] = []
    spec = _as_mapping(spec)
    if not isinstance(spec, Mapping):
        return None, [(f"{where}.{name}", "a role is a list of interfaces or {interfaces, resources, deny}")]
    for key in spec:
        if key not in ("interfaces", "resources", "deny"):
            errors.append((f"{where}.{name}.{key}", "unknown field (allowed: interfaces, resources, deny)"))
    interfaces = set()
    for i, itf in enumerate(spec.get("interfaces") or []):
        if itf == "*":
            interfaces |= INTERFACES
        elif itf in INTERFACES:
            interfaces.add(itf)
        else:
            errors.append(
                (f"{where}.{name}.interfaces[{i}]", f"unknown interface {itf!r}; known: {sorted(INTERFACES)}")
            )
    resources = spec.get("resources")
    exact, kinds, patterns = set(), set(), []
    for i, res in enumerate(["*"] if resources is None else resources):
        res = str(res)
        kind, sep, value = res.partition(":")
        if res == "*":
            kinds |= KINDS
        elif sep and value == "*" and kind in KINDS:
            kinds.add(kind)
        elif is_canonical_resource(res):
            exact.add(res)
        elif sep and kind in KINDS and _GLOB.match(value):
            patterns.append(res)
        else:
            errors.append(
                (f"{where}.{name}.resources[{i}]", f"{res!r} is not '*', 'kind:*', a canonical name or a glob")
            )
    deny_i, deny_p = set(), set()
    for i, entry in enumerate(spec.get("deny") or []):
        itf, sep, res = str(entry).partition("@")
        if itf not in INTERFACES:
            errors.append((f"{where}.{name}.deny[{i}]", f"unknown interface {itf!r}"))
        elif sep:
            deny_p.add((itf, res))
        else:
            deny_i.add(itf)
    role = Role(
        name,
        frozenset(interfaces),
        frozenset(exact),
        frozenset(kinds),
        tuple(patterns),
        frozenset(deny_i),
        frozenset(deny_p),
    )
    return role, errors


_GLOB = re.compile(r"[A-Za-z0-9_.:,/\[\]*?-]+\Z")


#: the primitives ``permission.allowed_interfaces`` restricts (SPEC L2.1)
COMM_INTERFACES = frozenset({"broadcast", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv"})


class Policy:
    """The set of roles of a job, built from the config's ``permission.roles`` (None: the built-in roles)."""

    def __init__(self, roles: Mapping | None = None, allowed_interfaces: Iterable[str] | None = None, source=None):
        spec = DEFAULT_ROLES if roles is None else roles
        errors: list[tuple[str, str]] = []
        self.roles: dict[str, Role] = {}
        if not isinstance(spec, Mapping):
            errors.append(("permission.roles", "must be a mapping role -> interfaces or {interfaces, resources, deny}"))
            spec = {}
        for name, rspec in spec.items():
            role, errs = _parse_role(str(name), rspec, "permission.roles")
            errors += errs
            if role is not None:
                self.roles[str(name)] = role
        self.allowed_interfaces = None if allowed_interfaces is None else frozenset(allowed_interfaces)
        for i, itf in enumerate(self.allowed_interfaces or ()):
            if itf not in INTERFACES:
                errors.append((f"permission.allowed_interfaces[{i}]", f"unknown interface {itf!r}"))
        if errors:
            raise ConfigError(errors, source)
        self._spec = {
            "roles": None if roles is None else json.loads(json.dumps(roles)),
            "allowed_interfaces": (None if allowed_interfaces is None else sorted(self.allowed_interfaces)),
        }

    @classmethod
    def from_config(cls, perm_cfg) -> Policy:
        """Build from a ``permission`` config section: its ``roles`` replace the built-in roles of the same name and
        add new ones (an empty mapping means just the built-in roles)."""
        roles = getattr(perm_cfg, "roles", None) or None
        if roles is not None:
            roles = {**DEFAULT_ROLES, **{name: _as_mapping(spec) for name, spec in roles.items()}}
        return cls(roles, getattr(perm_cfg, "allowed_interfaces", None))

    def role(self, name: str) -> Role | None:
        return self.roles.get(name)

    def interface_allowed(self, interface: str) -> bool:
        """Whether the job-wide ``allowed_interfaces`` list (if any) admits ``interface``: the list restricts the
        communication primitives (:data:`COMM_INTERFACES`) a job may use, as the original design means it; device,
        memory, checkpoint, dataset, metrics and config interfaces stay governed by the roles alone."""
        if self.allowed_interfaces is None or interface not in COMM_INTERFACES:
            return True
        return interface in self.allowed_interfaces

    def to_json(self) -> dict:
        return dict(self._spec)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the policy atomically (temp file + rename) for workers to load."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Policy:
        """Load a policy file written by :meth:`save` or signed by the authority (its signature is checked by
        ``runtime.load_trust`` with a trust root, not here); ConfigError if it is malformed or names unknown rights."""
        try:
            data = read_json_file(path)
        except (OSError, ValueError) as exc:
            raise ConfigError([("policy", f"cannot read policy: {exc}")], str(path)) from None
        if isinstance(data, dict) and data.get("typ") == "kuangchao/policy" and isinstance(data.get("body"), dict):
            data = data["body"]  # the authority's signed policy, read here without its signature (tools, tests)
        if not isinstance(data, dict):
            raise ConfigError([("policy", "must be a JSON object")], str(path))
        return cls(data.get("roles"), data.get("allowed_interfaces"), source=str(path))


class PolicyHolder:
    """Holds the live policy; :meth:`reload` swaps atomically and keeps the old policy if the new file is bad."""

    def __init__(self, policy: Policy):
        self._policy = policy
        self._lock = threading.Lock()

    @property
    def policy(self) -> Policy:
        return self._policy

    def reload(self, path: str | os.PathLike) -> Policy:
        """Load ``path``; on any error the current policy stays in force and the ConfigError propagates."""
        new = Policy.load(path)
        with self._lock:
            self._policy = new
        return new
