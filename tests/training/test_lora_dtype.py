"""Under autocast the LoRA's input stays in the compute dtype (no fp32 copy of every LoRA layer's input), and the
gradients still match an fp32 reference within bf16 rounding."""
import pytest
import torch
import torch.nn.functional as F

from tightrope.bench.models import build_bench_model
from tightrope.training.lora.layers import LoraSpec, inject_lora, lora_layers, lora_parameters, remove_lora
from tightrope.training.models.reference_flux import Flux, FluxParams


def _lora_input_dtypes(model, run):
    seen = []
    handles = [layer.lora_A["default"].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
               for layer in lora_layers(model).values()]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    assert seen, "no LoRA layer ran"
    return set(seen)


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
def test_lora_input_is_not_upcast_under_autocast(base_dtype):
    torch.manual_seed(0)
    flux = Flux(FluxParams.tiny()).to(base_dtype)
    inject_lora(flux, LoraSpec(rank=4, targets="attention_mlp"), "flux")
    assert all(p.dtype == torch.float32 for p in lora_parameters(flux).values())  # fp32 masters, as before
    layer = next(iter(lora_layers(flux).values()))
    x = torch.randn(2, 5, layer.in_features, dtype=torch.bfloat16)  # as a bf16 matmul/activation before it makes

    def under_autocast():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x)

    assert _lora_input_dtypes(flux, under_autocast) == {torch.bfloat16}
    if base_dtype == torch.bfloat16:  # a bf16 model run without autocast (ComfyUI's own casting): peft still casts
        assert _lora_input_dtypes(flux, lambda: layer(x)) == {torch.float32}  # so F.linear never mixes dtypes
    remove_lora(flux)
    assert not hasattr(flux.double_blocks[0].img_attn.qkv, "cast_input_dtype_enabled")


def _grads(bench, inputs, target, autocast: bool, peft_cast: bool):
    for layer in lora_layers(bench.model).values():
        if peft_cast:
            layer.cast_input_dtype_enabled = True  # peft's own behaviour: every LoRA input cast to fp32
    params = lora_parameters(bench.model)
    for p in params.values():
        p.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = F.mse_loss(bench.model(**inputs).float(), target)
    loss.backward()
    return {k: p.grad.clone() for k, p in params.items()}


def test_bf16_lora_gradients_match_the_fp32_reference():
    """Tolerance: bf16 keeps 8 significant bits (unit roundoff 2^-9 = 0.2 %). Under autocast every matmul input is
    rounded once, so each layer's output carries ~0.2-0.4 % relative error, and through the tiny model's 4 blocks
    forward and back the LoRA gradients a few percent at most; 5 % (norm-wise, per tensor) is that bound, while a
    wrong gradient path (a missing cast's grad, a doubled scale) is off by O(100 %). peft's own fp32-input path is
    held to the same bound, so the compute-dtype LoRA is no worse than what it replaces."""
    bench = build_bench_model("tiny", lora_rank=4, init_device="cpu")
    for name, p in lora_parameters(bench.model).items():
        if "lora_B" in name:  # non-zero B, so the A gradients are not all zero
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(name)))
    inputs, target = bench.make_inputs(1, 64)
    reference = _grads(bench, inputs, target, autocast=False, peft_cast=False)
    ours = _grads(bench, inputs, target, autocast=True, peft_cast=False)
    peft_fp32 = _grads(bench, inputs, target, autocast=True, peft_cast=True)
    for grads in (ours, peft_fp32):
        for k, ref in reference.items():
            err = (grads[k].float() - ref).norm() / ref.norm()
            assert err < 0.05, f"{k}: relative gradient error {err:.3%}"
