"""Checkpoints: atomic multi-rank safetensors + JSON step directories, integrity checks, retention.

Layout and protocol: ``layout.py`` and ``writer.py``; no pickle anywhere in the format.
"""

from kuangchao_core.ckpt.integrity import find_latest_intact, list_step_dirs, read_manifest, verify_checkpoint
from kuangchao_core.ckpt.layout import FORMAT_VERSION
from kuangchao_core.ckpt.storage import LocalStorage, Storage

__all__ = [
    "FORMAT_VERSION",
    "LocalStorage",
    "Storage",
    "find_latest_intact",
    "list_step_dirs",
    "read_manifest",
    "verify_checkpoint",
]
