"""LoRA files: saving in the format ComfyUI's LoraLoader applies, reading LoRA files back (ours, peft's, kohya's),
continuing from one, and merging one into a plain model (a small LoraLoader for headless previews).

Saved keys, per LoRA layer <m> (its module name from the transformer's root, e.g. double_blocks.0.img_attn.qkv):
    diffusion_model.<m>.lora_A.weight   (rank, in)
    diffusion_model.<m>.lora_B.weight   (out, rank)
    diffusion_model.<m>.alpha           0-d fp32; ComfyUI scales B @ A by alpha / rank
With rsLoRA the file's alpha is alpha * sqrt(rank), so ComfyUI's alpha / rank equals peft's alpha / sqrt(rank): any
LoRA loader that follows the alpha convention applies the trained update exactly, no rsLoRA support needed.

Weights are saved as fp32 by default: the file then holds exactly what was trained (continuing from it is lossless)
and ComfyUI casts to the model's dtype when it patches anyway. dtype='bf16' halves the file for sharing.
DoRA, LoHa and LoKr files (LoraSpec.algorithm) have their own keys: see lycoris.py.
"""
from __future__ import annotations

import json
import math
import os
import re
import warnings
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from torch import Tensor, nn

from ..finite_check import check_finite
from ..state.atomic_write import atomic_save_file, next_free_path
from .algorithms import layer_algorithm
from .layers import ADAPTER, LoraSpec, inject_lora, lora_layers, lora_state, remove_lora
from .dora_scale import DORA_FOR, META_KEY, BaseWeight, base_weight_of, check_dora_for
from .lycoris import check_file_algorithm, file_tensors, load_into
from .targets import LoraError, is_linear

PREFIX = "diffusion_model."  # ComfyUI maps "diffusion_model.<m>" to the weight "diffusion_model.<m>.weight"
LORA_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# key suffix -> part; A is the down projection (rank, in), B the up projection (out, rank)
LORA_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_A.default.weight": "A",
             ".lora_B.default.weight": "B", ".lora_down.weight": "A", ".lora_up.weight": "B", ".alpha": "alpha"}
_STRIPPED_PREFIXES = (PREFIX, "base_model.model.")  # ours; peft's PeftModel
KOHYA_PREFIX = "lora_unet_"
# text-encoder layers in kohya / diffusers / ai-toolkit files (lora_te_, lora_te1_, lora_te2_, lora_te3_, ...)
TEXT_ENCODER_KEY = re.compile(r"^(lora_te\d*_|text_encoders?(_\d+)?\.|te\d?\.)")


class LoraWeights(NamedTuple):
    A: Tensor                # (rank, in)
    B: Tensor                # (out, rank)
    alpha: float | None      # None: no alpha in the file -> scale 1 (ComfyUI's rule)

    @property
    def scale(self) -> float:
        return 1.0 if self.alpha is None else self.alpha / self.A.shape[0]


# ------------------------------------------------------------------------------------------------------- save
def file_alpha(spec: LoraSpec) -> float:
    """The alpha to write so that alpha / rank (ComfyUI's scale) equals the trained scale."""
    return spec.alpha * math.sqrt(spec.rank) if spec.rslora else spec.alpha


def lora_file_tensors(state: dict[str, Tensor], spec: LoraSpec, dtype: str = "fp32", *, dora_for: str = "comfyui",
                      base_weight: BaseWeight | None = None) -> dict[str, Tensor]:
    """A `lora_state` (peft parameter names) -> the tensors of a ComfyUI LoRA file. DoRA: `dora_for` and
    `base_weight` (layer name -> base weight) give its dora_scale (dora_scale.py)."""
    if dtype not in LORA_DTYPES:
        raise LoraError(f"LoRA file dtype={dtype!r} is not supported: choose one of {', '.join(LORA_DTYPES)}")
    if spec.algorithm != "lora":
        return file_tensors(state, spec.algorithm, spec.scale, file_alpha(spec), LORA_DTYPES[dtype],
                            dora_for=dora_for, base_weight=base_weight)
    alpha = torch.tensor(file_alpha(spec), dtype=torch.float32)
    out = {}
    for key, t in state.items():
        m = re.fullmatch(rf"(.+)\.lora_([AB])\.{ADAPTER}\.weight", key)
        if not m:
            raise LoraError(f"LoRA state key {key!r} is not a peft LoRA weight: pass lora_state(module)")
        out[f"{PREFIX}{m.group(1)}.lora_{m.group(2)}.weight"] = t.detach().to("cpu", LORA_DTYPES[dtype])
        out[f"{PREFIX}{m.group(1)}.alpha"] = alpha.clone()
    return out


