"""The validation rules every request model shares: JSON types as sent (``"5"`` is not an
integer), no NaN or infinity, and unknown keys refused, except at a generation request's top
level, where ``server/unknown_fields.py`` judges them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class Request(Strict):
    """A generation request's top level: undeclared fields are kept in ``model_extra``."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
