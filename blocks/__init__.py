"""Prefect blocks for Kuangchao: cluster, checkpoint storage (S3), token signing key.

Register them with ``prefect block register -m blocks``; a job config names a saved block instead of repeating
its fields (``checkpoint.storage_block``, ``cluster.block``, ``permission.signing_key_block``), see
``blocks.resolve.resolve_blocks``.
"""

from blocks.cluster import KuangchaoCluster, NodeEntry
from blocks.signing_key import TokenSigningKey
from blocks.storage import CheckpointStorage

__all__ = ["CheckpointStorage", "KuangchaoCluster", "NodeEntry", "TokenSigningKey"]
