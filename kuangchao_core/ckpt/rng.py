"""Capture and restore every random number generator a training step may draw from, as plain JSON.

Covered: torch's CPU generator, every CUDA device's generator (when CUDA is initialised/available), numpy's
global ``RandomState``, Python's ``random`` module, and any extra ``torch.Generator`` objects passed by name
(for example a sampler's private generator). Byte states are base64 text, so the result is JSON-serialisable.
"""

from __future__ import annotations

import base64
import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from kuangchao_core.ckpt.layout import LOGGER_NAME
from kuangchao_core.errors import CheckpointError

logger = logging.getLogger(LOGGER_NAME)

RNG_FORMAT = 1


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng_state(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """This process's RNG states as a JSON-serialisable dict."""
    np_state = np.random.get_state()
    if not isinstance(np_state, tuple) or np_state[0] != "MT19937":
        raise CheckpointError(f"numpy global RNG is {np_state[0]!r}; only MT19937 can be saved")
    py_version, py_internal, py_gauss = random.getstate()
    out: dict[str, Any] = {
        "format": RNG_FORMAT,
        "torch_cpu": _b64(torch.get_rng_state()),
        "torch_cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else None,
        "numpy": {
            "bit_generator": np_state[0],
            "keys": base64.b64encode(np.asarray(np_state[1], dtype="<u4").tobytes()).decode("ascii"),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {
            "version": py_version,
            "internal": base64.b64encode(np.asarray(py_internal, dtype="<u4").tobytes()).decode("ascii"),
            "gauss_next": py_gauss,
        },
        "generators": {name: _b64(g.get_state()) for name, g in (generators or {}).items()},
    }
    return out


def restore_rng_state(state: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Set this process's RNGs (and the named ``generators``) to ``state`` from :func:`capture_rng_state`.

    CUDA states are restored when CUDA is available; a device-count mismatch restores the common prefix and
    logs a warning. A state saved without CUDA leaves the CUDA generators alone.
    """
    if state.get("format") != RNG_FORMAT:
        raise CheckpointError(f"RNG state has format {state.get('format')!r}, expected {RNG_FORMAT}")
    try:
        torch.set_rng_state(_unb64(state["torch_cpu"]))
        cuda = state.get("torch_cuda")
        if cuda:
            if torch.cuda.is_available():
                n = torch.cuda.device_count()
                if n != len(cuda):
                    logger.warning("RNG state has %d CUDA generators, this process sees %d", len(cuda), n)
                for i, s in enumerate(cuda[:n]):
                    torch.cuda.set_rng_state(_unb64(s), device=i)
            else:
                logger.warning("RNG state holds CUDA generators but CUDA is not available; they are not restored")
        npd = state["numpy"]
        keys = np.frombuffer(base64.b64decode(npd["keys"]), dtype="<u4").astype(np.uint32)
        np.random.set_state(
            (npd["bit_generator"], keys, int(npd["pos"]), int(npd["has_gauss"]), float(npd["cached_gaussian"]))
        )
        py = state["python"]
        internal = np.frombuffer(base64.b64decode(py["internal"]), dtype="<u4")
        random.setstate((int(py["version"]), tuple(int(x) for x in internal), py["gauss_next"]))
        saved_gens = state.get("generators") or {}
        for name, gen in (generators or {}).items():
            if name not in saved_gens:
                raise CheckpointError(f"RNG state has no generator named {name!r} (saved: {sorted(saved_gens)})")
            gen.set_state(_unb64(saved_gens[name]))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"RNG state is malformed ({type(exc).__name__}: {exc}); use another checkpoint") from exc
