"""LoRA settings (`LoraSpec`) and putting peft LoRA layers into / taking them out of a transformer.

peft's `inject_adapter_in_model` is used, not a PeftModel: module names stay as they were, plus peft's own
`<layer>.base_layer` / `.lora_A.default` / `.lora_B.default`, so the memory runtime's block discovery and the saved
file's key names see the model's real names. Inject LoRA before the memory runtime is applied; `remove_lora` leaves
the module exactly as it came (same modules, state dict and requires_grad flags).
"""
from __future__ import annotations

import math
import os
import re
import weakref
from dataclasses import dataclass
from pathlib import Path, PureWindowsPath

import torch
from peft import inject_adapter_in_model
from torch import nn

from ...memory.config_base import ConfigBase
from .algorithms import ADAPTER, PEFT_LAYERS, adapter_parameters, check_algorithm, check_base_weights, \
    layer_algorithm, merged_weight, peft_config
from .quantized_linear import check_quantized_targets, register_quantized_targets
from .targets import PRESETS, LoraError, linear_layer_names, matching_linear_layers, target_regex_for

__all__ = ["LoraSpec", "LoraError", "inject_lora", "remove_lora", "merge_and_remove_lora", "lora_layers",
           "lora_parameters", "lora_state", "load_lora_state", "resolve_existing_lora", "targeted_layers",
           "keep_inputs_in_compute_dtype"]

INITS = ("default", "gaussian")

