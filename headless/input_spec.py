"""What a node class's `INPUT_TYPES()` declares, read the way ComfyUI's frontend reads it, and checking one
literal input value against its declared type, range and choices.

The frontend turns an input into a *widget* (an editable value saved in `widgets_values`) when its type
has a widget constructor and it is not `forceInput`; everything else is a *socket* that must be linked.
Some widgets drag extra "control" widgets behind them whose values are also saved in `widgets_values`.

Values are checked more strictly than ComfyUI does in three places, because a silently wrong training setting costs
hours: a fractional number for an INT and a string like "false" for a BOOLEAN are rejected/parsed explicitly
instead of going through Python's int()/bool(), and a NaN or infinite FLOAT is refused (ComfyUI's min/max
comparisons are all false for NaN, so NaN passes them).
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any

from .comfyui_v3 import dynamic_input_kinds, finalized_inputs


WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
# The frontend (useIntWidget.ts) gives these INT inputs a control widget unless they say otherwise.
SEED_INPUT_NAMES = ("seed", "noise_seed")
CONTROL_MODES = ("fixed", "increment", "decrement", "randomize", "increment-wrap")
CONTROL_MODE = "control mode"
# Upload options make the frontend add button/preview widgets whose values are saved too (LoadImage saves
# ["photo.png", "image"]; LoadAudio saves ["a.mp3", null, ""]).
UPLOAD_EXTRAS = {"image_upload": ("upload button",), "video_upload": ("upload button",),
                 "animated_image_upload": ("upload button",), "audio_upload": ("upload button", "audio player")}


@dataclass(frozen=True)
class InputSpec:
    name: str
    type: str  # "INT", "FLOAT", "STRING", "BOOLEAN", "COMBO", or a socket type like "MODEL"
    required: bool
    options: dict = field(default_factory=dict)
    choices: tuple | None = None  # the allowed values of a COMBO

    @property
    def is_widget(self) -> bool:
        return self.type in WIDGET_TYPES and not self.options.get("forceInput", False)

    @property
    def saved_extras(self) -> tuple[str, ...]:
        """What the frontend saves in `widgets_values` right after this widget's own value, in order."""
        if not self.is_widget:
            return ()
        for option, extras in UPLOAD_EXTRAS.items():
            if self.options.get(option):
                return extras
        control = self.options.get("control_after_generate")
        if self.type == "INT" and (control if control is not None else self.name in SEED_INPUT_NAMES):
            return (CONTROL_MODE,)  # `??` in the frontend: only an absent/None option falls back to the name
        if self.type == "FLOAT" and control:
            return (CONTROL_MODE,)
        if self.type == "COMBO" and control:
            return (CONTROL_MODE, "control filter")
        return ()

    @property
    def has_default(self) -> bool:
        return "default" in self.options

    @property
    def default(self) -> Any:
        return self.options.get("default")


def node_input_specs(node_class) -> dict[str, InputSpec]:
    """Required then optional inputs, in declaration order (the order the frontend lays widgets out)."""
    return specs_from_declared(node_class, declared_inputs(node_class))


def live_input_specs(node_class, live_inputs: dict) -> dict[str, InputSpec]:
    """The inputs a node with these `live_inputs` has: node_input_specs(), with a V3 node's dynamic inputs expanded
    the way ComfyUI expands them (comfyui_v3.py): an Autogrow's `values.value0`, a DynamicCombo's chosen option's."""
    declared = declared_inputs(node_class)
    if dynamic_input_kinds(declared):
        declared = finalized_inputs(declared, live_inputs)
    return specs_from_declared(node_class, declared)


def specs_from_declared(node_class, declared: dict) -> dict[str, InputSpec]:
    specs: dict[str, InputSpec] = {}
    for category in ("required", "optional"):
        for name, entry in (declared.get(category) or {}).items():
            specs[name] = _parse_entry(node_class, name, entry, required=category == "required")
    return specs


def hidden_inputs(node_class) -> dict[str, str]:
    """`{"hidden": {name: "UNIQUE_ID" | "PROMPT" | ...}}` — values the runtime supplies, never the workflow."""
    hidden = declared_inputs(node_class).get("hidden") or {}
    return {name: (kind[0] if isinstance(kind, (tuple, list)) else kind) for name, kind in hidden.items()}


def widget_specs(node_class) -> list[InputSpec]:
    return [spec for spec in node_input_specs(node_class).values() if spec.is_widget]


def declared_inputs(node_class) -> dict:
    try:
        declared = node_class.INPUT_TYPES()
    except Exception as exc:  # a node's schema failing is a bug in that node: name it
        raise RuntimeError(f"{node_class.__name__}.INPUT_TYPES() raised {exc!r}") from exc
    if not isinstance(declared, dict):
        raise TypeError(f"{node_class.__name__}.INPUT_TYPES() must return a dict, got {type(declared).__name__}")
    return declared


def _parse_entry(node_class, name: str, entry, *, required: bool) -> InputSpec:
    if not isinstance(entry, (tuple, list)) or not entry:
        entry = (entry,)
    kind, options = entry[0], (entry[1] if len(entry) > 1 and isinstance(entry[1], dict) else {})
    if isinstance(kind, (list, tuple)):  # classic combo: the type *is* the list of choices
        return InputSpec(name, "COMBO", required, options, tuple(kind))
    if kind == "COMBO":  # newer spelling: ("COMBO", {"options": [...]})
        return InputSpec(name, "COMBO", required, options, tuple(options.get("options", ())))
    if kind == "COMFY_DYNAMICCOMBO_V3":  # a V3 DynamicCombo: its value is the key of one of its options
        keys = tuple(getattr(option.get("key"), "value", option.get("key"))  # keys may be str Enums
                     for option in options.get("options", ()) if isinstance(option, dict))
        return InputSpec(name, "COMBO", required, options, keys)
    if not isinstance(kind, str):
        raise TypeError(f"{node_class.__name__} input '{name}' has type {kind!r}; expected a type name or a list")
    return InputSpec(name, kind, required, options)


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
    if kind == "COMBO" and value is None:  # JSON null: a node checking its own inputs would take it for a link
        shown = ", ".join(repr(c) for c in list(spec.choices or ())[:20])
        raise ValueError(f"is null, not one of its choices: {shown or 'none available'}")
    if kind == "COMBO" and isinstance(value, str) and value not in (spec.choices or ()):
        # a file in a subfolder, from a workflow saved on another OS: ComfyUI lists it as 'flux\\x.safetensors' on
        # Windows and 'flux/x.safetensors' elsewhere
        return next((v for v in (value.replace("\\", "/"), value.replace("/", "\\")) if v in (spec.choices or ())),
                    value)
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
