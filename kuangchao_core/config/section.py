"""What every config section shares: unknown keys refused, numbers read from strings (``Int``, ``Float``)."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict


def _number(value: Any, kind: type) -> Any:
    """Refuse booleans where a number is wanted and read numeric strings such as ``"2e-5"`` or ``"8e9"``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got the boolean {value!r}")
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        try:
            number = float(text)
        except ValueError:
            return value  # let pydantic report the type error
        if kind is int:
            if not math.isfinite(number) or not number.is_integer():
                raise ValueError(f"expected a whole number, got {value!r}")
            return int(number)
        return number
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(lambda v: _number(v, int))]
Float = Annotated[float, BeforeValidator(lambda v: _number(v, float))]


class Section(BaseModel):
    """Common settings of every config section: unknown keys are errors, numbers may name strings."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True, allow_inf_nan=False)
