"""DoRA, LoHa and LoKr files: the keys ComfyUI's weight adapters read (comfy/lora.py, comfy/weight_adapter/lora.py,
loha.py, lokr.py), reading such a file back into an injected adapter (continue training from it), and applying one
to a plain model with ComfyUI's math (tests/helpers/merge_lora.py). Plain LoRA files are files.py's own.

Keys per adapted layer, after 'diffusion_model.<module>' (peft's parameter names, as ComfyUI spells them):
    dora: .lora_A.weight (rank, in), .lora_B.weight (out, rank), .dora_scale (out, 1), .alpha
    loha: .hada_w1_a (out, rank), .hada_w1_b (rank, in), .hada_w2_a, .hada_w2_b, .alpha
          update = (w1_a @ w1_b) * (w2_a @ w2_b)
    lokr: .lokr_w1 (a, c), and .lokr_w2 (b, d) or its factors .lokr_w2_a (b, rank) / .lokr_w2_b (rank, d), .alpha
          update = kron(w1, w2), out = a*b, in = c*d (peft and ComfyUI lay the Kronecker factors out alike)
Scales: ComfyUI multiplies the update by alpha / rank, rank read from the file: lora_A's rows (dora), hada_w1_b's
(loha), the factor's _b rows (lokr). A LoKr layer with no factorised weight (rank >= half the factor sizes) gets
scale 1 in ComfyUI whatever alpha says, so the trained scale is folded into lokr_w1 there.

DoRA: dora_scale is shaped (out, 1), one per output row, so ComfyUI normalises per output row as peft does (a 1-D
vector would broadcast to (out, out) in ComfyUI's weight_decompose). Its value depends on the tool that will apply
it (dora_for): peft's magnitude ('standard'), or that magnitude times |W_i| / |W_i + update_i|, which ComfyUI as
released applies exactly ('comfyui', the default); see dora_scale.py.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from . import dora_scale
from .algorithms import ADAPTER, NAMES, adapter_parameters, layer_algorithm
from .targets import LoraError, is_linear

PREFIX = "diffusion_model."
_STRIPPED_PREFIXES = (PREFIX, "base_model.model.")  # ours; peft's PeftModel
# algorithm -> {peft parameter name inside a layer: file key suffix}
PARTS = {
    "dora": {"lora_A.default.weight": "lora_A.weight", "lora_B.default.weight": "lora_B.weight",
             "lora_magnitude_vector.default.weight": "dora_scale"},
    "loha": {f"hada_{w}.default": f"hada_{w}" for w in ("w1_a", "w1_b", "w2_a", "w2_b")},
    "lokr": {f"lokr_{w}.default": f"lokr_{w}" for w in ("w1", "w1_a", "w1_b", "w2", "w2_a", "w2_b")},
}
# the factor a scale ratio is applied to when a file's scale differs from the setup's (the update is linear in it)
_SCALED = {"dora": ("lora_B.weight",), "loha": ("hada_w1_a",), "lokr": ("lokr_w1", "lokr_w1_a")}
_MARKERS = {"dora": (".dora_scale",), "loha": (".hada_w", ".hada_t"), "lokr": (".lokr_w", ".lokr_t")}


def file_algorithm(keys: Iterable[str]) -> str:
    """The adapter algorithm of a LoRA file, from its key names: 'lora', 'dora', 'loha' or 'lokr'."""
    keys = list(keys)
    found = [a for a, marks in _MARKERS.items() if any(m in k for k in keys for m in marks)]
    if len(found) > 1:
        raise LoraError(f"the LoRA file mixes {' and '.join(NAMES[a] for a in found)} keys: Tightrope continues "
                        "from a file of one algorithm; pick a file saved by one trainer")
    return found[0] if found else "lora"


def check_file_algorithm(keys: Iterable[str], algorithm: str, what: str) -> None:
    """Refuse a file of another algorithm than `algorithm`, naming the setting that would fit it."""
    found = file_algorithm(keys)
    if found != algorithm:
        raise LoraError(f"{what} is a {NAMES[found]} file but this setup trains algorithm={algorithm!r}: set "
                        f"algorithm={found!r} to continue from it, or pick a {NAMES[algorithm]} file")


# ------------------------------------------------------------------------------------------------------- save
def file_tensors(state: dict[str, Tensor], algorithm: str, scale: float, alpha: float, dtype: torch.dtype, *,
                 dora_for: str = "comfyui", base_weight: dora_scale.BaseWeight | None = None) -> dict[str, Tensor]:
    """A `lora_state` of a DoRA / LoHa / LoKr adapter -> the tensors of its ComfyUI file. `scale`: the trained
    scale (LoraSpec.scale); `alpha`: the alpha to write (alpha / rank == scale). DoRA: `dora_for` picks the
    dora_scale convention; 'comfyui' needs `base_weight` (dora_scale.py)."""
    parts = PARTS[algorithm]
    layers: dict[str, dict[str, Tensor]] = {}
    for key, t in state.items():
        m = re.fullmatch(rf"(.+)\.({'|'.join(map(re.escape, parts))})", key)
        if not m:
            raise LoraError(f"state key {key!r} is not a peft {NAMES[algorithm]} weight: pass lora_state(module)")
        layers.setdefault(m.group(1), {})[parts[m.group(2)]] = t.detach().to("cpu", torch.float32)
    if algorithm == "dora":
        dora_scale.to_file(layers, scale, dora_for, base_weight)
    out = {}
    for name, p in layers.items():
        if algorithm == "dora":
            p["dora_scale"] = p["dora_scale"].reshape(-1, 1)
        if algorithm == "lokr" and _lokr_rank(p) is None and scale != 1.0:
            p["lokr_w1"] = p["lokr_w1"] * scale  # ComfyUI applies scale 1 here
        for suffix, t in p.items():
            out[f"{PREFIX}{name}.{suffix}"] = t.to(dtype)
        out[f"{PREFIX}{name}.alpha"] = torch.tensor(alpha, dtype=torch.float32)
    return out


# ------------------------------------------------------------------------------------------------------- read
def file_layers(tensors: dict[str, Tensor], algorithm: str) -> dict[str, dict[str, Tensor]]:
    """A file's tensors grouped by the layer they patch (prefix stripped): {module name: {suffix: tensor}}."""
    suffixes = sorted([*PARTS[algorithm].values(), "alpha"], key=len, reverse=True)
    layers: dict[str, dict[str, Tensor]] = {}
    unknown = []
    for key, t in tensors.items():
        suffix = next((s for s in suffixes if key.endswith("." + s)), None)
        if suffix is None:
            unknown.append(key)
            continue
        name = key[: -len(suffix) - 1]
        name = next((name[len(p):] for p in _STRIPPED_PREFIXES if name.startswith(p)), name)
        layers.setdefault(name, {})[suffix] = t
    if unknown:
        raise LoraError(f"the {NAMES[algorithm]} file has {len(unknown)} keys Tightrope does not read (e.g. "
                        f"{', '.join(unknown[:3])}): only Linear-layer {NAMES[algorithm]} weights and alpha are "
                        "supported (no conv/Tucker weights)")
    return layers


