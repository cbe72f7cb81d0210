"""Small stand-in node classes (classic ComfyUI V1 API) for the headless runner's tests.

Every call is logged in EXECUTED as (class name, kwargs), so tests can see what ran, in what order, with what.
"""
EXECUTED: list = []


class _Logged:
    CATEGORY = "tests"
    FUNCTION = "run"

    def _log(self, **kwargs):
        EXECUTED.append((type(self).__name__, kwargs))


class Constant(_Logged):
    RETURN_TYPES = ("INT",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"default": 1, "min": 0, "max": 1000})}}

    def run(self, value):
        self._log(value=value)
        return (value,)


class Add(_Logged):
    """Widgets in order: a, b, seed (+ control value), mode, then optional bias; `extra` is a socket."""
    RETURN_TYPES = ("INT",)
    RETURN_NAMES = ("sum",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "a": ("INT", {"default": 0, "min": 0, "max": 1000}),
                "b": ("INT", {"default": 0, "min": 0, "max": 255}),
                "seed": ("INT", {"default": 0, "min": 0, "max": 2**64 - 1}),  # control widget by name
                "mode": (["add", "sub"], {"default": "add"}),
            },
            "optional": {
                "bias": ("FLOAT", {"default": 0.0, "min": -10.0, "max": 10.0, "step": 0.5}),
                "extra": ("INT", {"forceInput": True}),
            },
        }

    def run(self, a, b, seed, mode, bias=0.0, extra=0):
        self._log(a=a, b=b, seed=seed, mode=mode, bias=bias, extra=extra)
        total = a + b if mode == "add" else a - b
        return (int(total + bias + extra),)


class Double(_Logged):
    RETURN_TYPES = ("INT",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"forceInput": True})}}

    def run(self, value):
        self._log(value=value)
        return (value * 2,)


class MakeModel(_Logged):
    RETURN_TYPES = ("FAKE_MODEL",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"size": ("INT", {"default": 4, "min": 1, "max": 64, "control_after_generate": True})}}

    def run(self, size):
        self._log(size=size)
        return ({"size": size},)


class UseModel(_Logged):
    RETURN_TYPES = ("INT",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("FAKE_MODEL",)}}

    def run(self, model):
        self._log(model=model)
        return (model["size"],)


class Record(_Logged):
    """The output node: shows its value in `ui` and learns its own node id from the hidden UNIQUE_ID."""
    RETURN_TYPES = ()
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"forceInput": True})},
                "optional": {"label": ("STRING", {"default": "value"})},
                "hidden": {"unique_id": "UNIQUE_ID", "prompt": "PROMPT"}}

    def run(self, value, label="value", unique_id=None, prompt=None):
        self._log(value=value, label=label, unique_id=unique_id)
        return {"ui": {"text": [f"{label}={value}"]}, "result": ()}


class Explode(_Logged):
    RETURN_TYPES = ("INT",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("INT", {"forceInput": True})}}

    def run(self, value):
        raise RuntimeError("boom")


FAKE_NODE_MAPPINGS = {cls.__name__: cls for cls in (Constant, Add, Double, MakeModel, UseModel, Record, Explode)}
