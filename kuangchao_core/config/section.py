"""What every config section shares: unknown keys refused, numbers read from strings (``Int``, ``Float``)."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, model_serializer, model_validator

from kuangchao_core import axes as mesh_axes


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


class AxesSection(Section):
    """A section that also holds the size of an axis added to ``axes.TABLE`` beyond its own fields (a test's
    throw-away axis, ``axes.extra_axis``), which the mesh's checks validate by its path; every other unknown key
    stays an error."""

    @model_validator(mode="wrap")
    @classmethod
    def _added_axes(cls, data: Any, handler: Any) -> AxesSection:
        fields = cls.model_fields
        keys = {a.size_key for a in mesh_axes.TABLE if a.size_key not in fields}
        added = {k: _number(v, int) for k, v in data.items() if k in keys} if isinstance(data, dict) else {}
        section = handler({k: v for k, v in data.items() if k not in added} if added else data)
        if added:
            object.__setattr__(section, "__pydantic_extra__", added)  # read as attributes, written by the dump
        return section

    @model_serializer(mode="wrap")
    def _dump_added_axes(self, handler: Any) -> dict[str, Any]:
        return {**handler(self), **(self.__pydantic_extra__ or {})}
