"""Process groups: ``init_distributed``, the world group and ``CommGroup`` (SPEC L2.2).

``CommGroup`` wraps a ``torch.distributed`` process group and keeps the state that the dispatch point, the
timeout diagnosis and the state dump need: the ranks in the order the caller gave, the backend, the
timeout, and per-rank progress counters (collective sequence number, point-to-point counts per peer).

Two kinds of group (DESIGN §2): **device groups** carry the job's device tensors (NCCL on GPUs; every group the
mesh builds, and the world group), and the **host group** (:func:`host_group`, Gloo over every rank) carries the
small host-side agreements — resume plan, barriers, config versions. Each group records the backend torch was
given exactly (``backend_spec``), the backend that carries its tensors (``backend``) and the rules it enforces
(``rules``: ``nccl`` on NCCL, and on Gloo device groups under ``KC_COMM_RULES=nccl``; see ``comm.rules``).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from kuangchao_core.comm import diag, registry, rules, stream_trace, watchdog
from kuangchao_core.errors import CommError
from kuangchao_core.hal import stand_in

DEFAULT_TIMEOUT_MS = 30000
_BACKENDS = ("auto", "gloo", "nccl")

_world: CommGroup | None = None
_host: CommGroup | None = None
_world_timeout_ms: int | None = None
_world_spec: str | None = None  # the backend string this process gave init_process_group


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
        dev = torch.device("cuda") if _device_backend(str(dist.get_backend())) == "nccl" else torch.device("cpu")
        return int(pg._get_backend(dev).options._timeout.total_seconds() * 1000)
    except Exception:
        return None


def init_distributed(backend: str = "auto", timeout_ms: int = 300000) -> CommGroup:
    """Join the job's process group (torchrun env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and return it.

    If the default group is already initialised (by torchrun tooling or a test harness), it is adopted as is.
    With ``backend="auto"`` on a CUDA device the group carries NCCL for CUDA tensors and Gloo for CPU tensors.
    """
    global _world_timeout_ms, _world_spec
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
            timeout=watchdog.torch_timeout(timeout_ms, chosen),  # NCCL: a backstop behind comm.watchdog
        )
        _world_timeout_ms = timeout_ms
        _world_spec = torch_backend
        stream_trace.reset()  # a new job in this process: its stream replay starts empty
    return world_group()


def _device_backend(spec: str) -> str:
    """The backend that carries device tensors in a torch backend string: ``gloo``, ``nccl``, or the one named for
    ``cuda`` in a per-device string such as ``cpu:gloo,cuda:nccl`` (read exactly, never by substring)."""
    spec = spec.strip().lower()
    if ":" not in spec:
        return spec
    per_device = dict(part.split(":", 1) for part in spec.split(",") if ":" in part)
    return per_device.get("cuda", per_device.get("cpu", spec))


def world_group() -> CommGroup:
    """The group of all ranks (wraps the default process group; built on first use)."""
    global _world
    if _world is None:
        if not dist.is_initialized():
            raise CommError("the default process group is not initialised; call init_distributed() first")
        spec = _world_spec or str(dist.get_backend())
        timeout = _world_backend_timeout_ms() or DEFAULT_TIMEOUT_MS
        ranks = list(range(dist.get_world_size()))
        _world = CommGroup._wrap(ranks, _device_backend(spec), timeout, "world", dist.group.WORLD, spec=spec)
    return _world


def host_group() -> CommGroup:
    """The group of all ranks for host-side coordination (Gloo, CPU tensors only; built on first use).

    Collective on first use: every rank calls it at the same point (the trainer builds it with its groups). A job
    whose world is Gloo shares the world's process group; on NCCL it is a Gloo group of its own, so a host tensor
    never travels on an NCCL group.
    """
    global _host
    if _host is None:
        world = world_group()
        pg = (
            world.pg
            if world.backend == "gloo"
            else dist.new_group(ranks=world.ranks, timeout=world.timeout, backend="gloo")
        )
        _host = CommGroup._wrap(world.ranks, "gloo", world.timeout_ms, "host", pg, kind="host")
    return _host


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
            pg = dist.new_group(ranks=sorted(ranks), timeout=watchdog.torch_timeout(timeout_ms, chosen), backend=chosen)
        self._setup(ranks, chosen, timeout_ms, name, pg)

    @classmethod
    def _wrap(cls, ranks, backend, timeout_ms, name, pg, kind: str = "device", spec: str | None = None) -> CommGroup:
        self = cls.__new__(cls)
        self._setup(ranks, backend, timeout_ms, name, pg, kind=kind, spec=spec)
        return self

    def _setup(self, ranks, backend, timeout_ms, name, pg, kind: str = "device", spec: str | None = None) -> None:
        self.ranks: list[int] = list(ranks)
        self.size = len(self.ranks)
        me = dist.get_rank()
        self.global_rank = me
        self.rank: int | None = self.ranks.index(me) if me in self.ranks else None
        self.name: str = name
        self.backend: str = backend  # the backend that carries this group's tensors
        self.backend_spec: str = spec or backend  # exactly what torch was given
        self.kind: str = kind  # "device": the job's device tensors; "host": CPU tensors for coordination
        self.rules: str = "nccl" if kind == "device" and (backend == "nccl" or stand_in.active()) else backend
        self.order = rules.OrderLog()  # what was issued, in order (filled where rules are enforced)
        self.timeout_ms: int = int(timeout_ms)
        self.timeout = timedelta(milliseconds=self.timeout_ms)
        self.pg = pg
        self.resource = f"group:{name}"
        self.seq = 0  # collectives entered by this rank on this group
        self.p2p: dict[int, int] = {}  # point-to-point ops entered with each peer (global rank)
        self.ops: dict[str, int] = {}
        self.broken: str | None = None  # set after a timeout: the group's state is undefined from then on
        self.timed_out: tuple | None = None  # (op, seq, CommTimeout) the watchdog noticed
        registry.register(self)
        diag.ensure_responder()

    @property
    def is_member(self) -> bool:
        """Whether this process belongs to the group."""
        return self.rank is not None

    def __repr__(self) -> str:
        return (
            f"CommGroup(name={self.name!r}, ranks={self.ranks}, backend={self.backend!r}, kind={self.kind!r}, "
            f"timeout_ms={self.timeout_ms})"
        )


def _reset_for_tests() -> None:
    """Forget every group (for a process that re-initialises torch.distributed)."""
    global _world, _host, _world_timeout_ms, _world_spec
    registry.clear()
    _world = _host = None
    _world_timeout_ms = _world_spec = None
