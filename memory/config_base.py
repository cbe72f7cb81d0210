"""One base for Tightrope's settings dataclasses: the JSON round trip and field-named validation.

The Strategy's parts (`memory/strategy.py`), `TrainConfig`, `LoraSpec` and `Profile` are dataclasses that inherit
`ConfigBase` and say three things about themselves: `ERROR`, the exception their bad values raise (StrategyError,
ConfigError, LoraError, ValueError); `FIELD_PREFIX`, how a message names a field (`Strategy.offload_fraction=...`,
`LoRA rank=...`, `learning_rate=...`); and `FIELD_NOUN`, what an unknown key is called (`training setting`). The
checks below raise `ERROR("<prefix><name>=<value> <problem>: <fix>")`, one style for all; `from_dict` names the
unknown keys and the known ones. `training/` may import this module; `memory/` never imports `training/`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, NoReturn


def _plain(value: Any) -> Any:
    """JSON-ready: nested dataclasses as dicts, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class ConfigBase:
    ERROR: ClassVar[type[Exception]] = ValueError
    """The exception a bad value raises (a ValueError subclass of the config's own layer)."""
    FIELD_PREFIX: ClassVar[str] = ""
    """Put before a field's name in messages, e.g. 'Strategy.' or 'LoRA '."""
    FIELD_NOUN: ClassVar[str] = "field"
    """What a key is called in the unknown-key message, e.g. 'training setting'."""
    UNKNOWN_HINT: ClassVar[str] = ""
    """Appended to the unknown-key message (what to do about a file from another version)."""

    # -- JSON ----------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return _plain(self)

    @classmethod
    def checked_fields(cls, data: Any, *, where: str | None = None) -> dict[str, Any]:
        """`data` as keyword arguments, after checking it is an object with no unknown keys. `where` names the
        object in messages (default: the class name)."""
        if not isinstance(data, dict):
            raise cls.ERROR(f"{where or cls.__name__} must be an object of fields, got {data!r}")
        known = sorted(f.name for f in dataclasses.fields(cls))
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise cls.ERROR(f"unknown {cls.FIELD_NOUN}(s) {unknown}{f' in {where}' if where else ''}: known are "
                            f"{known}{cls.UNKNOWN_HINT}")
        return dict(data)

    @classmethod
    def from_dict(cls, data: Any, *, where: str | None = None):
        return cls(**cls.checked_fields(data, where=where))

    # -- field-named errors and the shared checks ----------------------------------------------------------------
    @classmethod
    def fail(cls, name: str, value: Any, problem: str) -> NoReturn:
        """Raise ERROR naming the field and its value: '<prefix><name>=<value!r> <problem>'."""
        raise cls.ERROR(f"{cls.FIELD_PREFIX}{name}={value!r} {problem}")

    @classmethod
    def check_choice(cls, name: str, value: Any, choices: tuple[str, ...]) -> None:
        if value not in choices:
            cls.fail(name, value, f"is not supported: choose one of {', '.join(choices)}")

    @classmethod
    def check_bool(cls, name: str, value: Any) -> None:
        if not isinstance(value, bool):
            cls.fail(name, value, "must be true or false")

    @classmethod
    def check_number(cls, name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            cls.fail(name, value, "is not a finite number: give a number")
        return float(value)

    @classmethod
    def check_positive(cls, name: str, value: Any, hint: str) -> None:
        if cls.check_number(name, value) <= 0:
            cls.fail(name, value, f"must be greater than 0 ({hint})")

    @classmethod
    def check_range(cls, name: str, value: Any, lo: float, hi: float, hint: str | None = None) -> None:
        """A finite number from lo to hi (a NaN is out of every range)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not lo <= value <= hi:
            cls.fail(name, value, f"is out of range: use a number from {lo} to {hi}" + (f" ({hint})" if hint else ""))

    @classmethod
    def check_int(cls, name: str, value: Any, lo: int, hi: int | None = None, hint: str | None = None) -> None:
        """A whole number (not a bool) >= lo, and <= hi when given."""
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            if hi is None:
                cls.fail(name, value, f"is invalid: use a whole number >= {lo}")
            cls.fail(name, value, f"is out of range: use a whole number from {lo} to {hi}"
                     + (f" ({hint})" if hint else ""))
