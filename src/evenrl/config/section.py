"""What every config section shares: bounds that catch typos, and `Section`, the strict base model (no unknown
keys, frozen, no NaN or inf, no true/false for a number, no NUL in text). Pure Python."""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

# Caps that catch typos (10**12 prompts) before any arithmetic is attempted.
MAX_COUNT = 10_000_000
MAX_TOKENS = 10_000_000
MAX_SEED = 2**63 - 1  # torch.manual_seed takes a 64-bit integer


class Section(BaseModel):
    # allow_inf_nan=False: NaN or inf in any float field (a reward weight, a coefficient) would poison the run.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _strict_values(cls, value: Any, info: ValidationInfo) -> Any:
        """Every int and float field, also inside lists and tuples, refuses true/false (pydantic's lax mode would
        read them as 1 and 0); every text field refuses a NUL character (no path or name can hold one)."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None:
            _check_leaves(field.annotation, value)
        return value


def _check_leaves(ann: Any, value: Any) -> None:
    """Raise pydantic's error for a bool where `ann` wants a number, or a NUL in text, at any depth of `value`."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is Annotated:
        return _check_leaves(args[0], value)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if arg is not type(None):
                _check_leaves(arg, value)
        return
    if ann in (int, float) and isinstance(value, bool):
        raise PydanticCustomError("number_not_bool", "expected a number, not true/false")
    if ann is str and isinstance(value, str) and "\0" in value:
        raise PydanticCustomError("text_nul", "expected text without a zero (\\x00) character")
    if origin in (list, tuple) and isinstance(value, (list, tuple)):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            for arg, item in zip(args, value):
                _check_leaves(arg, item)
        elif args:
            for item in value:
                _check_leaves(args[0], item)
