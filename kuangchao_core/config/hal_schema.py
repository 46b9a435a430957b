"""The ``hal`` section: the hardware abstraction layer's memory pool (SPEC L1.4, issue 44)."""

from __future__ import annotations

from pydantic import Field

from kuangchao_core.config.section import Int, Section


class HalSection(Section):
    """The HAL's memory pool, where the engine's own buffers (gradient buckets, ZeRO's flat shards) come from."""

    #: the most bytes the pool holds at once, live buffers plus freed blocks kept for reuse; an allocation past it
    #: ends the job with an out-of-memory error naming the rank's top memory consumers (its report is written to
    #: ``<run_dir>/debug/memory/``); null: no cap but the device's memory
    memory_pool_size: Int | None = Field(default=None, ge=1)
