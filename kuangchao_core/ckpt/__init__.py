"""L3 checkpoints: atomic multi-rank safetensors + JSON step directories in run lineages, integrity checks,
retention, resharding, Hugging Face import/export, S3.

Layout and protocol: ``layout.py``, ``lineage.py`` and ``writer.py``; no pickle anywhere in the format. Reading:
``reader.py`` (one rank's own shard), ``index.py`` (any layout: which shard holds which slice), ``hf.py`` (Hugging
Face directories). Conversion: ``convert.py`` (another layout, Hugging Face export).

May import: ``errors``, ``config``, ``hal``, ``comm``, ``parallel``, ``models``; the guard interface
``guard_api`` (beside ``errors``).
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
