"""Process groups: ``init_distributed``, the world group and ``CommGroup`` (SPEC L2.2).

``CommGroup`` wraps a ``torch.distributed`` process group and keeps the state that the dispatch point, the
timeout diagnosis and the state dump need: the ranks in the order the caller gave, the backend, the
timeout, and per-rank progress counters (collective sequence number, point-to-point counts per peer).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from kuangchao_core.comm import diag, registry
from kuangchao_core.errors import CommError

DEFAULT_TIMEOUT_MS = 30000
_BACKENDS = ("auto", "gloo", "nccl")

_world: CommGroup | None = None
_world_timeout_ms: int | None = None


def _device_is_cuda() -> bool:
    """Whether this process computes on a CUDA/ROCm device (the HAL context if built, else availability)."""
    from kuangchao_core.hal.context import current_context

    ctx = current_context()
    if ctx is not None:
        return ctx.kind in ("cuda", "rocm")
    return torch.cuda.is_available()


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``nccl`` when this process computes on a CUDA/ROCm device, else ``gloo``."""
    if backend not in _BACKENDS:
        raise CommError(f"unknown communication backend {backend!r}; use one of {', '.join(_BACKENDS)}")
    if backend == "auto":
        return "nccl" if _device_is_cuda() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise CommError("backend 'nccl' needs CUDA devices but none is visible; use backend='gloo' or 'auto'")
    return backend


def _world_backend_timeout_ms() -> int | None:
    """The timeout of the initialised default group, read from its backend options where torch exposes it."""
    if _world_timeout_ms is not None:
        return _world_timeout_ms
    try:
        pg = dist.distributed_c10d._get_default_group()
        dev = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
        return int(pg._get_backend(dev).options._timeout.total_seconds() * 1000)
    except Exception:
        return None


def init_distributed(backend: str = "auto", timeout_ms: int = 300000) -> CommGroup:
    """Join the job's process group (torchrun env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and return it.

    If the default group is already initialised (by torchrun tooling or a test harness), it is adopted as is.
    With ``backend="auto"`` on a CUDA device the group carries NCCL for CUDA tensors and Gloo for CPU tensors.
    """
    global _world_timeout_ms
    if not dist.is_available():
        raise CommError("torch.distributed is not available in this torch build; install a build with it")
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise CommError(
                f"cannot initialise communication: environment variables {missing} are not set; "
                "start the workers with torchrun (python -m torch.distributed.run) or `kc train`"
            )
        chosen = resolve_backend(backend)
        torch_backend = "cpu:gloo,cuda:nccl" if chosen == "nccl" else "gloo"
        dist.init_process_group(
            torch_backend,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timedelta(milliseconds=timeout_ms),
        )
        _world_timeout_ms = timeout_ms
    return world_group()


def world_group() -> CommGroup:
    """The group of all ranks (wraps the default process group; built on first use)."""
    global _world
    if _world is None:
        if not dist.is_initialized():
            raise CommError("the default process group is not initialised; call init_distributed() first")
        backend = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
        timeout = _world_backend_timeout_ms() or DEFAULT_TIMEOUT_MS
        _world = CommGroup._wrap(list(range(dist.get_world_size())), backend, timeout, "world", dist.group.WORLD)
    return _world


class CommGroup:
    """A communication group over global ``ranks`` (SPEC L2.2).

    Collective constructor: every process of the job constructs every group, in the same order, with the same
    arguments (as torch's ``new_group``), including processes that are not members (their ``rank`` is None).
    ``backend="auto"`` picks NCCL on CUDA devices and Gloo otherwise. ``timeout_ms`` bounds every op on the
    group; an op that exceeds it raises ``CommTimeout``. A group of all ranks with the world's backend and
    timeout reuses the world process group instead of creating another.
    """

    def __init__(
        self, ranks, backend: str = "auto", timeout_ms: int = DEFAULT_TIMEOUT_MS, name: str | None = None
    ) -> None:
        ranks = [int(r) for r in ranks]
        world = world_group()
        bad = [r for r in ranks if not 0 <= r < world.size]
        if bad or not ranks or len(set(ranks)) != len(ranks):
            raise CommError(
                f"CommGroup ranks {ranks} are invalid for world size {world.size}: "
                "give distinct global ranks in [0, world_size)"
            )
        if timeout_ms <= 0:
            raise CommError(f"CommGroup timeout_ms must be positive, got {timeout_ms}")
        chosen = resolve_backend(backend)
        if name is None:
            name = f"g{registry.count()}[{','.join(map(str, ranks))}]"
        if sorted(ranks) == world.ranks and chosen == world.backend and timeout_ms == world.timeout_ms:
            pg = world.pg
        else:
            pg = dist.new_group(ranks=sorted(ranks), timeout=timedelta(milliseconds=timeout_ms), backend=chosen)
        self._setup(ranks, chosen, timeout_ms, name, pg)

    @classmethod
    def _wrap(cls, ranks, backend, timeout_ms, name, pg) -> CommGroup:
        self = cls.__new__(cls)
        self._setup(ranks, backend, timeout_ms, name, pg)
        return self

    def _setup(self, ranks, backend, timeout_ms, name, pg) -> None:
        self.ranks: list[int] = list(ranks)
        self.size = len(self.ranks)
        me = dist.get_rank()
        self.global_rank = me
        self.rank: int | None = self.ranks.index(me) if me in self.ranks else None
        self.name: str = name
        self.backend: str = backend
        self.timeout_ms: int = int(timeout_ms)
        self.timeout = timedelta(milliseconds=self.timeout_ms)
        self.pg = pg
        self.resource = f"group:{name}"
        self.seq = 0  # collectives entered by this rank on this group
        self.p2p: dict[int, int] = {}  # point-to-point ops entered with each peer (global rank)
        self.ops: dict[str, int] = {}
        self.broken: str | None = None  # set after a timeout: the group's state is undefined from then on
        registry.register(self)
        diag.ensure_responder()

    @property
    def is_member(self) -> bool:
        """Whether this process belongs to the group."""
        return self.rank is not None

    def __repr__(self) -> str:
        return (
            f"CommGroup(name={self.name!r}, ranks={self.ranks}, backend={self.backend!r}, timeout_ms={self.timeout_ms})"
        )


def _reset_for_tests() -> None:
    """Forget every group (for a process that re-initialises torch.distributed)."""
    global _world, _world_timeout_ms
    registry.clear()
    _world = None
    _world_timeout_ms = None
