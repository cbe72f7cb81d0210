"""DoRA files in ComfyUI's convention (lora/dora_scale.py): ComfyUI 0.33 (comfy/weight_adapter/base.py,
weight_decompose) computes an output-axis DoRA as W'_i = (W_i + dW_i) * dora_scale_i / (|W_i| + eps) in fp32, peft
as (W_i + dW_i) * m_i / |W_i + dW_i|. The 'comfyui' file must make the first equal the second; the 'standard' file
holds m. Plain PyTorch, fp32, on the tiny Flux.

Tolerance: the file's dora_scale is m_i * (|W_i| + eps) / |W_i + dW_i| in fp32, and applying it divides by the same
|W_i| + eps again, so the patched row differs from peft's by a few fp32 roundings (a product, a quotient, two norms
of ~100 terms: relative ~1e-6); through the tiny Flux's forward (outputs of order 1) that stays below 1e-5, which is
the bound asserted. The 'standard' file misses by the factor |W_i + dW_i| / |W_i| - 1, about 1e-2 on these layers:
the test asserts it is over 100x the bound, so the check can fail."""
import copy
import dataclasses

import pytest
import torch
from demo_setup import demo_session
from merge_lora import merge_lora_into
from tiny_flux import flux_inputs, tiny_flux

from tightrope.memory.runtime import MemoryRuntime
from tightrope.memory.strategy import Strategy
from tightrope.training.lora.algorithms import ADAPTER
from tightrope.training.lora.files import inject_lora_continuing, read_lora_file, save_lora, save_lora_state
from tightrope.training.lora.layers import LoraError, LoraSpec, inject_lora, load_lora_state, lora_layers, \
    lora_parameters, lora_state
from tightrope.training.trainer import SaveTarget, train

TOL = dict(rtol=1e-5, atol=1e-5)  # see the module docstring
EPS = torch.finfo(torch.float32).eps


def trained(spec, seed=0):
    """The tiny Flux with a DoRA whose update is well away from zero (a fresh DoRA is a no-op)."""
    model = tiny_flux()
    torch.manual_seed(seed)
    inject_lora(model, spec, "flux")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def output(model):
    with torch.no_grad():
        return model.forward_latent(*flux_inputs())


def comfyui_033(weight, a, b, alpha, dora_scale):
    """ComfyUI 0.33's DoRA patch of one Linear weight at strength 1, written from weight_decompose: the update
    (alpha / rank) * B @ A is added to the fp32 weight, then every output row is multiplied by dora_scale_i over the
    norm of the BASE weight's row plus fp32 eps."""
    w = weight.float()
    adapted = w + (alpha / a.shape[0]) * (b.float() @ a.float())
    return adapted * (dora_scale.float().reshape(-1, 1) / (torch.linalg.vector_norm(w, dim=1, keepdim=True) + EPS))


def patched_as_comfyui(path):
    """A plain tiny Flux with the file applied by comfyui_033, layer by layer."""
    tensors, _ = read_lora_file(path)
    plain = tiny_flux()
    names = {k[len("diffusion_model."): -len(".dora_scale")] for k in tensors if k.endswith(".dora_scale")}
    with torch.no_grad():
        for name in names:
            weight = plain.get_submodule(name).weight
            key = f"diffusion_model.{name}."
            weight.copy_(comfyui_033(weight, tensors[key + "lora_A.weight"], tensors[key + "lora_B.weight"],
                                     tensors[key + "alpha"].item(), tensors[key + "dora_scale"]))
    return plain


def test_a_comfyui_file_patched_as_comfyui_033_does_gives_the_trained_output(tmp_path):
    spec = LoraSpec(rank=4, alpha=3.0, algorithm="dora")
    model = trained(spec)
    expected = output(model)
    path = save_lora(tmp_path, "c", model, spec, metadata={})
    assert read_lora_file(path)[1]["tightrope.dora_scale"] == "comfyui-base-norm"
    torch.testing.assert_close(output(patched_as_comfyui(path)), expected, **TOL)
    plain = tiny_flux()  # the tests' LoraLoader (tests/helpers/merge_lora.py) applies it alike
    merge_lora_into(plain, path)
    torch.testing.assert_close(output(plain), expected, **TOL)
    standard = save_lora(tmp_path, "s", model, spec, metadata={}, dora_for="standard")
    tensors, meta = read_lora_file(standard)
    assert meta["tightrope.dora_scale"] == "standard"
    for name, layer in lora_layers(model).items():  # the standard file holds peft's magnitude itself
        assert torch.equal(tensors[f"diffusion_model.{name}.dora_scale"][:, 0],
                           layer.lora_magnitude_vector[ADAPTER].weight)
    miss = (output(patched_as_comfyui(standard)) - expected).abs().max().item()
    assert miss > 100 * TOL["atol"], miss  # so the comparison above can fail


