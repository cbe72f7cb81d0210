"""LoRA settings, target presets per family, and peft injection / removal / state."""
import json
import math
import os
import re

import pytest
import torch
from tiny_flux import flux_inputs, tiny_flux
from torch import nn

from tightrope.training.lora.layers import (LoraError, LoraSpec, inject_lora, load_lora_state, lora_layers,
                                     lora_parameters, lora_state, merge_and_remove_lora, remove_lora,
                                     resolve_existing_lora, targeted_layers)
from tightrope.training.lora.targets import TARGET_PRESETS
from tightrope.training.models.reference_flux import Flux, FluxParams




def randomize_lora_(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.copy_(0.05 * torch.randn(p.shape, generator=g))


# ------------------------------------------------------------------------------------------------ fake families
def tree(leaves: dict[str, nn.Module]) -> nn.Module:
    """A module whose named_modules() are exactly the dotted names given (containers created on the way)."""
    root = nn.Module()
    for path, leaf in leaves.items():
        *parents, last = path.split(".")
        node = root
        for part in parents:
            if part not in node._modules:
                node.add_module(part, nn.Module())
            node = node._modules[part]
        node.add_module(last, leaf)
    return root


def L():
    return nn.Linear(8, 8)


def sd3_model():  # ComfyUI MMDiT: block 0 of SD3.5-medium has attn2; the last context block is pre_only
    leaves = {"x_embedder.proj": nn.Conv2d(4, 8, 2), "t_embedder.mlp.0": L(), "t_embedder.mlp.2": L(),
              "context_embedder": L(), "final_layer.linear": L(), "final_layer.adaLN_modulation.0": nn.SiLU(),
              "final_layer.adaLN_modulation.1": L()}
    for i in range(2):
        for side in ("x_block", "context_block"):
            b = f"joint_blocks.{i}.{side}"
            leaves.update({f"{b}.norm1": nn.LayerNorm(8), f"{b}.attn.qkv": L(), f"{b}.attn.ln_q": nn.LayerNorm(8),
                           f"{b}.adaLN_modulation.0": nn.SiLU(), f"{b}.adaLN_modulation.1": L()})
            if not (side == "context_block" and i == 1):
                leaves.update({f"{b}.attn.proj": L(), f"{b}.mlp.fc1": L(), f"{b}.mlp.act": nn.GELU(),
                               f"{b}.mlp.fc2": L()})
        if i == 0:
            leaves.update({"joint_blocks.0.x_block.attn2.qkv": L(), "joint_blocks.0.x_block.attn2.proj": L()})
    return tree(leaves)


def lumina2_model():  # ComfyUI NextDiT; the refiners sit outside the `layers` block list
    leaves = {"x_embedder": L(), "cap_embedder.1": L(), "t_embedder.mlp.0": L(), "final_layer.linear": L(),
              "final_layer.adaLN_modulation.1": L(), "noise_refiner.0.attention.qkv": L(),
              "context_refiner.0.attention.qkv": L()}
    for i in range(2):
        b = f"layers.{i}"
        leaves.update({f"{b}.attention.qkv": L(), f"{b}.attention.out": L(), f"{b}.attention.q_norm": nn.LayerNorm(8),
                       f"{b}.feed_forward.w1": L(), f"{b}.feed_forward.w2": L(), f"{b}.feed_forward.w3": L(),
                       f"{b}.attention_norm1": nn.LayerNorm(8), f"{b}.adaLN_modulation.0": nn.SiLU(),
                       f"{b}.adaLN_modulation.1": L()})
    return tree(leaves)


def wan_model():  # ComfyUI WAN (image-to-video: cross attention has k_img / v_img)
    leaves = {"patch_embedding": nn.Conv3d(4, 8, 1), "text_embedding.0": L(), "time_embedding.0": L(),
              "time_projection.1": L(), "head.head": L(), "img_emb.proj.1": L()}
    for i in range(2):
        b = f"blocks.{i}"
        for a in ("self_attn", "cross_attn"):
            leaves.update({f"{b}.{a}.{p}": L() for p in "qkvo"})
            leaves[f"{b}.{a}.norm_q"] = nn.LayerNorm(8)
        leaves.update({f"{b}.cross_attn.k_img": L(), f"{b}.cross_attn.v_img": L(), f"{b}.norm1": nn.LayerNorm(8),
                       f"{b}.ffn.0": L(), f"{b}.ffn.1": nn.GELU(), f"{b}.ffn.2": L()})
    return tree(leaves)


def qwen_image_model():  # ComfyUI Qwen-Image
    leaves = {"img_in": L(), "txt_in": L(), "proj_out": L(), "norm_out.linear": L(),
              "time_text_embed.timestep_embedder.linear_1": L()}
    for i in range(2):
        b = f"transformer_blocks.{i}"
        leaves.update({f"{b}.attn.{p}": L() for p in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj",
                                                        "add_k_proj", "add_v_proj", "to_add_out")})
        leaves.update({f"{b}.attn.to_out.1": nn.Dropout(), f"{b}.attn.norm_q": nn.LayerNorm(8)})
        for s in ("img", "txt"):
            leaves.update({f"{b}.{s}_mod.0": nn.SiLU(), f"{b}.{s}_mod.1": L(), f"{b}.{s}_mlp.net.0.proj": L(),
                           f"{b}.{s}_mlp.net.1": nn.Dropout(), f"{b}.{s}_mlp.net.2": L()})
    return tree(leaves)


