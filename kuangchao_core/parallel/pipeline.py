"""Pipeline parallelism (SPEC L3.3): partition, schedules and the executor, in one import.

- ``partition_layers(num_layers, pp, virtual)`` / ``build_stage_chunks(model, pp, pp_rank, virtual)``: which layers
  each (virtual) stage holds, and the local chunks' forward functions over a built model.
- ``get_schedule(name)``: ``afab``, ``1f1b``, ``interleaved_1f1b`` — plain functions ``(p, pp_rank, m, v) -> [Action]``.
- ``PipelineExecutor(group, chunks, loss_fn, hidden_size, schedule)``: runs a step with real send/recv.
"""

from kuangchao_core.parallel.pp_exchange import exchange_plan, simulate
from kuangchao_core.parallel.pp_executor import PipelineExecutor, TraceEvent
from kuangchao_core.parallel.pp_schedules import (
    BACKWARD,
    FORWARD,
    RECV_ACT,
    RECV_GRAD,
    SCHEDULES,
    SEND_ACT,
    SEND_GRAD,
    Action,
    afab,
    bubble_fraction,
    build_all,
    get_schedule,
    interleaved_1f1b,
    max_in_flight,
    one_f_one_b,
    validate_schedule,
)
from kuangchao_core.parallel.pp_stage import (
    ChunkSpec,
    StageChunk,
    build_stage_chunks,
    partition_layers,
    stage_parameters,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "RECV_ACT",
    "RECV_GRAD",
    "SCHEDULES",
    "SEND_ACT",
    "SEND_GRAD",
    "Action",
    "ChunkSpec",
    "PipelineExecutor",
    "StageChunk",
    "TraceEvent",
    "afab",
    "bubble_fraction",
    "build_all",
    "build_stage_chunks",
    "exchange_plan",
    "get_schedule",
    "interleaved_1f1b",
    "max_in_flight",
    "one_f_one_b",
    "partition_layers",
    "simulate",
    "stage_parameters",
    "validate_schedule",
]
