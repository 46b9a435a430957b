"""The ``model.lora`` section: low-rank adapters instead of full fine-tuning."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from kuangchao_core.config.section import Float, Int, Section

#: projections LoRA can adapt (``model.lora.targets``)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSection(Section):
    """Low-rank adapters (:mod:`kuangchao_core.models.lora`): the base weights stay frozen; each targeted projection
    ``W`` gains ``B @ A`` (``A``: rank × in, ``B``: out × rank, ``B`` starting at zero), scaled by ``alpha / rank``."""

    rank: Int = Field(default=8, ge=1)
    alpha: Float = Field(default=16.0, gt=0)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input (PEFT's)")
    targets: list[Literal[LORA_TARGETS]] = Field(default_factory=lambda: ["q_proj", "v_proj"], min_length=1)

    @field_validator("targets")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"targets must be distinct, got {value}")
        return value