# requires_grad flags of each injected module's parameters before injection, restored by remove_lora
_FLAGS_BEFORE: "weakref.WeakKeyDictionary[nn.Module, dict[str, bool]]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True, kw_only=True)
class LoraSpec(ConfigBase):
    ERROR = LoraError
    FIELD_PREFIX = "LoRA "
    FIELD_NOUN = "LoRA setting"

    rank: int = 16
    """LoRA rank r: capacity and file size."""
    alpha: float | None = None
    """The update is scaled by alpha/r (alpha/sqrt(r) with rslora). Default: alpha = rank (scale 1)."""
    rslora: bool = False
    dropout: float = 0.0
    """Dropout on the LoRA input while training."""
    targets: str = "attention"
    """Preset: 'attention', 'attention_mlp' or 'all_linear' (resolved per model family)."""
    target_regex: str | None = None
    """Overrides `targets`: a regex fully matching the module names to train."""
    init: str = "default"
    """'default' (peft: A kaiming-uniform, B zero) or 'gaussian' (A normal, B zero); both start as a no-op."""
    existing_lora: str | None = None
    """A .safetensors LoRA to continue training from."""
    algorithm: str = "lora"
    """'lora', 'dora' (LoRA plus a trained magnitude per output), 'loha' (Hadamard product of two low-rank pairs)
    or 'lokr' (Kronecker product); all through peft, saved with the keys ComfyUI's weight adapters read."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            self.fail("rank", self.rank, "is invalid: use a rank of 1 or more (4-64 is typical)")
        alpha = self.rank if self.alpha is None else self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
            self.fail("alpha", self.alpha, "is invalid: use a number greater than 0 (alpha = rank keeps the update "
                      "scale at 1)")
        object.__setattr__(self, "alpha", float(alpha))
        self.check_bool("rslora", self.rslora)
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < 1:
            self.fail("dropout", d, "is invalid: use a probability from 0 up to (not including) 1, e.g. 0.0 or 0.1")
        object.__setattr__(self, "dropout", float(d))
        if self.targets not in PRESETS:
            self.fail("targets", self.targets, f"is not a preset: choose one of {', '.join(PRESETS)} (or set "
                      "target_regex)")
        self._check_regex()
        self.check_choice("init", self.init, INITS)
        check_algorithm(self.algorithm, self.dropout, self.init)
        self._check_existing_lora()

    def _check_regex(self) -> None:
        rx = self.target_regex
        if rx is not None and not isinstance(rx, str):
            self.fail("target_regex", rx, "is not a string: give a regex such as '.*img_attn\\.qkv'")
        if rx is None or not rx.strip():
            object.__setattr__(self, "target_regex", None)
            return
        try:
            re.compile(rx)
            return
        except re.error as e:
            problem = f"does not compile ({e}): fix the regex, e.g. 'double_blocks\\.\\d+\\.img_attn\\.qkv'"
        self.fail("target_regex", rx, problem)  # outside the except: the message says all, no chained traceback

    def _check_existing_lora(self) -> None:
        path = self.existing_lora
        if path is None or (isinstance(path, str) and not path.strip()):
            object.__setattr__(self, "existing_lora", None)
            return
        if not isinstance(path, (str, os.PathLike)):
            self.fail("existing_lora", path, "is not a path: give the path of a .safetensors LoRA")
        path = os.fspath(path)
        if not path.lower().endswith(".safetensors"):
            self.fail("existing_lora", path, "is not a .safetensors file: Tightrope only loads safetensors (never "
                      "pickled .ckpt/.pt/.bin); convert it or leave existing_lora empty")
        object.__setattr__(self, "existing_lora", path)

    @property
    def scale(self) -> float:
        """The factor on B @ A: alpha/r, or alpha/sqrt(r) with rsLoRA (peft's `scaling`)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def resolve_existing_lora(name: str, loras_dir: str | os.PathLike) -> str:
    """A LoRA to continue from, given as a full path or as a name inside the loras folder -> its full path."""
    LoraSpec(existing_lora=name)  # the .safetensors check, same message
    given = Path(name).expanduser()
    candidates = [given] if given.is_absolute() else [Path(loras_dir) / given, given]
    if os.sep == "/" and "\\" in name and not given.is_absolute():
        # a name from ComfyUI's LoRA list on Windows ('tightrope\\my_lora_00001_.safetensors'), in a workflow run
        # here (a Linux GPU): its folders are separated by backslashes, which are letters of a name here
        candidates.append(Path(loras_dir) / Path(*PureWindowsPath(name).parts))
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise LoraError(f"existing_lora={name!r} was not found (looked in {os.fspath(loras_dir)} and at the path "
                    "itself): give a file name from the loras folder, e.g. 'tightrope/my_lora_00001_.safetensors', "
                    "or a full path")


# ------------------------------------------------------------------------------------------------ inject / remove
def targeted_layers(module: nn.Module, spec: LoraSpec, family: str) -> list[str]:
    """The Linear layers `spec` puts a LoRA on in `module`, checked: at least one, rank no larger than each."""
    regex = target_regex_for(family, spec.targets, spec.target_regex)
    names = matching_linear_layers(module, regex)
    if not names:
        what = f"target_regex {regex!r}" if spec.target_regex else f"preset {spec.targets!r} ({regex!r})"
        raise LoraError(f"LoRA {what} matches no layer of this {family} model ({type(module).__name__}); its "
                        f"Linear layers include {', '.join(linear_layer_names(module, 6)) or 'none'}: connect a "
                        f"{family} model, or set target_regex to match some of those layers")
    for name in names:
        layer = module.get_submodule(name)
        limit = min(layer.in_features, layer.out_features)
        if spec.rank > limit:
            raise LoraError(f"LoRA rank={spec.rank} is larger than layer {name!r} (Linear {layer.in_features} -> "
                            f"{layer.out_features}) allows: use rank <= {limit}, or leave that layer out")
    return names


def inject_lora(module: nn.Module, spec: LoraSpec, family: str) -> list[str]:
    """Put a LoRA on the targeted layers of `module` (in place); freeze everything else. Returns the targeted layer
    names. LoRA weights are fp32 whatever the base dtype (optimizer masters). `spec.existing_lora` is not read here:
    files.inject_lora_continuing loads it."""
    if lora_layers(module):
        raise LoraError(f"{type(module).__name__} already has LoRA layers: call remove_lora(module) before "
                        "injecting another LoRA")
    names = targeted_layers(module, spec, family)
    check_quantized_targets(module, names, spec.algorithm)
    check_base_weights(module, names, spec.algorithm)
    flags = {n: p.requires_grad for n, p in module.named_parameters()}
    config = peft_config(spec, target_regex_for(family, spec.targets, spec.target_regex))
    register_quantized_targets(config, module, names)
    _FLAGS_BEFORE[module] = flags
    try:
        inject_adapter_in_model(config, module, adapter_name=ADAPTER)
        module.requires_grad_(False)
        for p in lora_parameters(module).values():
            if p.dtype != torch.float32:  # peft gives LoRA the base dtype (bf16, even fp8): train fp32 masters
                p.data = p.data.float()
            p.requires_grad_(True)
        keep_inputs_in_compute_dtype(module)
    except BaseException:
        remove_lora(module)
        raise
    return names


class _OutsideAutocast:
    """A truth value for peft's per-layer `cast_input_dtype_enabled` (read on every forward): true only while no
    autocast is active. peft's LoRA forward casts its input to the LoRA weights' dtype, fp32 here; under autocast
    that is a full fp32 copy of the layer's input (about 1.5 GB at one Flux single block's linear2 at 2048 px), and
    autocast casts it straight back to run the matmul. Under autocast the input stays in the compute dtype and
    autocast casts the fp32 master weights per op, so the LoRA matmuls run in the compute dtype and the gradients
    still land on the fp32 masters; outside autocast (fp32 compute, or a bf16 ComfyUI model run without it) peft
    casts as before, so F.linear never sees mixed dtypes. (peft's `autocast_adapter_dtype` option only decides
    whether the adapter weights are upcast to fp32 at injection: it never changes the input cast.)"""

    def __bool__(self) -> bool:
        return not (torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"))


def keep_inputs_in_compute_dtype(module: nn.Module) -> None:
    """Make every peft LoRA layer in `module` skip its fp32 input cast while autocast runs (see _OutsideAutocast).
    The flag lives on the LoRA layers, so remove_lora takes it away with them."""
    for layer in lora_layers(module).values():
        layer.cast_input_dtype_enabled = _OutsideAutocast()


def remove_lora(module: nn.Module) -> None:
    """Replace every peft LoRA layer by its base layer and restore the requires_grad flags from before injection."""
    for name, layer in lora_layers(module).items():
        parent_name, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, child, layer.get_base_layer())
    if isinstance(module.__dict__.get("peft_config"), dict):
        del module.peft_config  # set by peft's tuner on injection
    flags = _FLAGS_BEFORE.pop(module, None)
    if flags is not None:
        for n, p in module.named_parameters():
            p.requires_grad_(flags.get(n, p.requires_grad))


@torch.no_grad()
def merge_and_remove_lora(module: nn.Module, strength: float = 1.0) -> int:
    """Add strength * scale * B @ A into each base weight (the math of ComfyUI's LoraLoader; DoRA, LoHa, LoKr: see
    algorithms.merged_weight), then remove the LoRA. Returns the number of merged layers."""
    layers = lora_layers(module)
    for layer in layers.values():
        weight = layer.get_base_layer().weight
        if layer_algorithm(layer) != "lora":
            weight.copy_(merged_weight(layer, strength))
            continue
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        diff = b.to(weight.device, torch.float32) @ a.to(weight.device, torch.float32)
        weight += ((strength * layer.scaling[ADAPTER]) * diff).to(weight.dtype)
    remove_lora(module)
    return len(layers)


# ------------------------------------------------------------------------------------------------ LoRA state
def lora_layers(module: nn.Module) -> dict[str, nn.Module]:
    """peft LoRA (DoRA, LoHa, LoKr) layers by module name (the name of the layer they replaced), in model order."""
    return {n: m for n, m in module.named_modules() if isinstance(m, PEFT_LAYERS)}


def lora_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """The trainable LoRA weights, by parameter name ('<layer>.lora_A.default.weight', '<layer>.hada_w1_a.default',
    ...), in a fixed order (the optimizer state is matched to parameters by order)."""
    return {f"{name}.{n}": p for name, layer in lora_layers(module).items()
            for n, p in adapter_parameters(layer).items()}


def lora_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of the LoRA weights (to fork or continue a session)."""
    return {k: p.detach().to("cpu", copy=True) for k, p in lora_parameters(module).items()}


@torch.no_grad()
def load_lora_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a `lora_state` into the injected LoRA (in place: parameters keep their identity, device and dtype)."""
    params = lora_parameters(module)
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    wrong = [f"{k}: saved {tuple(state[k].shape)} vs model {tuple(p.shape)}"
             for k, p in params.items() if k in state and state[k].shape != p.shape]
    if missing or unexpected or wrong:
        raise LoraError(f"the LoRA state does not fit this model's LoRA: missing {len(missing)} {missing[:3]}, "
                        f"unexpected {len(unexpected)} {unexpected[:3]}, wrong shape {len(wrong)} {wrong[:3]}: the "
                        "LoRA settings (rank, targets) or the model changed since it was saved; use the same ones")
    for k, p in params.items():
        p.copy_(state[k])