def _lokr_rank(p: dict[str, Tensor]) -> int | None:
    """ComfyUI's LoKr rank: the rows of w2's factor, else of w1's; None when neither is factorised."""
    b = p.get("lokr_w2_b", p.get("lokr_w1_b"))
    return None if b is None else b.shape[0]


def file_rank(p: dict[str, Tensor], algorithm: str) -> int | None:
    if algorithm == "lokr":
        return _lokr_rank(p)
    return p["lora_A.weight" if algorithm == "dora" else "hada_w1_b"].shape[0]


def file_scale(p: dict[str, Tensor], algorithm: str) -> float:
    """The scale ComfyUI applies to one layer's update: alpha / rank, 1 without alpha (or a LoKr without rank)."""
    rank = file_rank(p, algorithm)
    return 1.0 if "alpha" not in p or rank is None else float(p["alpha"].item()) / rank


@torch.no_grad()
def load_into(module: nn.Module, layers: dict[str, nn.Module], tensors: dict[str, Tensor], meta: dict[str, str],
              path) -> int:
    """Copy a DoRA / LoHa / LoKr file into the adapter injected in `module` (its `layers`, lora_layers(module)).
    Every layer must get weights of the same shapes; a factor is rescaled where the file's scale differs from the
    setup's, so the model computes exactly the file's update. Returns the number of loaded layers."""
    algorithm = layer_algorithm(next(iter(layers.values())))
    check_file_algorithm(tensors, algorithm, str(path))
    entries = file_layers(tensors, algorithm)
    linear = {n for n, m in module.named_modules() if is_linear(m)
              and ".base_layer" not in n and ".lora_" not in n} | set(layers)
    foreign = [n for n in entries if n not in linear]
    if foreign:
        raise LoraError(f"{path}: {len(foreign)} of {len(entries)} layers in the file match no layer of this model "
                        f"(e.g. {', '.join(foreign[:3])}): it was trained for another model architecture; pick a "
                        "file made for this model")
    extra, missing = [n for n in entries if n not in layers], [n for n in layers if n not in entries]
    if extra or missing:
        trained = f" (it was trained with targets={meta['tightrope.targets']!r})" if "tightrope.targets" in meta \
            else ""
        raise LoraError(f"{path} does not cover the same layers as this {NAMES[algorithm]} setup{trained}: the file "
                        f"has {len(extra)} layers it does not train and lacks {len(missing)} it trains (e.g. "
                        f"{', '.join((extra + missing)[:2])}): set targets/target_regex to what the file was "
                        "trained with")
    parts = PARTS[algorithm]
    for name, layer in layers.items():  # model order: the first error names the first layer
        ours = {parts[n]: tuple(p.shape) for n, p in adapter_parameters(layer).items()}
        theirs = {s: tuple(t.shape) for s, t in entries[name].items() if s != "alpha"}
        if "dora_scale" in theirs:
            theirs["dora_scale"] = (entries[name]["dora_scale"].numel(),)
        if ours != theirs:
            rank = meta.get("tightrope.rank") or file_rank(entries[name], algorithm)
            hint = f"set rank={rank} to continue from it" if rank is not None and str(rank) != \
                str(layer.r[ADAPTER]) else "it was trained for another model architecture (or size)"
            raise LoraError(f"{path}: layer {name!r} holds {NAMES[algorithm]} weights {theirs} but this setup "
                            f"(rank={layer.r[ADAPTER]}) has {ours}: {hint}")
    for name, layer in layers.items():
        p = entries[name]
        ratio = file_scale(p, algorithm) / layer.scaling[ADAPTER]
        if algorithm == "dora":
            p = {**p, "dora_scale": dora_scale.magnitude_from_file(
                p["dora_scale"], meta, layer.get_base_layer().weight, p["lora_A.weight"], p["lora_B.weight"],
                file_scale(p, algorithm))}
        for pname, param in adapter_parameters(layer).items():
            t = p[parts[pname]].reshape(param.shape)
            param.copy_(t.float() * ratio if parts[pname] in _SCALED[algorithm] and abs(ratio - 1) >= 1e-6 else t)
    return len(layers)


