"""Checking one literal input value against its declared type, range and choices.

Stricter than ComfyUI in three places, because a silently wrong training setting costs hours:
a fractional number for an INT and a string like "false" for a BOOLEAN are rejected/parsed
explicitly instead of going through Python's int()/bool(), and a NaN or infinite FLOAT is refused
(ComfyUI's min/max comparisons are all false for NaN, so NaN passes them).
"""
from __future__ import annotations

import difflib
import math

from .input_spec import InputSpec

_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def checked_value(spec: InputSpec, value, *, check_limits: bool = True):
    """`value` converted to what the node receives; raises ValueError saying what is wrong and the fix."""
    value = _converted(spec, value)
    if check_limits:
        _check_range(spec, value)
        _check_choices(spec, value)
    return value


def _converted(spec: InputSpec, value):
    kind = spec.type
    if kind == "INT":
        if isinstance(value, bool):
            raise ValueError(f"is {value!r}; it needs a whole number")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                raise ValueError(f"is {value!r}; it needs a whole number") from None
        if not isinstance(value, int):
            raise ValueError(f"is {value!r}; it needs a whole number")
        return value
    if kind == "FLOAT":
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"is {value!r}; it needs a number")
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"is {value!r}; it needs a number") from None
    if kind == "STRING":
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(f"is {value!r}; it needs text")
        return str(value)
    if kind == "BOOLEAN":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ValueError(f"is {value!r}; it needs true or false")
    return value  # COMBO values are checked against the choices; other types are the node's business


def _check_range(spec: InputSpec, value) -> None:
    if spec.type not in ("INT", "FLOAT"):
        return
    low, high = spec.options.get("min"), spec.options.get("max")
    limits = f"{low if low is not None else '-inf'}..{high if high is not None else 'inf'}"
    if spec.type == "FLOAT" and not math.isfinite(value):  # NaN passes any min/max comparison
        raise ValueError(f"is {value}, not a finite number: use a value in {limits}")
    if low is not None and value < low:
        raise ValueError(f"is {value}, below its min of {low}: use a value in {limits}")
    if high is not None and value > high:
        raise ValueError(f"is {value}, above its max of {high}: use a value in {limits}")


def _check_choices(spec: InputSpec, value) -> None:
    if spec.type != "COMBO":
        return
    choices = list(spec.choices or ())
    candidates = value if spec.options.get("multiselect") and isinstance(value, list) else [value]
    for candidate in candidates:
        if candidate in choices:
            continue
        shown = ", ".join(repr(c) for c in choices[:20])
        shown += f", ... ({len(choices)} in all)" if len(choices) > 20 else ""
        close = difflib.get_close_matches(str(candidate), [str(c) for c in choices], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"is {candidate!r}, not one of its choices{hint}: {shown or 'none available'}")