def save_lora(folder: str | os.PathLike, filename_prefix: str, module: nn.Module, spec: LoraSpec, *,
              metadata: dict[str, str], dtype: str = "fp32", dora_for: str = "comfyui") -> Path:
    """Write the LoRA injected in `module` (see save_lora_state); a DoRA's base weights are read from `module`."""
    state = lora_state(module)
    if not state:
        raise LoraError(f"{type(module).__name__} has no LoRA layers to save: inject_lora(module, ...) first")
    return save_lora_state(folder, filename_prefix, state, spec, metadata=metadata, dtype=dtype, dora_for=dora_for,
                           base_weight=base_weight_of(module))


def save_lora_state(folder: str | os.PathLike, filename_prefix: str, state: dict[str, Tensor], spec: LoraSpec, *,
                    metadata: dict[str, str], dtype: str = "fp32", dora_for: str = "comfyui",
                    base_weight: BaseWeight | None = None, at_least: int = 1) -> Path:
    """Write a `lora_state` to `folder`/`filename_prefix`_NNNNN_.safetensors (atomically, never overwriting; NNNNN
    the next free counter, at least `at_least`).

    `metadata`: the run's facts as strings (trainer.run_metadata gives tightrope.base_model, .family, .steps,
    .strategy, .training: the TrainConfig as trained); the LoRA settings, the tightrope version and kohya's
    ss_network_dim/alpha are added here. A LoRA holding NaN or inf is never written (NonFiniteDataError). DoRA: `dora_for` picks the dora_scale convention
    (recorded as tightrope.dora_scale); 'comfyui' needs `base_weight`, layer name -> base weight (dora_scale.py)."""
    check_dora_for(dora_for)
    check_finite(state, f"the LoRA to save as {filename_prefix!r}", "it was not saved; the training diverged: lower "
                 "learning_rate and train again from the last saved LoRA")
    tensors = lora_file_tensors(state, spec, dtype, dora_for=dora_for, base_weight=base_weight)
    meta = {**metadata, **lora_settings_metadata(spec, dtype)}
    if spec.algorithm == "dora":
        meta[META_KEY] = DORA_FOR[dora_for]
        check_finite(tensors, f"the DoRA file {filename_prefix!r}", "it was not saved: its dora_scale was computed "
                     "from base weights that were not readable (NaN); report this as a Tightrope bug, or save with "
                     "dora_for='standard'")
    for _ in range(100):  # another writer may take the same counter between choosing it and writing
        try:
            return atomic_save_file(tensors, next_free_path(folder, filename_prefix, at_least=at_least), meta,
                                    overwrite=False)
        except FileExistsError:
            continue
    raise LoraError(f"could not find a free file name for filename_prefix={filename_prefix!r} in {folder}: "
                    "choose another filename_prefix")


def lora_settings_metadata(spec: LoraSpec, dtype: str = "fp32") -> dict[str, str]:
    return {"tightrope.version": tightrope_version(), "tightrope.lora": json.dumps(spec.to_dict()),
            "tightrope.rank": str(spec.rank), "tightrope.alpha": repr(spec.alpha),
            "tightrope.rslora": str(spec.rslora).lower(), "tightrope.targets": spec.target_regex or spec.targets,
            "tightrope.lora_dtype": dtype, "tightrope.algorithm": spec.algorithm,
            "ss_network_dim": str(spec.rank), "ss_network_alpha": repr(file_alpha(spec))}


def tightrope_version() -> str:
    try:
        return importlib_metadata.version("tightrope")
    except importlib_metadata.PackageNotFoundError:  # a plain checkout in ComfyUI's custom_nodes
        toml = Path(__file__).resolve().parents[2] / "pyproject.toml"  # the checkout's root
        m = re.search(r'^version\s*=\s*"([^"]+)"', toml.read_text(encoding="utf-8"), re.M) if toml.is_file() else None
        return m.group(1) if m else "unknown"


