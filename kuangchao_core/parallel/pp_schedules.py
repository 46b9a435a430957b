"""Pipeline schedules as plain functions (SPEC L3.3).

A schedule maps ``(p, pp_rank, m, v)`` to the ordered list of ``Action`` that rank runs for one optimizer step:
compute (``FORWARD``/``BACKWARD`` of micro-batch ``mb`` on local model chunk ``chunk``) and point-to-point traffic
(``SEND_ACT``/``RECV_ACT``/``SEND_GRAD``/``RECV_GRAD`` with the peer's pipeline rank). That list is the definition;
the executor (``pp_executor``) runs it and records what it did.

Virtual stages: rank ``r`` holds ``v`` chunks, chunk ``c`` being virtual stage ``c * p + r`` of ``p * v``
(Megatron's interleaved assignment). When the traffic is issued, grouped, is ``pp_exchange``'s plan, and its
``simulate`` proves for given sizes that the plan cannot deadlock on NCCL's streams and that messages between each
pair of ranks are received in the order they are sent (so in-order transports such as NCCL need no tags).

Micro-batch requirements: ``afab`` needs ``m >= 1``; ``1f1b`` needs ``m >= p`` (fewer never reaches the steady
state, every rank would idle most of the step); ``interleaved_1f1b`` needs ``m >= p`` and ``m % p == 0``
(micro-batches advance in groups of ``p`` through the chunks, as in Megatron-Core).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kuangchao_core.errors import PlanError

FORWARD = "F"
BACKWARD = "B"
SEND_ACT = "SEND_ACT"
RECV_ACT = "RECV_ACT"
SEND_GRAD = "SEND_GRAD"
RECV_GRAD = "RECV_GRAD"
COMPUTE = (FORWARD, BACKWARD)
SENDS = (SEND_ACT, SEND_GRAD)
RECVS = (RECV_ACT, RECV_GRAD)


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule. ``peer`` is the other side's pipeline rank (None for compute)."""

    kind: str
    mb: int
    chunk: int = 0
    peer: int | None = None

    def __str__(self) -> str:
        if self.peer is None:
            return f"{self.kind}{self.mb}.{self.chunk}"
        arrow = "->" if self.kind in SENDS else "<-"
        return f"{self.kind}{self.mb}.{self.chunk}{arrow}{self.peer}"


def stage_of(p: int, pp_rank: int, chunk: int) -> int:
    """Virtual stage index of ``chunk`` on ``pp_rank`` (Megatron interleaved assignment)."""
    return chunk * p + pp_rank


def rank_chunk_of(p: int, stage: int) -> tuple[int, int]:
    """(pp_rank, chunk) holding virtual ``stage``."""
    return stage % p, stage // p


def message_key(action: Action, p: int, pp_rank: int) -> tuple[str, int, int]:
    """Identity of the message a send/recv action carries: (act|grad, micro-batch, receiving virtual stage)."""
    s = stage_of(p, pp_rank, action.chunk)
    if action.kind == SEND_ACT:
        return ("act", action.mb, s + 1)
    if action.kind == SEND_GRAD:
        return ("grad", action.mb, s - 1)
    if action.kind == RECV_ACT:
        return ("act", action.mb, s)
    if action.kind == RECV_GRAD:
        return ("grad", action.mb, s)
    raise ValueError(f"{action} is not a send/recv action")


def _forward(p: int, r: int, v: int, mb: int, chunk: int) -> list[Action]:
    s, last = stage_of(p, r, chunk), p * v - 1
    out = []
    if s > 0:
        out.append(Action(RECV_ACT, mb, chunk, rank_chunk_of(p, s - 1)[0]))
    out.append(Action(FORWARD, mb, chunk))
    if s < last:
        out.append(Action(SEND_ACT, mb, chunk, rank_chunk_of(p, s + 1)[0]))
    return out


def _backward(p: int, r: int, v: int, mb: int, chunk: int) -> list[Action]:
    s, last = stage_of(p, r, chunk), p * v - 1
    out = []
    if s < last:
        out.append(Action(RECV_GRAD, mb, chunk, rank_chunk_of(p, s + 1)[0]))
    out.append(Action(BACKWARD, mb, chunk))
    if s > 0:
        out.append(Action(SEND_GRAD, mb, chunk, rank_chunk_of(p, s - 1)[0]))
    return out


def afab(p: int, pp_rank: int, m: int, v: int = 1) -> list[Action]:
    """All forwards, then all backwards (GPipe order; the reference). Chunks run in stage order."""
    validate_schedule("afab", p, m, v)
    acts: list[Action] = []
    for c in range(v):
        for mb in range(m):
            acts += _forward(p, pp_rank, v, mb, c)
    for c in reversed(range(v)):
        for mb in range(m):
            acts += _backward(p, pp_rank, v, mb, c)
    return acts


