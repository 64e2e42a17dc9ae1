"""Type checks of config values against a config dataclass's field annotations."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

_SIMPLE = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "None": (type(None),)}


def check_values(cls: type, values: dict[str, Any], where: str) -> None:
    """``ValueError`` naming ``where.key`` and the value for any value whose type its field's
    annotation (``int``, ``float``, ``str``, ``bool``, ``X | None``) does not allow. ``bool`` is
    never taken as a number, nor a number or string as a ``bool``."""
    for f in fields(cls):
        if f.name not in values:
            continue
        names = [a.strip() for a in str(f.type).split("|")]
        if not all(n in _SIMPLE for n in names):
            continue  # a nested config or a free-form value: checked by its own type
        value = values[f.name]
        allowed = tuple(t for n in names for t in _SIMPLE[n])
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            key = f"{where}.{f.name}" if where else f.name
            raise ValueError(f"{key} must be {f.type}, got {value!r}")