# ------------------------------------------------------------------------------------------------------- read
def read_lora_file(path: str | os.PathLike) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(tensors on the CPU, metadata) of a .safetensors LoRA. Never unpickles anything."""
    path = Path(path)
    if path.suffix.lower() != ".safetensors":
        raise LoraError(f"LoRA file {str(path)!r} is not a .safetensors file: Tightrope only reads safetensors "
                        "(never pickled .ckpt/.pt/.bin); convert it or pick the .safetensors version")
    if not path.is_file():
        raise FileNotFoundError(f"LoRA file {str(path)!r} does not exist: check the path (a name in the loras "
                                "folder includes its subfolder, e.g. 'tightrope/my_lora_00001_.safetensors')")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except Exception as e:  # safetensors raises several types for a damaged header or a truncated file
        raise LoraError(f"LoRA file {str(path)!r} could not be read as safetensors ({e}): it is damaged or "
                        "incomplete; save or download it again") from e
    check_finite(tensors, f"LoRA file {str(path)!r}", "it is damaged or comes from a run that diverged; pick an "
                 "earlier LoRA file of that run, or leave existing_lora empty to start a new LoRA")
    return tensors, meta


def lora_modules_in_file(tensors: dict[str, Tensor], module_names=None) -> dict[str, LoraWeights]:
    """Group a LoRA file's keys by the module they patch. Accepts 'diffusion_model.<m>.lora_A/B.weight' (+ .alpha),
    peft's bare '<m>.lora_A.weight' and kohya's 'lora_unet_<m with _>.lora_down/up.weight'. Kohya names are mapped
    back through `module_names` (the model's module names); one that maps to none keeps its kohya name."""
    kohya = {n.replace(".", "_"): n for n in (module_names or ())}
    parts: dict[str, dict[str, Tensor]] = {}
    unknown = []
    for key, t in tensors.items():
        suffix = next((s for s in LORA_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            unknown.append(key)
            continue
        name = key[: -len(suffix)]
        if name.startswith(KOHYA_PREFIX):
            name = kohya.get(name[len(KOHYA_PREFIX):], name)
        else:
            name = next((name[len(p):] for p in _STRIPPED_PREFIXES if name.startswith(p)), name)
        if LORA_SUFFIXES[suffix] in parts.setdefault(name, {}):
            raise LoraError(f"the LoRA file has two {LORA_SUFFIXES[suffix]} weights for {name!r} (e.g. {key!r}): it "
                            "mixes key formats; save it again from one trainer")
        parts[name][LORA_SUFFIXES[suffix]] = t
    if unknown:
        raise LoraError(f"the LoRA file has {len(unknown)} keys that are not plain LoRA weights (e.g. "
                        f"{', '.join(unknown[:3])}): a LoRA (algorithm 'lora') file holds lora_A/lora_B (+alpha) "
                        "only; this one holds other weights too (a model's, full weight diffs, or another "
                        "algorithm's mixed in): pick a LoRA file saved by one trainer")
    out = {}
    for name, p in parts.items():
        if "A" not in p or "B" not in p:
            raise LoraError(f"the LoRA file has {'lora_A' if 'A' in p else 'lora_B' if 'B' in p else 'alpha'} "
                            f"but not both lora_A and lora_B for {name!r}: the file is incomplete; save it again")
        a, b = p["A"], p["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"the LoRA weights for {name!r} have shapes A {tuple(a.shape)}, B {tuple(b.shape)}, "
                            "which are not a Linear LoRA (A (rank, in), B (out, rank)): the file is not a LoRA for "
                            "Linear layers")
        out[name] = LoraWeights(a, b, float(p["alpha"].item()) if "alpha" in p else None)
    return out


# ---------------------------------------------------------------------------------------------------- continue
def inject_lora_continuing(module: nn.Module, spec: LoraSpec, family: str) -> list[str]:
    """inject_lora, then the weights of `spec.existing_lora` when the LoRA Setup continues from a file. A file that
    does not fit is refused and the LoRA taken out again, so `module` is left as it came."""
    names = inject_lora(module, spec, family)
    if spec.existing_lora:
        try:
            load_lora_file_into(module, spec.existing_lora)
        except BaseException:
            remove_lora(module)
            raise
    return names


def _diffusion_model_part(tensors: dict[str, Tensor], meta: dict, path) -> tuple[dict[str, Tensor], dict]:
    """The file's diffusion-model tensors: text-encoder layers (kohya's lora_te*_) are left out with a warning, since
    Tightrope trains the diffusion model only (they were read as layers of another architecture)."""
    text = [k for k in tensors if TEXT_ENCODER_KEY.match(k)]
    if text:
        if len(text) == len(tensors):
            raise LoraError(f"{path} holds text-encoder layers only (e.g. {text[0]}): Tightrope continues LoRAs of the "
                            "diffusion model; pick a LoRA that trains it")
        warnings.warn(f"{path}: {len(text)} text-encoder tensors (e.g. {text[0]}) are left out: Tightrope trains the "
                      "diffusion model only, so the LoRA it saves holds the diffusion model's layers only", stacklevel=3)
    text = set(text)
    return {k: v for k, v in tensors.items() if k not in text}, meta


@torch.no_grad()
def load_lora_file_into(module: nn.Module, path: str | os.PathLike) -> int:
    """Load a LoRA file into the LoRA injected in `module` (to continue training from it). Every LoRA layer must
    get weights and every file entry must fit; B is rescaled if the file's scale differs from this setup's, so the
    model computes exactly the file's update. Returns the number of loaded layers."""
    layers = lora_layers(module)
    if not layers:
        raise LoraError(f"{type(module).__name__} has no LoRA layers: inject_lora(module, spec, family) first")
    linear = {n for n, m in module.named_modules() if is_linear(m)
              and ".base_layer" not in n and ".lora_" not in n} | set(layers)
    tensors, meta = _diffusion_model_part(*read_lora_file(path), path)
    if layer_algorithm(next(iter(layers.values()))) != "lora":
        return load_into(module, layers, tensors, meta, path)
    check_file_algorithm(tensors, "lora", str(path))
    entries = lora_modules_in_file(tensors, linear)
    trained_with = f" (it was trained with targets={meta['tightrope.targets']!r})" if "tightrope.targets" in meta \
        else ""
    foreign = [n for n in entries if n not in linear]
    if foreign:
        raise LoraError(f"{path}: {len(foreign)} of {len(entries)} LoRA layers in the file match no layer of this "
                        f"model (e.g. {', '.join(foreign[:3])}): this LoRA was trained for another model "
                        "architecture; pick a LoRA made for this model")
    extra = [n for n in entries if n not in layers]
    missing = [n for n in layers if n not in entries]
    if extra or missing:
        diff = ([f"has {len(extra)} layers this setup does not train (e.g. {', '.join(extra[:2])})"] if extra
                else []) + ([f"lacks {len(missing)} layers it trains (e.g. {', '.join(missing[:2])})"] if missing
                            else [])
        raise LoraError(f"{path} does not cover the same layers as this LoRA setup{trained_with}: the file "
                        f"{' and '.join(diff)}: set targets/target_regex to what the file was trained with")
    for name in layers:  # model order, so the first error names the first layer
        w = entries[name]
        a = layers[name].lora_A[ADAPTER].weight
        b = layers[name].lora_B[ADAPTER].weight
        if w.A.shape[0] != a.shape[0]:
            raise LoraError(f"{path} was trained with rank {w.A.shape[0]} but this LoRA setup has rank="
                            f"{a.shape[0]} (layer {name!r}): set rank={w.A.shape[0]} to continue from it")
        if w.A.shape[1] != a.shape[1] or w.B.shape[0] != b.shape[0]:
            raise LoraError(f"{path}: layer {name!r} is {w.A.shape[1]} -> {w.B.shape[0]} in the file but "
                            f"{a.shape[1]} -> {b.shape[0]} in this model: this LoRA was trained for another model "
                            "architecture (or size); pick a LoRA made for this model")
    for name, w in entries.items():
        layer = layers[name]
        ratio = w.scale / layer.scaling[ADAPTER]
        layer.lora_A[ADAPTER].weight.copy_(w.A)
        layer.lora_B[ADAPTER].weight.copy_(w.B if abs(ratio - 1) < 1e-6 else w.B.float() * ratio)
    return len(entries)