def one_f_one_b(p: int, pp_rank: int, m: int, v: int = 1) -> list[Action]:
    """1F1B (PipeDream-flush): ``p - r - 1`` warm-up forwards, then one forward and one backward alternating,
    then the remaining backwards. At most ``p - r`` micro-batches are in flight on rank ``r``."""
    validate_schedule("1f1b", p, m, v)
    warmup = min(p - pp_rank - 1, m)
    acts: list[Action] = []
    for mb in range(warmup):
        acts += _forward(p, pp_rank, 1, mb, 0)
    for i in range(m - warmup):
        acts += _forward(p, pp_rank, 1, warmup + i, 0)
        acts += _backward(p, pp_rank, 1, i, 0)
    for mb in range(m - warmup, m):
        acts += _backward(p, pp_rank, 1, mb, 0)
    return acts


def interleaved_1f1b(p: int, pp_rank: int, m: int, v: int = 2) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al. 2021): micro-batches go through the ``v`` local chunks in groups of
    ``p``; warm-up is ``2 (p - r - 1) + (v - 1) p`` forwards, then 1F1B over the ``m v`` (micro-batch, chunk)
    units, then the remaining backwards."""
    validate_schedule("interleaved_1f1b", p, m, v)
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        c = (k % (p * v)) // p
        return (k // (p * v)) * p + k % p, (c if forward else v - 1 - c)

    warmup = min(2 * (p - pp_rank - 1) + (v - 1) * p, total)
    acts: list[Action] = []
    for k in range(warmup):
        acts += _forward(p, pp_rank, v, *unit(k, True))
    for k in range(total - warmup):
        acts += _forward(p, pp_rank, v, *unit(warmup + k, True))
        acts += _backward(p, pp_rank, v, *unit(k, False))
    for k in range(total - warmup, total):
        acts += _backward(p, pp_rank, v, *unit(k, False))
    return acts


SCHEDULES: dict[str, Callable[..., list[Action]]] = {
    "afab": afab,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
}


def get_schedule(name: str) -> Callable[..., list[Action]]:
    """The schedule function called ``name`` (``afab``, ``1f1b``, ``interleaved_1f1b``)."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise PlanError(
            [("parallel.pipeline_schedule", f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")]
        ) from None


def validate_schedule(name: str, p: int, m: int, v: int = 1) -> None:
    """Raise ``PlanError`` (with the numbers) when ``name`` cannot run ``m`` micro-batches on ``p`` ranks x ``v``."""
    errs: list[tuple[str, str]] = []
    if name not in SCHEDULES:
        errs.append(("parallel.pipeline_schedule", f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}"))
    if p < 1:
        errs.append(("parallel.pipeline_parallel_size", f"must be >= 1, got {p}"))
    if v < 1:
        errs.append(("parallel.virtual_pipeline_size", f"must be >= 1, got {v}"))
    if m < 1:
        errs.append(("parallel.gradient_accumulation_steps", f"micro-batches per step must be >= 1, got {m}"))
    if errs:
        raise PlanError(errs)
    if name == "1f1b":
        if v != 1:
            errs.append(
                (
                    "parallel.virtual_pipeline_size",
                    f"schedule '1f1b' runs one chunk per rank but virtual_pipeline_size={v}; "
                    "use pipeline_schedule 'interleaved_1f1b' or virtual_pipeline_size 1",
                )
            )
        if m < p:
            errs.append(
                (
                    "parallel.gradient_accumulation_steps",
                    f"schedule '1f1b' needs at least as many micro-batches as pipeline stages: m={m} < p={p}; "
                    f"raise gradient_accumulation_steps to >= {p} (4*p={4 * p} or more keeps the bubble small)",
                )
            )
    elif name == "interleaved_1f1b":
        if m < p or m % p:
            errs.append(
                (
                    "parallel.gradient_accumulation_steps",
                    f"schedule 'interleaved_1f1b' needs micro-batches m a positive multiple of p: m={m}, p={p} "
                    f"(m % p = {m % p}); use m = {max(p, -(-m // p) * p)}",
                )
            )
    if errs:
        raise PlanError(errs)


def build_all(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Every rank's action list for schedule ``name``."""
    fn = get_schedule(name)
    return [fn(p, r, m, v) for r in range(p)]


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Theoretical idle fraction of a (interleaved) 1F1B step: ``(p - 1) / (v m + p - 1)``."""
    return (p - 1) / (v * m + p - 1)


def max_in_flight(actions: list[Action]) -> int:
    """Largest number of (micro-batch, chunk) units forwarded but not yet backwarded at any point of a list."""
    live, peak = set(), 0
    for a in actions:
        if a.kind == FORWARD:
            live.add((a.mb, a.chunk))
            peak = max(peak, len(live))
        elif a.kind == BACKWARD:
            live.discard((a.mb, a.chunk))
    return peak