@pytest.mark.parametrize("dora_for", ["comfyui", "standard"])
def test_save_then_continue_reads_the_magnitude_back(tmp_path, dora_for):
    spec = LoraSpec(rank=4, alpha=3.0, rslora=True, algorithm="dora")
    model = trained(spec)
    path = save_lora(tmp_path, "c", model, spec, metadata={}, dora_for=dora_for)
    again = tiny_flux()
    inject_lora_continuing(again, dataclasses.replace(spec, existing_lora=str(path)), "flux")
    theirs, ours = lora_parameters(again), lora_parameters(model)
    for k, p in ours.items():  # A and B are copied; m is m * r / r in fp32 (a few ulp)
        torch.testing.assert_close(theirs[k], p, rtol=1e-6, atol=0)
    torch.testing.assert_close(output(again), output(model), **TOL)


def test_a_file_saved_while_every_block_is_offloaded_is_exact(tmp_path):
    """Saves inside the runtime read the base weights from the host tensors offloaded blocks stream from (their
    params hold NaN placeholders then): the file equals one written from the restored model, and ComfyUI's math
    applied to it gives the trained model's output."""
    spec = LoraSpec(rank=4, algorithm="dora", targets="attention_mlp")
    strategy = Strategy.of(compute_dtype="fp32", offload_fraction=1.0, checkpoint="all")
    session = dataclasses.replace(demo_session(tmp_path, strategy=strategy), lora=spec)
    base = copy.deepcopy(session.model.flux)
    result = train(session, 2, device="cpu", save=SaveTarget(tmp_path / "out", "run", every=2))
    (path,) = result.saved
    tensors, _ = read_lora_file(path)
    model = copy.deepcopy(base)
    inject_lora(model, spec, "flux")
    load_lora_state(model, result.lora_state)
    again = save_lora(tmp_path, "restored", model, spec, metadata={})
    restored, _ = read_lora_file(again)
    scales = [k for k in tensors if k.endswith(".dora_scale")]
    assert scales and all(torch.equal(tensors[k], restored[k]) for k in scales)
    plain = copy.deepcopy(base)
    merge_lora_into(plain, path)
    torch.testing.assert_close(output(plain), output(model), **TOL)


def test_the_runtime_gives_the_host_tensor_an_offloaded_weight_streams_from_without_a_copy():
    model = tiny_flux()
    inject_lora(model, LoraSpec(rank=4, algorithm="dora"), "flux")
    weights = {n: layer.get_base_layer().weight for n, layer in lora_layers(model).items()}
    storages = {n: w.untyped_storage().data_ptr() for n, w in weights.items()}
    strategy = Strategy.of(compute_dtype="fp32", offload_fraction=1.0)
    with MemoryRuntime(model, strategy, "cpu") as runtime:
        assert runtime.offload is not None and runtime.offload.host_copy_bytes() == 0
        for n, w in weights.items():
            assert torch.isnan(w).all()  # the param now holds the runtime's placeholder
            assert runtime.host_weight(w).untyped_storage().data_ptr() == storages[n]


def test_a_dora_for_comfyui_without_base_weights_or_an_unknown_convention_is_refused(tmp_path):
    spec = LoraSpec(rank=4, algorithm="dora")
    state = lora_state(trained(spec))
    with pytest.raises(LoraError, match=r"dora_for='comfyui'\) needs the base model's weights.*dora_for='standard'"):
        save_lora_state(tmp_path, "x", state, spec, metadata={})
    with pytest.raises(LoraError, match=r"dora_for='lycoris' is not supported: choose 'comfyui'.* or 'standard'"):
        save_lora_state(tmp_path, "x", state, spec, metadata={}, dora_for="lycoris")
    assert not list(tmp_path.iterdir())
