"""Replace block references in a job config dict by the fields the blocks stand for.

Recognised references (each removed from the dict, so the result validates against the config schema):

* ``checkpoint.storage_block: NAME`` → ``CheckpointStorage`` → ``checkpoint.uri`` (+ ``endpoint_url``)
* ``cluster.block: NAME`` → ``KuangchaoCluster`` → ``cluster.mode``/``nodes``/``registry``/``nproc_per_node``
* ``permission.signing_key_block: NAME`` → ``TokenSigningKey`` (a secret: only into ``secrets``)

Fields written explicitly in the config win over the block's. Secrets never enter the config: pass a dict as
``secrets`` to receive ``s3_settings`` (``S3Settings`` with credentials) and ``signing_key_pem``.
"""

from __future__ import annotations

import copy
from typing import Any

from kuangchao_core.errors import ConfigError

_REFS = (
    ("checkpoint", "storage_block", "CheckpointStorage"),
    ("cluster", "block", "KuangchaoCluster"),
    ("permission", "signing_key_block", "TokenSigningKey"),
)


def _load(cls_name: str, name: str, path: str):
    import blocks

    cls = getattr(blocks, cls_name)
    try:
        return cls.load(name)
    except (ValueError, KeyError) as exc:
        raise ConfigError(
            [
                (
                    path,
                    f"no {cls_name} block named {name!r} could be loaded ({exc}); create it in the Prefect UI or "
                    f"with {cls_name}(...).save({name!r}) after `prefect block register -m blocks`",
                )
            ]
        ) from None


def resolve_blocks(cfg_dict: dict[str, Any], secrets: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of ``cfg_dict`` with every block reference replaced by the block's config fields.

    Raises ``ConfigError`` naming the field when a reference is not a string or the block cannot be loaded.
    """
    out = copy.deepcopy(cfg_dict)
    errors: list[tuple[str, str]] = []
    for section, key, cls_name in _REFS:
        sec = out.get(section)
        if not isinstance(sec, dict) or key not in sec:
            continue
        name = sec.pop(key)
        path = f"{section}.{key}"
        if not isinstance(name, str) or not name:
            errors.append((path, f"must name a saved {cls_name} block, got {name!r}"))
            continue
        try:
            block = _load(cls_name, name, path)
        except ConfigError as exc:
            errors.extend(exc.errors)
            continue
        if cls_name == "TokenSigningKey":
            if secrets is not None:
                secrets["signing_key_pem"] = block.pem()
            continue
        for field, value in block.to_config().items():
            sec.setdefault(field, value)
        if cls_name == "CheckpointStorage" and secrets is not None:
            secrets["s3_settings"] = block.s3_settings()
    if errors:
        raise ConfigError(errors)
    return out


def load_job_config(config_path: str, overrides: list[str], secrets: dict[str, Any] | None = None):
    """``load_config`` plus Prefect block references (``checkpoint.storage_block`` …, :func:`resolve_blocks`).

    Block references are resolved on the merged mapping before validation; secrets (S3 credentials, also those
    written into ``checkpoint.endpoint_url`` as ``user:password@``) go into ``secrets``, never into the config that
    is written to disk, logged to MLflow and handed to the workers.
    """
    from kuangchao_core.config import load_config
    from kuangchao_core.config.secrets import take_checkpoint_credentials

    def resolve(data: dict[str, Any]) -> dict[str, Any]:
        return take_checkpoint_credentials(resolve_blocks(data, secrets), secrets)

    return load_config(config_path, overrides, resolve=resolve)