def blocks(names, *layers):
    return {f"{blk}.{i}.{layer}" for blk in names for i in range(2) for layer in layers}


FAMILIES = {
    "flux": (tiny_flux, ("double_blocks", "single_blocks"),
             blocks(["double_blocks"], "img_attn.qkv", "img_attn.proj", "txt_attn.qkv", "txt_attn.proj")
             | blocks(["single_blocks"], "linear1", "linear2"),
             blocks(["double_blocks"], "img_mlp.0", "img_mlp.2", "txt_mlp.0", "txt_mlp.2")),
    "sd3": (sd3_model, ("joint_blocks",),
            blocks(["joint_blocks"], "x_block.attn.qkv", "x_block.attn.proj", "context_block.attn.qkv")
            | {"joint_blocks.0.x_block.attn2.qkv", "joint_blocks.0.x_block.attn2.proj",
               "joint_blocks.0.context_block.attn.proj"},
            blocks(["joint_blocks"], "x_block.mlp.fc1", "x_block.mlp.fc2")
            | {"joint_blocks.0.context_block.mlp.fc1", "joint_blocks.0.context_block.mlp.fc2"}),
    "lumina2": (lumina2_model, ("layers",), blocks(["layers"], "attention.qkv", "attention.out"),
                blocks(["layers"], "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")),
    "wan": (wan_model, ("blocks",),
            blocks(["blocks"], *[f"{a}.{p}" for a in ("self_attn", "cross_attn") for p in "qkvo"],
                   "cross_attn.k_img", "cross_attn.v_img"),
            blocks(["blocks"], "ffn.0", "ffn.2")),
    "qwen_image": (qwen_image_model, ("transformer_blocks",),
                   blocks(["transformer_blocks"], "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                          "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"),
                   blocks(["transformer_blocks"], "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                          "txt_mlp.net.2")),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_presets_match_the_family_layer_names(family):
    make, block_lists, attention, mlp = FAMILIES[family]
    model = make()
    in_blocks = {n for n, m in model.named_modules()
                 if isinstance(m, nn.Linear) and n.split(".")[0] in block_lists}
    assert set(targeted_layers(model, LoraSpec(rank=4, targets="attention"), family)) == attention
    assert set(targeted_layers(model, LoraSpec(rank=4, targets="attention_mlp"), family)) == attention | mlp
    # all_linear: every Linear inside the block lists, nothing outside (embedders, refiners, final layer)
    assert set(targeted_layers(model, LoraSpec(rank=4, targets="all_linear"), family)) == in_blocks
    assert set(TARGET_PRESETS) == set(FAMILIES)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_inject_then_remove_leaves_the_model_as_it_was(family):
    model = FAMILIES[family][0]()
    first = next(model.parameters())
    first.requires_grad_(False)  # a mixed set of flags must come back as it was
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attrs = set(model.__dict__)
    types = {n: type(m) for n, m in model.named_modules()}

    names = inject_lora(model, LoraSpec(rank=2, targets="all_linear", dropout=0.1), family)
    assert sorted(lora_layers(model)) == sorted(names)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_parameters(model)) and len(trainable) == 2 * len(names)
    assert all(p.dtype == torch.float32 for p in lora_parameters(model).values())

    remove_lora(model)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert set(model.__dict__) == attrs and {n: type(m) for n, m in model.named_modules()} == types
    assert not lora_layers(model)


def test_presets_on_full_size_flux_dev_on_meta():
    with torch.device("meta"):
        model = Flux(FluxParams.dev())  # 19 double + 38 single blocks
    counts = {p: len(targeted_layers(model, LoraSpec(rank=16, targets=p), "flux"))
              for p in ("attention", "attention_mlp", "all_linear")}
    assert counts == {"attention": 19 * 4 + 38 * 2, "attention_mlp": 19 * 8 + 38 * 2,
                      "all_linear": 19 * 10 + 38 * 3}
    names = inject_lora(model, LoraSpec(rank=16), "flux")
    assert len(names) == 152 and len(lora_parameters(model)) == 304
    a = lora_parameters(model)["double_blocks.0.img_attn.qkv.lora_A.default.weight"]
    assert a.shape == (16, 3072) and a.device.type == "meta"
    remove_lora(model)
    assert not lora_layers(model)


def test_presets_are_anchored_fullmatch_regexes():
    rx = TARGET_PRESETS["flux"]["all_linear"]
    assert re.fullmatch(rx, "double_blocks.3.img_attn.qkv")
    for name in ("diffusion_model.double_blocks.3.img_attn.qkv", "double_blocks.3.img_attn.qkv.base_layer",
                 "double_blocks.3.img_attn", "final_layer.linear", "final_layer.adaLN_modulation.1", "img_in"):
        assert not re.fullmatch(rx, name), name


def test_fresh_lora_is_a_no_op_and_only_lora_trains():
    model = tiny_flux()
    x = flux_inputs()
    with torch.no_grad():
        before = model.forward_latent(*x)
    inject_lora(model, LoraSpec(rank=4, init="gaussian"), "flux")
    with torch.no_grad():
        assert torch.equal(model.forward_latent(*x), before)  # B starts at zero
    model.forward_latent(*x).square().mean().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and grads <= set(lora_parameters(model))


# ------------------------------------------------------------------------------------------------ LoraSpec
def test_spec_defaults_and_json_round_trip():
    spec = LoraSpec(rank=8)
    assert spec.alpha == 8.0 and spec.scale == 1.0
    full = LoraSpec(rank=16, alpha=4, rslora=True, dropout=0.1, targets="all_linear",
                    target_regex=r"double_blocks\.\d+\.img_attn\.qkv", init="gaussian",
                    existing_lora="/x/prev.safetensors")
    assert LoraSpec.from_dict(json.loads(json.dumps(full.to_dict()))) == full
    assert full.scale == 4 / math.sqrt(16)
    assert LoraSpec(target_regex="", existing_lora="").target_regex is None
    with pytest.raises(LoraError, match="unknown LoRA setting.*'ranks'"):
        LoraSpec.from_dict({"ranks": 4})


@pytest.mark.parametrize("kwargs,names", [
    (dict(rank=0), ["rank=0", "1 or more"]),
    (dict(rank=2.5), ["rank=2.5"]),
    (dict(alpha=0), ["alpha=0", "greater than 0"]),
    (dict(alpha=-1.0), ["alpha=-1.0", "greater than 0"]),
    (dict(dropout=1.0), ["dropout=1.0", "not including"]),
    (dict(dropout=-0.1), ["dropout=-0.1"]),
    (dict(targets="attn"), ["targets='attn'", "attention_mlp"]),
    (dict(target_regex="double_blocks.(qkv"), ["target_regex='double_blocks.(qkv'", "does not compile"]),
    (dict(init="zeros"), ["init='zeros'", "gaussian"]),
    (dict(existing_lora="prev.ckpt"), ["existing_lora='prev.ckpt'", ".safetensors"]),
    (dict(rslora="yes"), ["rslora='yes'"]),
])
def test_spec_errors_name_the_input_and_the_fix(kwargs, names):
    with pytest.raises(LoraError) as e:
        LoraSpec(**kwargs)
    for part in names:
        assert part in str(e.value)


def test_rank_larger_than_a_targeted_layer_names_the_layer():
    model = tiny_flux()  # hidden 128
    with pytest.raises(LoraError, match=r"rank=200 is larger than layer 'double_blocks\.0\.img_attn\.qkv' "
                                        r"\(Linear 128 -> 384\).*rank <= 128"):
        inject_lora(model, LoraSpec(rank=200), "flux")
    assert not lora_layers(model)


def test_targets_that_match_nothing_list_the_models_layers():
    with pytest.raises(LoraError, match=r"target_regex 'nothing\\\\.here' matches no layer of this flux model.*"
                                        r"include double_blocks\.0\.img_mod\.lin"):
        inject_lora(tiny_flux(), LoraSpec(rank=2, target_regex=r"nothing\.here"), "flux")


def test_other_setup_errors():
    model = lumina2_model()
    with pytest.raises(LoraError, match="preset 'attention'.*matches no layer of this flux model.*layers.0"):
        inject_lora(model, LoraSpec(rank=2), "flux")  # a Lumina model connected as Flux
    with pytest.raises(LoraError, match="family 'sdxl'.*flux, sd3"):
        inject_lora(model, LoraSpec(rank=2), "sdxl")
    with pytest.raises(LoraError, match=r"matches 'layers.0.attention', a Module: LoRA goes on Linear"):
        inject_lora(model, LoraSpec(rank=2, target_regex=r"layers\.\d+\.attention"), "lumina2")
    inject_lora(model, LoraSpec(rank=2), "lumina2")
    with pytest.raises(LoraError, match="already has LoRA layers: call remove_lora"):
        inject_lora(model, LoraSpec(rank=2), "lumina2")


def test_target_regex_overrides_the_preset():
    names = inject_lora(tiny_flux(), LoraSpec(rank=2, targets="all_linear",
                                              target_regex=r"single_blocks\.\d+\.linear1"), "flux")
    assert names == ["single_blocks.0.linear1", "single_blocks.1.linear1"]


# ------------------------------------------------------------------------------------------------ state
def test_lora_state_forks_into_a_fresh_model():
    spec = LoraSpec(rank=4, targets="attention_mlp")
    a = tiny_flux()
    inject_lora(a, spec, "flux")
    randomize_lora_(a)
    state = lora_state(a)
    assert all(t.device.type == "cpu" for t in state.values())
    b = tiny_flux()
    inject_lora(b, spec, "flux")
    params_before = dict(lora_parameters(b))
    load_lora_state(b, state)
    assert all(lora_parameters(b)[k] is params_before[k] for k in params_before)  # same Parameter objects
    x = flux_inputs()
    with torch.no_grad():
        assert torch.equal(a.forward_latent(*x), b.forward_latent(*x))
    state[next(iter(state))].add_(1.0)  # a copy: changing it leaves the model alone
    assert not torch.equal(state[next(iter(state))], lora_parameters(a)[next(iter(state))])

    c = tiny_flux()
    inject_lora(c, LoraSpec(rank=8, targets="attention_mlp"), "flux")
    with pytest.raises(LoraError, match="does not fit.*wrong shape 40.*rank, targets"):
        load_lora_state(c, state)


def test_rslora_scale_is_peft_scaling():
    model = tiny_flux()
    spec = LoraSpec(rank=16, alpha=8, rslora=True)
    inject_lora(model, spec, "flux")
    assert all(layer.scaling["default"] == pytest.approx(8 / 4) == spec.scale
               for layer in lora_layers(model).values())


def test_bf16_base_gets_fp32_lora():
    model = tiny_flux().to(torch.bfloat16)
    inject_lora(model, LoraSpec(rank=4), "flux")
    assert all(p.dtype == torch.float32 for p in lora_parameters(model).values())
    with torch.no_grad():
        assert model.forward_latent(*[t.to(torch.bfloat16) for t in flux_inputs()]).dtype == torch.bfloat16


def test_merge_and_remove_equals_the_injected_lora():
    model = tiny_flux()
    inject_lora(model, LoraSpec(rank=4, alpha=2, rslora=True, targets="all_linear"), "flux")
    randomize_lora_(model)
    x = flux_inputs()
    with torch.no_grad():
        with_lora = model.forward_latent(*x)
        assert merge_and_remove_lora(model) == 26
        assert not lora_layers(model)
        assert (model.forward_latent(*x) - with_lora).abs().max() < 1e-5


def test_resolve_existing_lora(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "prev.safetensors").write_bytes(b"x")
    assert resolve_existing_lora("sub/prev.safetensors", tmp_path) == str(tmp_path / "sub" / "prev.safetensors")
    full = str(tmp_path / "sub" / "prev.safetensors")
    assert resolve_existing_lora(full, "/elsewhere") == full
    with pytest.raises(LoraError, match="existing_lora='nope.safetensors' was not found"):
        resolve_existing_lora("nope.safetensors", tmp_path)
    with pytest.raises(LoraError, match="existing_lora='prev.pt' is not a .safetensors"):
        resolve_existing_lora("prev.pt", tmp_path)


@pytest.mark.skipif(os.sep != "/", reason="a backslash separates folders where os.sep is one")
def test_an_existing_lora_named_as_comfyui_lists_it_on_windows_is_found_here(tmp_path):
    """ComfyUI on Windows lists LoRAs in subfolders as 'sub\\prev.safetensors'; a workflow made there and run on
    Linux (a rented GPU) gave that name, where a backslash is a letter of a file name: 'was not found'."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "prev.safetensors").write_bytes(b"x")
    assert resolve_existing_lora("sub\\prev.safetensors", tmp_path) == str(tmp_path / "sub" / "prev.safetensors")
    (tmp_path / "sub\\prev.safetensors").write_bytes(b"a file so named, here")  # the name as given comes first
    assert resolve_existing_lora("sub\\prev.safetensors", tmp_path) == str(tmp_path / "sub\\prev.safetensors")
