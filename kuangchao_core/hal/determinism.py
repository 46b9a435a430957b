"""``train.deterministic``: what deterministic training needs from the device's libraries (SPEC L1).

On every device: ``torch.use_deterministic_algorithms(True, warn_only=True)`` (an operation without a deterministic
implementation warns instead of failing). On CUDA (and ROCm, whose devices are torch ``cuda`` devices) also:

- ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in the environment when it is not set: cuBLAS is deterministic only with one
  of :data:`DETERMINISTIC_CUBLAS` workspace settings, read when its first handle is created, so this runs before
  any CUDA work (the worker calls it before ``device_init``). A value already set is kept; one that is not
  deterministic is warned about;
- ``torch.backends.cudnn.deterministic = True`` and ``torch.backends.cudnn.benchmark = False`` (no autotuner
  picking a different, possibly nondeterministic, convolution algorithm per run).
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

import torch

log = logging.getLogger("kuangchao.hal.determinism")

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
#: the workspace settings under which cuBLAS is deterministic (NVIDIA's cuBLAS documentation, "Results
#: reproducibility"); the first is the one set
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


def enable_determinism(device_type: str, environ: MutableMapping[str, str]) -> dict[str, Any]:
    """Set what deterministic training needs on ``device_type`` (``cpu``, ``cuda``, ``rocm``, or ``auto``: CUDA
    when torch sees a GPU) in this process and in ``environ`` (``os.environ`` in a worker), and log once what was
    set. Call before any CUDA work. Returns what was set: ``use_deterministic_algorithms`` and, on CUDA, the
    ``CUBLAS_WORKSPACE_CONFIG`` value in effect, whether this call set it, and the cuDNN flags."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    done: dict[str, Any] = {"use_deterministic_algorithms": "warn_only"}
    if device_type == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type in ("cuda", "rocm"):
        current = environ.get(CUBLAS_ENV)
        if current is None:
            environ[CUBLAS_ENV] = DETERMINISTIC_CUBLAS[0]
        elif current not in DETERMINISTIC_CUBLAS:
            log.warning(
                "train.deterministic: %s is %r, with which cuBLAS is not deterministic; it needs one of %s "
                "(unset it and deterministic training sets %s)",
                CUBLAS_ENV,
                current,
                " or ".join(repr(v) for v in DETERMINISTIC_CUBLAS),
                DETERMINISTIC_CUBLAS[0],
            )
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        done |= {
            CUBLAS_ENV: environ[CUBLAS_ENV],
            "cublas_set_here": current is None,
            "cudnn.deterministic": True,
            "cudnn.benchmark": False,
        }
    log.info("train.deterministic on %s: %s", device_type, done, extra={"fields": {"determinism": done}})
    return done
