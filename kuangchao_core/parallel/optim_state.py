"""Optimizer state as named tensors plus JSON, so it fits a safetensors shard (no pickle).

Tensors are named ``optim.<param name>.<state key>`` (``exp_avg``, ``exp_avg_sq``, ``step``, …); the JSON part
holds the param-group hyperparameters, which parameter names each group holds, the state keys per parameter and
any non-tensor state values. State is matched by parameter *name* on load, so the parameter order may change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kuangchao_core.errors import CheckpointError

OPTIM_META_FORMAT = 1
PREFIX = "optim."


def _names_by_param(
    optimizer: torch.optim.Optimizer, param_names: Sequence[str] | Mapping[str, torch.Tensor]
) -> list[str]:
    """Name of every optimizer parameter, in ``param_groups`` order."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if isinstance(param_names, Mapping):
        by_id = {id(p): n for n, p in param_names.items()}
        missing = [i for i, p in enumerate(params) if id(p) not in by_id]
        if missing:
            raise CheckpointError(
                f"{len(missing)} optimizer parameters are not in the name mapping (first index {missing[0]}); "
                "pass dict(model.named_parameters()) of the model the optimizer was built on"
            )
        names = [by_id[id(p)] for p in params]
    else:
        names = list(param_names)
        if len(names) != len(params):
            raise CheckpointError(
                f"{len(names)} parameter names given for {len(params)} optimizer parameters; "
                "pass one name per parameter in param_groups order"
            )
    if len(set(names)) != len(names):
        raise CheckpointError("parameter names given to the optimizer checkpoint are not unique")
    return names


def _encode_hyper(key: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.detach().cpu().tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple):
        return [_encode_hyper(key, v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_encode_hyper(key, v) for v in value]
    raise CheckpointError(f"optimizer hyperparameter {key!r} has type {type(value).__name__}, which cannot be saved")


def _decode_hyper(value: Any, like: Any) -> Any:
    if isinstance(value, dict) and "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
    if isinstance(like, tuple) and isinstance(value, list):
        return tuple(value)
    return value


def flatten_optimizer_state(
    optimizer: torch.optim.Optimizer, param_names: Sequence[str] | Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, meta)``: the optimizer's tensor state by name and a JSON-serialisable description of the rest.

    ``param_names``: one name per optimizer parameter in ``param_groups`` order, or ``dict(model.named_parameters())``.
    """
    names = _names_by_param(optimizer, param_names)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    tensors: dict[str, torch.Tensor] = {}
    state_keys: dict[str, list[str]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for p, name in zip(params, names, strict=True):
        st = optimizer.state.get(p)
        if not st:
            continue
        state_keys[name] = sorted(st)
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{PREFIX}{name}.{key}"] = value.detach()
            else:
                scalars.setdefault(name, {})[key] = _encode_hyper(key, value)
    groups = []
    i = 0
    for g in optimizer.param_groups:
        n = len(g["params"])
        entry = {k: _encode_hyper(k, v) for k, v in g.items() if k != "params"}
        entry["param_names"] = names[i : i + n]
        groups.append(entry)
        i += n
    meta = {
        "format": OPTIM_META_FORMAT,
        "optimizer": type(optimizer).__name__,
        "param_groups": groups,
        "state_keys": state_keys,
        "state_scalars": scalars,
    }
    return tensors, meta


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    param_names: Sequence[str] | Mapping[str, torch.Tensor],
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
) -> None:
    """Restore ``optimizer`` from :func:`flatten_optimizer_state` output (exact: same values, dtypes, hyperparameters)."""
    if not isinstance(meta, Mapping) or meta.get("format") != OPTIM_META_FORMAT:
        raise CheckpointError(
            f"optimizer checkpoint meta has format {getattr(meta, 'get', lambda _k: None)('format')!r}"
        )
    if meta.get("optimizer") != type(optimizer).__name__:
        raise CheckpointError(
            f"checkpoint holds {meta.get('optimizer')} state but the optimizer is {type(optimizer).__name__}"
        )
    names = _names_by_param(optimizer, param_names)
    saved_groups = meta["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint has {len(saved_groups)} optimizer param groups, the optimizer has {len(optimizer.param_groups)}"
        )
    index = {n: i for i, n in enumerate(names)}
    groups_sd = []
    i = 0
    for gi, (saved, current) in enumerate(zip(saved_groups, optimizer.param_groups, strict=True)):
        n = len(current["params"])
        here, there = names[i : i + n], list(saved["param_names"])
        if sorted(here) != sorted(there):
            only_ckpt = sorted(set(there) - set(here))[:3]
            only_model = sorted(set(here) - set(there))[:3]
            raise CheckpointError(
                f"optimizer param group {gi} differs: only in checkpoint {only_ckpt}, only in the model {only_model}"
            )
        entry = {k: _decode_hyper(v, current.get(k)) for k, v in saved.items() if k != "param_names"}
        entry["params"] = list(range(i, i + n))  # load_state_dict pairs these with the current params in order
        groups_sd.append(entry)
        i += n
    state_sd: dict[int, dict[str, Any]] = {}
    scalars = meta.get("state_scalars", {})
    for name, keys in meta.get("state_keys", {}).items():
        if name not in index:
            raise CheckpointError(f"optimizer state for {name!r} in the checkpoint has no parameter of that name")
        entry: dict[str, Any] = {}
        for key in keys:
            tkey = f"{PREFIX}{name}.{key}"
            if tkey in tensors:
                entry[key] = tensors[tkey]
            elif key in scalars.get(name, {}):
                entry[key] = _decode_hyper(scalars[name][key], None)
            else:
                raise CheckpointError(f"optimizer state tensor {tkey} is missing from the shard")
        state_sd[index[name]] = entry
    optimizer.load_state_dict({"state": state_sd, "param_groups": groups_sd})