# ------------------------------------------------------------------------------------------------------- merge
def file_update(p: dict[str, Tensor], algorithm: str, device) -> Tensor:
    """One layer's scaled update (out, in) in fp32, computed as ComfyUI's weight adapters do."""
    def get(k):
        return p[k].to(device, torch.float32)
    if algorithm == "dora":
        diff = get("lora_B.weight") @ get("lora_A.weight")
    elif algorithm == "loha":
        diff = (get("hada_w1_a") @ get("hada_w1_b")) * (get("hada_w2_a") @ get("hada_w2_b"))
    else:
        w1 = get("lokr_w1") if "lokr_w1" in p else get("lokr_w1_a") @ get("lokr_w1_b")
        w2 = get("lokr_w2") if "lokr_w2" in p else get("lokr_w2_a") @ get("lokr_w2_b")
        diff = torch.kron(w1, w2)
    return file_scale(p, algorithm) * diff


@torch.no_grad()
def merge_into_weight(weight: Tensor, update: Tensor, dora_scale: Tensor | None, strength: float) -> None:
    """Apply one layer's `update` (file_update) to `weight` in place as ComfyUI 0.33 does: W + strength * update,
    or with a dora_scale W + strength * (W' - W), W' = (W + update) * dora_scale / (|W row| + eps)."""
    w = weight.float()
    if dora_scale is None:
        weight.copy_(w + strength * update)
        return
    norm = torch.linalg.norm(w, dim=1, keepdim=True) + torch.finfo(torch.float32).eps
    adapted = (w + update) * (dora_scale.to(w.device, torch.float32).reshape(-1, 1) / norm)
    weight.copy_(w + strength * (adapted - w))
