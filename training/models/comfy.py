"""ComfyUI's MODEL (a ModelPatcher) as a ModelAdapter: the only training module that imports ComfyUI's model code.

training_module(): ComfyUI's model management lets go of every model (so this one holds its base weights, unpatched,
on its offload device, and the GPU is free for the memory runtime), then the trainer gets a copy of the diffusion
model: new module objects whose parameters are new tensors sharing the base weights' storage. ComfyUI loads weights
as inference tensors, which autograd cannot save for backward; an alias made outside inference mode is an ordinary
tensor and costs no memory. Weights the MODEL patches (a LoRA applied before training) are computed into the copy with
ComfyUI's own patch math. A GGUF model (ComfyUI-GGUF) is copied the same way: its quantized weights keep their class
(memory/tensor_kinds.py) and their layers dequantize them, patches included, in forward. Under ComfyUI's dynamic
VRAM the base weights are a read-only mapping of the model file, shared the same way (comfy_dynamic_vram.py: no
reload, no copy). `comfy.model_management.in_training` is True only inside the context (it selects ComfyUI's
autograd-safe code paths). LoRA goes into the copy, so the user's MODEL is never changed.

predict(): ComfyUI's own `_apply_model` (latent scaling, timestep scaling, dtype casts, the family's forward) on a
shallow copy of the model object whose diffusion_model is the training copy and whose model sampling returns the raw
output, i.e. the flow-matching velocity (noise - x0); conditioning is built by the model's `extra_conds` as ComfyUI's
samplers build it (guidance for Flux-dev, num_tokens for Lumina 2, ...). Only flow models (CONST sampling) train.

Base weights may be fp8 (UNETLoader weight_dtype fp8_*): ComfyUI picks manual-cast ops for them, which upcast each
layer's weight to the activation dtype in its forward; the LoRA stays fp32 (see lora.inject_lora). A "scaled fp8" /
fp8-mixed file loads into ComfyUI's mixed-precision layers (no torch Linear, QuantizedTensor weights): they are marked
as LoRA targets (lora/quantized_linear.py) and their weights unwrapped into plain parameters (comfy_quant.py); other
quantized formats are refused.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import os
from typing import Iterator

import torch
from torch import nn

import comfy.model_management as mm
import comfy.model_sampling
import comfy.ops
import comfy.sd
import comfy.utils

from ...memory.blocks import MUTATES_INPUTS, discover_blocks
from ...memory.norms import layer_norm, upcasts
from ..lora.targets import LoraError, mark_quantized_linear
from .adapter import ordinary_alias
from .comfy_quant import unwrap_quantized_weights
from .comfy_dynamic_vram import cast_to_model_dtypes, drop_dynamic_vram_state, share_dynamic_vram_state
from .comfy_flux_chunks import register_comfy_flux_chunks
from ..timesteps import shift_of_schedule
from ..train_config import ConfigError

PREFIX = "diffusion_model."
# family -> (where the text context enters, where the pooled text embedding enters); "" = the model has none
_CONDITIONING_INPUTS = {"flux": ("txt_in", "vector_in"), "sd3": ("context_embedder", "y_embedder"),
                        "lumina2": ("cap_embedder", "clip_text_pooled_proj"), "wan": ("text_embedding", ""),
                        "qwen_image": ("txt_in", "")}

_VIDEO_FAMILIES = ("wan",)  # families whose latents' time axis is a video's frames (not Qwen-Image)


def _family_of(diffusion_model: nn.Module) -> str | None:
    from comfy.ldm.flux.model import Flux
    from comfy.ldm.lumina.model import NextDiT
    from comfy.ldm.modules.diffusionmodules.mmdit import MMDiT
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel
    from comfy.ldm.wan.model import WanModel
    for cls, family in ((Flux, "flux"), (MMDiT, "sd3"), (NextDiT, "lumina2"), (WanModel, "wan"),
                        (QwenImageTransformer2DModel, "qwen_image")):
        if isinstance(diffusion_model, cls):
            return family
    return None


def _check_flow(name: str, sampling) -> None:
    """Only rectified-flow models (ComfyUI's CONST: x_t = (1-s) x0 + s noise, output = noise - x0) train here."""
    cls, const = type(sampling), comfy.model_sampling.CONST
    if cls.calculate_denoised is const.calculate_denoised and cls.calculate_input is const.calculate_input:
        return
    kind = next(c.__name__ for c in cls.__mro__ if "calculate_denoised" in c.__dict__)
    kind = {"EPS": "an eps-prediction", "V_PREDICTION": "a v-prediction"}.get(kind, f"a {kind} (not flow-matching)")
    raise ConfigError(f"{name} is {kind} model, which Tightrope does not support: it trains flow-matching models "
                      "(Flux, SD3.5, Lumina 2, Wan, Qwen-Image); load one of those")


def _guard_in_place_residuals(module: nn.Module) -> None:
    """ComfyUI's blocks add residuals in place (Flux: `img += ...` after `img_norm1(img)`), which autograd forbids
    when an earlier op saved that tensor for backward: the norm layers' inputs. While grads are on, each norm inside a
    block normalises (and so saves) a copy of its input; the in-place add then changes a tensor nothing saved. A
    LayerNorm without affine weights (ComfyUI's or torch's own forward) saves that bf16 copy under CUDA autocast, not
    the fp32 cast autocast would make of it (memory/norms.py: half the bytes through the block's backward)."""
    import comfy.ops

    plain_forwards = {nn.LayerNorm.forward, getattr(comfy.ops.disable_weight_init.LayerNorm, "forward", None)}
    every_op = getattr(comfy.ops, "run_every_op", lambda: None)  # ComfyUI's interrupt check, as its forward makes

    def guarded(m, forward):
        plain = isinstance(m, nn.LayerNorm) and type(m).forward in plain_forwards and m.weight is None \
            and m.bias is None

        def norm_forward(x, *args, **kwargs):
            if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
                x = x.clone()
                if plain and not args and not kwargs and upcasts(x):
                    every_op()
                    return layer_norm(x, m.normalized_shape, m.eps)
            return forward(x, *args, **kwargs)
        return norm_forward

    for block in discover_blocks(module):
        setattr(block.module, MUTATES_INPUTS, True)  # compiled blocks work on copies (memory/mutating_blocks.py)
        for m in block.module.modules():
            if isinstance(m, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or type(m).__name__.endswith("Norm"):
                m.forward = guarded(m, m.forward)


TRAINABLE_QUANT = ("float8_e4m3fn", "float8_e5m2")  # ComfyUI's fp8 formats with a per-tensor scale


def _quantized_layers(diffusion_model: nn.Module) -> dict[str, str]:
    """ComfyUI's mixed-precision layers (a "scaled fp8" file: a `scaled_fp8` key and per-layer `.scale_weight`, or
    quantization metadata: `.comfy_quant`/`.weight_scale`), by name -> their weight format."""
    out = {}
    for name, m in diffusion_model.named_modules():
        quant = getattr(m, "quant_format", None)
        if quant is not None or type(getattr(m, "weight", None)).__name__ == "QuantizedTensor":
            out[name] = quant or "quantized"
    return out


def _refuse_quantized_layers(diffusion_model: nn.Module, source: str) -> None:
    """Quantized layers train a LoRA (quantized_linear.py) when their weights are fp8 with a per-tensor scale (a
    'scaled fp8' or 'fp8 mixed' file); other formats (NVFP4, MXFP8, INT8, W4A4/W4A8) are refused here, naming the
    file, the format and what to load instead."""
    for name, quant in _quantized_layers(diffusion_model).items():
        if quant in TRAINABLE_QUANT:
            continue
        raise ConfigError(f"{source}: its weights are stored quantized as {quant} (e.g. layer {name!r}), which "
                          f"Tightrope cannot train a LoRA on (it trains on {' and '.join(TRAINABLE_QUANT)} 'scaled "
                          "fp8' / 'fp8 mixed' files): load the fp8 scaled or bf16/fp16 file of this model instead "
                          "(with weight_dtype fp8_e4m3fn in Load Diffusion Model to hold it in 8 bits), or a GGUF "
                          "file through ComfyUI-GGUF")


def _mixed_precision_linear(m: nn.Module) -> bool:
    """A Linear of ComfyUI's mixed-precision ops (comfy.ops.mixed_precision_ops: a torch Module, not nn.Linear),
    quantized or not (a quantized file may keep some layers in bf16)."""
    return isinstance(m, comfy.ops.CastWeightBiasOp) and not isinstance(m, nn.Linear) and \
        type(m).__name__ == "Linear" and hasattr(m, "in_features")


def _mark_quantized_layers(module: nn.Module) -> None:
    """Mark the training copy's mixed-precision Linear layers as LoRA targets (quantized_linear.py: their own forward
    computes the base output), by their weight format."""
    for m in module.modules():
        if _mixed_precision_linear(m):
            mark_quantized_linear(m, getattr(m, "quant_format", None) or f"unquantized {m.weight.dtype}")


def _first_linear_in_features(module: nn.Module, path: str) -> int:
    if not path:
        return 0
    try:
        sub = module.get_submodule(path)
    except AttributeError:
        return 0
    return next((m.in_features for m in sub.modules() if isinstance(m, nn.Linear) or _mixed_precision_linear(m)), 0)


class ComfyModelAdapter:
    """A ComfyUI MODEL (ModelPatcher) for the trainer; see the module docstring."""

    def __init__(self, model_patcher):
        self.patcher = model_patcher
        base = model_patcher.model
        dm = model_patcher.get_model_object("diffusion_model")
        name = f"ComfyUI model {type(base).__name__} ({type(dm).__module__}.{type(dm).__name__})"
        _check_flow(name, model_patcher.get_model_object("model_sampling"))
        family = _family_of(dm)
        if family is None:
            raise ConfigError(f"{name} is not a model family Tightrope trains (Flux, SD3.5, Lumina 2, Wan, "
                              "Qwen-Image): load one of those with Load Diffusion Model")
        self.family = family
        if family == "flux":  # the memory runtime's token chunks find its blocks' chunked forwards
            register_comfy_flux_chunks()
        init = getattr(model_patcher, "cached_patcher_init", None)  # (loader, (path, options)) from ComfyUI loaders
        path = init[1][0] if init and len(init) > 1 and init[1] and isinstance(init[1][0], str) else None
        self.base_name = os.path.basename(path) if path else f"comfyui-{type(base.model_config).__name__}"
        _refuse_quantized_layers(dm, path or name)
        context, pooled = _CONDITIONING_INPUTS[family]
        self._dims = (_first_linear_in_features(dm, context), _first_linear_in_features(dm, pooled))

    # -- conditioning ---------------------------------------------------------------------------------------------
    def conditioning_dims(self) -> tuple[int, int]:
        """(width of the text context, width of the pooled text embedding; 0 if the model takes none)."""
        return self._dims

    def latent_channels(self) -> int | None:
        """The channels of the VAE latents this model takes (its latent format's: 16 for Flux, SD3, Wan 2.1)."""
        channels = getattr(self.patcher.get_model_object("latent_format"), "latent_channels", None)
        return channels if isinstance(channels, int) else None

    # -- training -------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def training_module(self) -> Iterator[nn.Module]:
        patcher = self.patcher
        mm.unload_all_models()  # base weights back, unpatched, on the offload device; the GPU is ours
        if patcher.backup or patcher.model.model_lowvram:
            raise RuntimeError("ComfyUI still holds this model patched after unloading it; run the workflow again "
                               "(or restart ComfyUI) and report this as a Tightrope bug")
        with torch.inference_mode(False):
            module = self._trainable_copy(patcher)
        previous = mm.in_training
        mm.in_training = True
        try:
            yield module
        finally:
            mm.in_training = previous

    @staticmethod
    def _trainable_copy(patcher) -> nn.Module:
        source = patcher.get_model_object("diffusion_model")
        dynamic = patcher.is_dynamic()
        memo = {id(patcher.model): patcher.model}
        for t in itertools.chain(source.parameters(), source.buffers()):
            memo.setdefault(id(t), ordinary_alias(t))
        if dynamic:
            share_dynamic_vram_state(source, memo)
        module = copy.deepcopy(source, memo)
        if dynamic:
            drop_dynamic_vram_state(module)
        module.requires_grad_(False)
        _guard_in_place_residuals(module)
        for key in patcher.patches:  # a LoRA already on the MODEL: train on the weights ComfyUI would sample with
            if not key.startswith(PREFIX):
                continue
            target = comfy.utils.get_attr(module, key[len(PREFIX):])
            if isinstance(getattr(target, "patches", None), list):  # a GGUF weight: its layer applies the patches
                target.patches = [(patcher.patches[key], key)]       # when it dequantizes (as ComfyUI-GGUF's patcher)
                continue
            weight = patcher.patch_weight_to_device(key, device_to=None, return_weight=True)
            comfy.utils.set_attr_param(module, key[len(PREFIX):], weight)
        if dynamic:
            cast_to_model_dtypes(module)
        _mark_quantized_layers(module)  # after the patches: a patched quantized weight is ComfyUI's requantized one
        unwrap_quantized_weights(module)
        return module

    def sampling_shift(self) -> float:
        """The shift ComfyUI samples this MODEL with: its model_sampling, after any ModelSampling* node (Flux,
        SD3, AuraFlow) patched it: the shift training uses for timestep_shift 0."""
        sampling = self.patcher.get_model_object("model_sampling")
        try:
            return shift_of_schedule(lambda t: sampling.percent_to_sigma(1.0 - t),
                                     f"this model's sampling ({type(sampling).__name__})")
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def process_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents (the dataset's, or a LATENT's) -> the model's latent space, as ComfyUI's samplers do:
        video-shaped latents get their time axis, then the latent format's scale and shift."""
        fmt = self.patcher.get_model_object("latent_format")
        if getattr(fmt, "latent_dimensions", 2) == 3 and latents.ndim == 4:
            latents = latents.unsqueeze(2)
        elif latents.ndim == 5 and not self.takes_video():  # input_checks refuses this before the run
            raise ConfigError(f"this {self.family} model takes image latents, not video latents of shape "
                              f"{tuple(latents.shape)}: train it on images, or load a video model (Wan)")
        return fmt.process_in(latents)

    def takes_video(self) -> bool:
        """Whether video clips can train the model: a video model (Wan) with a time axis in its latents. Qwen-Image's
        latents are 3-D too (Wan's VAE and latent format), but it is an image model: its time axis holds one image."""
        return self.family in _VIDEO_FAMILIES \
            and getattr(self.patcher.get_model_object("latent_format"), "latent_dimensions", 2) == 3

    def predict(self, module, x_t, t, context, pooled, guidance, to_device=None):
        base = self.patcher.model
        b = x_t.shape[0]  # the datasets' widths were checked before the run (input_checks.check_dataset_fits_model)
        params = {"cross_attn": context, "device": x_t.device, "noise": x_t, "width": x_t.shape[-1] * 8,
                  "height": x_t.shape[-2] * 8, "prompt_type": "positive", "guidance": float(guidance)}
        if pooled.shape[-1] > 0:
            params["pooled_output"] = pooled
        conds = {k: v.process_cond(batch_size=b, area=None).concat([]) for k, v in base.extra_conds(**params).items()}
        names = [k for k, v in conds.items() if torch.is_tensor(v) and v.device != x_t.device]  # guidance, sizes
        if to_device is None:
            conds.update({k: conds[k].to(x_t.device) for k in names})
        else:
            conds.update(zip(names, to_device(*(conds[k] for k in names))))
        if "c_concat" in conds:  # ComfyUI filled the model's image/mask input channels with its no-image default
            raise ConfigError(f"this {self.family} model takes an image input besides the noise (c_concat: "
                              "image-to-video, inpaint/fill or control channels), which training would feed as "
                              "zeros while sampling feeds your image: Tightrope trains text-to-image/video "
                              "models only; load the text-to-image/video model")
        options = {**self.patcher.model_options.get("transformer_options", {}), "cond_or_uncond": [0],
                   "sigmas": t}
        return self._shell(module)._apply_model(x_t, t, transformer_options=options, **conds)

    def _shell(self, module: nn.Module):
        """A shallow copy of ComfyUI's model object running `module`; its model sampling returns the raw output."""
        cached = getattr(self, "_cached_shell", None)
        if cached is not None and cached[0] is module:
            return cached[1]
        base = self.patcher.model
        sampling = copy.copy(self.patcher.get_model_object("model_sampling"))
        sampling.__dict__["calculate_denoised"] = lambda sigma, model_output, model_input: model_output
        shell = copy.copy(base)
        shell.__dict__["_modules"] = {**base._modules, "diffusion_model": module, "model_sampling": sampling}
        shell.__dict__["current_patcher"] = None  # not a ComfyUI-managed model: no dynamic-VRAM prefetch
        self._cached_shell = (module, shell)
        return shell

    # -- output ---------------------------------------------------------------------------------------------------
    def with_lora_state(self, spec, state: dict[str, torch.Tensor], strength: float = 1.0):
        """A clone of the MODEL with the LoRA patched in by ComfyUI's own LoRA loading (LoraLoaderModelOnly's
        code path), so it samples exactly as the saved file through the core loader does."""
        from ..lora.dora_scale import base_weight_of
        from ..lora.files import lora_file_tensors
        if strength == 0:
            return self.patcher
        if spec.algorithm == "dora":  # its dora_scale in ComfyUI's convention needs the unpatched base weights
            with self.training_module() as module:
                tensors = lora_file_tensors(state, spec, base_weight=base_weight_of(module))
        else:
            tensors = lora_file_tensors(state, spec)
        patched, _ = comfy.sd.load_lora_for_models(self.patcher, None, tensors, strength, 0.0)
        expected = {k[: -len(".alpha")] + ".weight" for k in tensors if k.endswith(".alpha")}  # one per layer
        missing = sorted(expected - set(patched.patches))
        if missing:
            raise LoraError(f"ComfyUI did not apply {len(missing)} of {len(expected)} LoRA layers (e.g. "
                            f"{', '.join(missing[:3])}): the LoRA does not fit this model; report this as a bug")
        return patched
