"""The one pipeline executor: runs any schedule's action list with real point-to-point traffic (SPEC L3.3).

Activations and their gradients travel between stages through the comm layer (``send``/``recv`` interfaces, so the
permission guard, sequence numbers and timers apply), grouped as ``pp_exchange.exchange_plan`` says: per exchange
slot one grouped operation (``comm.p2p_batch``, ``batch_isend_irecv``) holding the sends produced then and the
receives of what the peers produce then, as Megatron-Core and ``torch.distributed.pipelining`` group each step's
traffic. torch's NCCL process group runs a rank's traffic on one stream, where a receive posted ahead of its
peer's matching send blocks everything queued behind it; the plan's one slot order on every rank cannot deadlock
(``pp_exchange.simulate`` proves it for given sizes, and CI replays every job's operations under NCCL's stream
rules, ``comm.stream_model``). A receive is posted at its slot and waited where the schedule reads it, so the
transfer overlaps the compute in between; the sends are waited at the end of the step. Messages carry a tag derived from (kind, micro-batch,
receiving stage) so Gloo matches them exactly; the schedules also keep every pair of ranks in send order, which
in-order transports need.

The last stage scales each micro-batch loss by ``1/m``, so the accumulated gradients equal one step on the whole
batch when every micro-batch has the same number of counted tokens.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kuangchao_core.comm import diag
from kuangchao_core.comm import primitives as comm
from kuangchao_core.comm.group import CommGroup
from kuangchao_core.comm.p2p_batch import batch_send_recv
from kuangchao_core.errors import PlanError
from kuangchao_core.hal.memory import pool_empty
from kuangchao_core.parallel.pp_exchange import exchange_plan
from kuangchao_core.parallel.pp_schedules import (
    BACKWARD,
    FORWARD,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    Action,
    get_schedule,
    message_key,
    stage_of,
    validate_schedule,
)
from kuangchao_core.parallel.sequence import pad_to_multiple
from kuangchao_core.parallel.step_loss import weighted_loss

#: each schedule step's sends and receives issued as one grouped operation (``batch_isend_irecv``), as NCCL needs:
#: torch's NCCL process group runs a rank pair's sends and receives on one stream, so the pre-fix order (receives
#: posted one compute early, sends issued one by one; kept behind this switch as the stream checker's sabotage)
#: deadlocks 1F1B at its first exchange in both directions
GROUP_P2P = True


@dataclass(frozen=True)
class TraceEvent:
    """One executed action with its start/end times (``time.perf_counter`` seconds) and, for traffic, the shape."""

    action: Action
    t0: float
    t1: float
    shape: tuple[int, ...] | None = None


class PipelineExecutor:
    """Run one pipeline rank's schedule for a step.

    ``group``: the pipeline group (global ranks ordered by pipeline rank; this process is a member).
    ``chunks``: forward function of each local chunk, ``chunks[c]`` being virtual stage ``c * p + pp_rank``;
    called ``chunk(x, **stage_inputs(micro_batch))`` (packed documents' ``position_ids``/``segment_ids`` when the
    micro-batch has them: every stage holds the step's micro-batches).
    ``loss_fn(output, labels, reduction="mean"|"sum") -> scalar loss``: used on the last virtual stage.
    ``hidden_size``: the activation is ``(micro_batch, seq_len / seq_shards, hidden_size)`` in ``dtype``;
    ``seq_shards``: the tensor-parallel size under sequence parallelism (each rank of a stage holds and sends its
    s/tp positions), else 1.
    """

    def __init__(
        self,
        group: CommGroup,
        chunks: Sequence[Callable[[torch.Tensor], torch.Tensor]],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
        hidden_size: int,
        schedule: str = "1f1b",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seq_shards: int = 1,
    ):
        if group.rank is None:
            raise PlanError([("pipeline", f"rank {group.global_rank} is not in the pipeline group {group.ranks}")])
        self.group = group
        self.p = group.size
        self.pp_rank = group.rank
        self.chunks = list(chunks)
        self.v = len(self.chunks)
        self.loss_fn = loss_fn
        self.hidden_size = hidden_size
        self.seq_shards = seq_shards
        self.schedule_name = schedule
        self.schedule = get_schedule(schedule)
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_stages = self.p * self.v
        if self.is_last_stage(self.v - 1) and loss_fn is None:
            raise PlanError([("pipeline", "the last pipeline stage needs a loss function")])
        self.trace: list[TraceEvent] = []
        self.compute_seconds = 0.0
        self._plans: dict[int, dict[int, list[list[int]]]] = {}

    def is_last_stage(self, chunk: int) -> bool:
        """Whether local ``chunk`` is the last virtual stage."""
        return stage_of(self.p, self.pp_rank, chunk) == self.num_stages - 1

    def forward_only(self, ids: torch.Tensor, inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
        """One batch through every virtual stage in order, forward only (evaluation, decoding): each rank runs its
        chunks, activations sent to the next stage's rank; returns the last stage's output on the rank that holds it,
        None on the others. ``inputs``: the chunks' keyword inputs (:func:`stage_inputs`). Collective over PP.
        Under sequence parallelism a length ``seq_shards`` does not divide is right-padded (causal attention: the
        real positions never see the padding) and the output cut back."""
        ranks, p = self.group.ranks, self.p
        ids, inputs, s = pad_to_multiple(ids, dict(inputs or {}), self.seq_shards)
        x: torch.Tensor | None = None
        out = None
        for stage in range(self.num_stages):
            if stage % p != self.pp_rank:
                continue
            if stage == 0:
                x = ids
            else:
                x = pool_empty(self._act_shape(ids), self.dtype, ids.device, "pp.recv_buffers", "comm")
                comm.recv(x, src=ranks[(stage - 1) % p], group=self.group)
            y = self.chunks[stage // p](x, **inputs)
            if stage == self.num_stages - 1:
                out = y[:, :s]
            else:
                comm.send(y.contiguous(), dst=ranks[(stage + 1) % p], group=self.group)
        return out

    def _act_shape(self, ids: torch.Tensor) -> tuple[int, ...]:
        """Shape of the activation between stages for token ids ``ids`` (batch, s): (batch, s / seq_shards, h)."""
        b, s = ids.shape
        if s % self.seq_shards:
            raise PlanError(
                [("data.seq_len", f"sequence length {s} is not divisible by tensor_parallel_size {self.seq_shards}")]
            )
        return (b, s // self.seq_shards, self.hidden_size)

    def actions(self, m: int) -> list[Action]:
        """This rank's action list for ``m`` micro-batches (the schedule's definition)."""
        return self.schedule(self.p, self.pp_rank, m, self.v)

    def exchange_plan(self, m: int) -> dict[int, list[list[int]]]:
        """This rank's grouped exchanges for ``m`` micro-batches (``pp_exchange.exchange_plan``; the same plan on
        every rank, computed from every rank's actions)."""
        if m not in self._plans:
            every = [self.schedule(self.p, r, m, self.v) for r in range(self.p)]
            self._plans[m] = exchange_plan(every, self.p)[self.pp_rank]
        return self._plans[m]

    def _tag(self, action: Action, m: int) -> int:
        kind, mb, stage = message_key(action, self.p, self.pp_rank)
        return (mb * self.num_stages + stage) * 2 + (kind == "grad")

    def run(
        self, micro_batches: Sequence[dict], precision: Any = None, loss_weight: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Run forward and backward of every micro-batch (dicts with ``input_ids`` and ``labels``), accumulating
        parameter gradients; returns the step's loss on the last stage, None elsewhere: the mean over micro-batches
        of their mean losses, or with ``loss_weight`` the sum over their labelled tokens times it
        (:func:`~kuangchao_core.parallel.step_loss.weighted_loss`).

        ``precision``: a :class:`~kuangchao_core.parallel.mixed_precision.MixedPrecision` whose autocast the
        forwards run under and whose scaled loss the last stage's backward starts from (the loss returned is
        unscaled)."""
        autocast = precision.autocast if precision is not None else contextlib.nullcontext
        scale = precision.scale if precision is not None else (lambda loss: loss)
        m = len(micro_batches)
        validate_schedule(self.schedule_name, self.p, m, self.v)
        act_shape = self._act_shape(micro_batches[0]["input_ids"])
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        grads_in: dict[tuple[int, int], torch.Tensor] = {}
        pending: list[tuple[object, object]] = []
        total = None
        self.trace = []
        self.compute_seconds = 0.0
        ranks = self.group.ranks
        actions = self.actions(m)
        plan = self.exchange_plan(m) if GROUP_P2P else {}
        posted: dict[int, tuple[object, torch.Tensor]] = {}
        issued_at: dict[int, float] = {}  # a send's action index -> when its grouped operation was issued
        compute_at = [i for i, a in enumerate(actions) if a.kind in (FORWARD, BACKWARD)]
        next_post = 0

        def post_until(stop: int) -> None:
            # the pre-fix order (GROUP_P2P off): receives posted one compute early, each on its own
            nonlocal next_post
            for j in range(next_post, min(stop, len(actions))):
                r = actions[j]
                if r.kind in (RECV_ACT, RECV_GRAD):
                    buf = pool_empty(act_shape, self.dtype, self.device, "pp.recv_buffers", "comm")
                    h = comm.irecv(buf, ranks[r.peer], group=self.group, tag=self._tag(r, m))
                    posted[j] = (h, buf)
            next_post = max(next_post, stop)

        def outgoing(a: Action, key: tuple[int, int]) -> torch.Tensor:
            t = outputs[key].detach() if a.kind == SEND_ACT else grads_in.pop(("send", *key))
            return t.contiguous()

        def exchange(group_of: list[int]) -> None:
            # one slot's sends and receives as one grouped operation (pp_exchange); each receive is waited where
            # the schedule reads it, the sends at the end of the step
            sends, recvs = [], []
            now = time.perf_counter()
            for j in group_of:
                r = actions[j]
                if r.kind in (SEND_ACT, SEND_GRAD):
                    sends.append((outgoing(r, (r.mb, r.chunk)), ranks[r.peer], self._tag(r, m)))
                    issued_at[j] = now
                else:
                    recvs.append(
                        (pool_empty(act_shape, self.dtype, self.device, "pp.recv_buffers", "comm"), ranks[r.peer], j)
                    )
            tags = [t for *_, t in sends] + [self._tag(actions[j], m) for *_, j in recvs]
            h = batch_send_recv([s[:2] for s in sends], [r[:2] for r in recvs], self.group, tags=tags)
            for buf, _, j in recvs:
                posted[j] = (h, buf)
            pending.append((h, sends))

        ci = 0
        for i, a in enumerate(actions):
            key = (a.mb, a.chunk)
            shape = None
            for group_of in plan.get(i, ()):
                exchange(group_of)
            t0 = time.perf_counter()
            if a.kind in (FORWARD, BACKWARD) and not GROUP_P2P:
                ci += 1
                post_until(compute_at[ci] if ci < len(compute_at) else len(actions))
            if a.kind == FORWARD:
                x = inputs.pop(key) if stage_of(self.p, self.pp_rank, a.chunk) > 0 else None
                if x is None:
                    x = micro_batches[a.mb]["input_ids"].to(self.device)
                    inputs[key] = None
                else:
                    inputs[key] = x
                with autocast():
                    out = self.chunks[a.chunk](x, **stage_inputs(micro_batches[a.mb], self.device))
                    if self.is_last_stage(a.chunk):
                        out = weighted_loss(self.loss_fn, out, micro_batches[a.mb], m, loss_weight)
                if self.is_last_stage(a.chunk):
                    total = out.detach() if total is None else total + out.detach()
                    out = scale(out)
                outputs[key] = out
            elif a.kind == BACKWARD:
                out = outputs.pop(key)
                if self.is_last_stage(a.chunk):
                    torch.autograd.backward(out)
                else:
                    torch.autograd.backward(out, grads_in.pop(key))
                x = inputs.pop(key)
                if x is not None:
                    grads_in[("send", *key)] = x.grad
            elif a.kind in (SEND_ACT, SEND_GRAD):
                if GROUP_P2P:
                    shape, t0 = act_shape, issued_at.pop(i)
                else:
                    t = outgoing(a, key)
                    shape = tuple(t.shape)
                    h = comm.isend(t, ranks[a.peer], group=self.group, tag=self._tag(a, m))
                    pending.append((h, t))
            else:
                if i not in posted:
                    post_until(i + 1)
                h, buf = posted.pop(i)
                h.wait()
                shape = tuple(buf.shape)
                if a.kind == RECV_ACT:
                    inputs[key] = buf.requires_grad_()
                else:
                    grads_in[key] = buf
            t1 = time.perf_counter()
            if a.kind in (FORWARD, BACKWARD):
                self.compute_seconds += t1 - t0
                diag.beat()  # progress for comm.watchdog: a peer's receive posted ahead waits on this compute
            self.trace.append(TraceEvent(a, t0, t1, shape))
        for group_of in plan.get(len(actions), ()):  # the sends after the last compute
            exchange(group_of)
        for h, _ in pending:
            h.wait()
        if outputs or grads_in or any(v is not None for v in inputs.values()):
            raise PlanError(
                [("pipeline", f"schedule {self.schedule_name!r} left work unfinished on rank {self.pp_rank}")]
            )
        return total


#: a micro-batch's inputs the stages need besides the activations (packed documents; a vision-language model's
#: images, which only the first stage's embedding reads)
STAGE_KEYS = ("position_ids", "segment_ids", "pixel_values")


def stage_inputs(batch: dict, device: Any) -> dict[str, torch.Tensor]:
    """The keyword inputs of a stage chunk that ``batch`` carries, on ``device``."""
    return {k: batch[k].to(device) for k in STAGE_KEYS if k in batch}
