"""LoRA files: the ComfyUI key format, never overwriting, continuing from a file (ours / peft / kohya), and
merging into the reference Flux."""
import dataclasses
import json
import math
import os

import pytest
import torch
from tiny_flux import flux_inputs, tiny_flux
from safetensors.torch import save_file

from tightrope.training.lora import files as lora_file
from tightrope.training.finite_check import NonFiniteDataError
from tightrope.training.lora.layers import (LoraError, LoraSpec, inject_lora, lora_parameters, lora_state,
                                     remove_lora)
from merge_lora import merge_lora_into
from tightrope.training.lora.files import inject_lora_continuing, lora_modules_in_file, read_lora_file, save_lora
from tightrope.training.models.reference_flux import Flux, FluxParams
from tightrope.demo.tiny_checkpoint import init_tiny_weights_

RUN_METADATA = {"tightrope.base_model": "tiny-flux", "tightrope.family": "flux", "tightrope.steps": "7",
                "tightrope.strategy": '{"offload_fraction": 0.0}'}




def trained(spec, seed=0):
    """A tiny Flux with `spec` injected and non-zero LoRA weights (a fresh LoRA is a no-op)."""
    model = tiny_flux()
    names = inject_lora(model, spec, "flux")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model, names


def output(model):
    with torch.no_grad():
        return model.forward_latent(*flux_inputs())


# ------------------------------------------------------------------------------------------------------- save
def test_saved_file_has_exactly_the_comfyui_keys(tmp_path):
    spec = LoraSpec(rank=4, alpha=8.0, targets="attention_mlp")
    model, names = trained(spec)
    path = save_lora(tmp_path, "tightrope/run", model, spec, metadata=RUN_METADATA)
    assert path == tmp_path / "tightrope" / "run_00001_.safetensors"
    tensors, meta = read_lora_file(path)
    expected = {f"diffusion_model.{n}.{k}" for n in names for k in ("lora_A.weight", "lora_B.weight", "alpha")}
    assert set(tensors) == expected
    layer = model.get_submodule("double_blocks.0.img_mlp.0")
    assert tensors["diffusion_model.double_blocks.0.img_mlp.0.lora_A.weight"].shape == (4, 128)
    assert tensors["diffusion_model.double_blocks.0.img_mlp.0.lora_B.weight"].shape == (512, 4)
    assert torch.equal(tensors["diffusion_model.double_blocks.0.img_mlp.0.lora_B.weight"],
                       layer.lora_B["default"].weight)
    alpha = tensors["diffusion_model.double_blocks.0.img_mlp.0.alpha"]
    assert alpha.ndim == 0 and alpha.dtype == torch.float32 and alpha.item() == 8.0
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert all(isinstance(v, str) for v in meta.values())
    assert {k: meta[k] for k in RUN_METADATA} == RUN_METADATA
    assert meta["tightrope.rank"] == "4" and meta["tightrope.alpha"] == "8.0" and meta["tightrope.rslora"] == "false"
    assert meta["tightrope.targets"] == "attention_mlp" and meta["tightrope.version"]
    assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == "8.0"
    assert LoraSpec.from_dict(json.loads(meta["tightrope.lora"])) == spec


def test_rslora_writes_alpha_times_sqrt_rank(tmp_path):
    spec = LoraSpec(rank=16, alpha=4.0, rslora=True)
    model, _ = trained(spec)
    tensors, meta = read_lora_file(save_lora(tmp_path, "r", model, spec, metadata={}))
    alphas = {v.item() for k, v in tensors.items() if k.endswith(".alpha")}
    assert alphas == {16.0}  # 4 * sqrt(16)
    assert 16.0 / 16 == pytest.approx(spec.scale) == 4.0 / math.sqrt(16)  # ComfyUI's alpha/rank = peft's scale
    assert meta["ss_network_alpha"] == "16.0" and meta["tightrope.alpha"] == "4.0"


def test_bf16_file(tmp_path):
    spec = LoraSpec(rank=4)
    model, _ = trained(spec)
    tensors, meta = read_lora_file(save_lora(tmp_path, "b", model, spec, metadata={}, dtype="bf16"))
    assert {t.dtype for k, t in tensors.items() if not k.endswith(".alpha")} == {torch.bfloat16}
    assert {t.dtype for k, t in tensors.items() if k.endswith(".alpha")} == {torch.float32}
    assert meta["tightrope.lora_dtype"] == "bf16"
    with pytest.raises(LoraError, match="dtype='fp8' is not supported: choose one of fp32, bf16"):
        save_lora(tmp_path, "b", model, spec, metadata={}, dtype="fp8")


def test_two_saves_make_two_files(tmp_path):
    spec = LoraSpec(rank=4)
    model, _ = trained(spec)
    first = save_lora(tmp_path, "sub/x", model, spec, metadata={})
    content = first.read_bytes()
    second = save_lora(tmp_path, "sub/x", model, spec, metadata={})
    assert (first.name, second.name) == ("x_00001_.safetensors", "x_00002_.safetensors")
    assert first.read_bytes() == content
    assert sorted(os.listdir(tmp_path / "sub")) == ["x_00001_.safetensors", "x_00002_.safetensors"]


def test_a_name_taken_meanwhile_is_not_overwritten(tmp_path, monkeypatch):
    spec = LoraSpec(rank=4)
    model, _ = trained(spec)
    taken = tmp_path / "x_00001_.safetensors"
    taken.write_bytes(b"someone else's file")
    calls = []
    real = lora_file.next_free_path

    def racing(folder, prefix, **kwargs):  # first answer: a name another writer has just taken
        calls.append(1)
        return taken if len(calls) == 1 else real(folder, prefix, **kwargs)
    monkeypatch.setattr(lora_file, "next_free_path", racing)
    path = save_lora(tmp_path, "x", model, spec, metadata={})
    assert path.name == "x_00002_.safetensors" and taken.read_bytes() == b"someone else's file"
    assert sorted(os.listdir(tmp_path)) == ["x_00001_.safetensors", "x_00002_.safetensors"]  # no temp left


@pytest.mark.parametrize("prefix", ["../escape", "a/../../escape", "/abs/lora", "C:\\loras\\x", "..\\x"])
def test_prefix_outside_the_folder_is_rejected(tmp_path, prefix):
    spec = LoraSpec(rank=4)
    model, _ = trained(spec)
    with pytest.raises(ValueError, match="filename_prefix="):
        save_lora(tmp_path / "loras", prefix, model, spec, metadata={})
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_save_without_lora_layers_fails(tmp_path):
    with pytest.raises(LoraError, match="no LoRA layers to save: inject_lora"):
        save_lora(tmp_path, "x", tiny_flux(), LoraSpec(rank=4), metadata={})


# ------------------------------------------------------------------------------------------------------- read
def test_read_errors_name_the_file(tmp_path):
    with pytest.raises(LoraError, match=r"'.*prev\.ckpt' is not a \.safetensors file.*never pickled"):
        read_lora_file(tmp_path / "prev.ckpt")
    with pytest.raises(FileNotFoundError, match=r"'.*missing\.safetensors' does not exist"):
        read_lora_file(tmp_path / "missing.safetensors")
    (tmp_path / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(LoraError, match=r"'.*broken\.safetensors' could not be read as safetensors.*again"):
        read_lora_file(tmp_path / "broken.safetensors")


def test_nan_weights_are_never_saved_and_refused_when_read(tmp_path):
    spec = LoraSpec(rank=4)
    model, _ = trained(spec)
    state = lora_state(model)
    state[next(iter(state))][0, 0] = float("nan")
    with pytest.raises(NonFiniteDataError, match=r"the LoRA to save as 'x' holds NaN or infinite values in 1 of "
                                                 r"\d+ tensors .*it was not saved"):
        lora_file.save_lora_state(tmp_path, "x", state, spec, metadata={})
    assert os.listdir(tmp_path) == []
    path = save_lora(tmp_path, "y", model, spec, metadata={})
    tensors = read_lora_file(path)[0]
    tensors[sorted(tensors)[-1]][0, 0] = float("inf")
    save_file(tensors, path)  # a file from elsewhere, or a run that diverged before this check
    with pytest.raises(NonFiniteDataError, match=rf"LoRA file '{path}' holds NaN or infinite values in 1 of "
                                                 rf"{len(tensors)} tensors \(e.g. {sorted(tensors)[-1]}\): .*pick an "
                                                 "earlier LoRA file"):
        inject_lora_continuing(tiny_flux(), dataclasses.replace(spec, existing_lora=str(path)), "flux")


def test_unsupported_keys_are_named():
    t = {"diffusion_model.a.lora_A.weight": torch.zeros(2, 3), "diffusion_model.a.lora_B.weight": torch.zeros(4, 2),
         "diffusion_model.a.dora_scale": torch.zeros(4, 1)}
    with pytest.raises(LoraError, match="not plain LoRA weights.*diffusion_model.a.dora_scale.*holds other weights too"):
        lora_modules_in_file(t)
    with pytest.raises(LoraError, match="lora_A but not both lora_A and lora_B for 'a'"):
        lora_modules_in_file({"diffusion_model.a.lora_A.weight": torch.zeros(2, 3)})


# ---------------------------------------------------------------------------------------------------- continue
def test_continue_from_a_saved_file_gives_the_same_lora_state(tmp_path):
    spec = LoraSpec(rank=4, alpha=2.0, rslora=True, targets="all_linear")
    model, _ = trained(spec)
    path = save_lora(tmp_path, "c", model, spec, metadata={})
    fresh = tiny_flux()
    inject_lora_continuing(fresh, LoraSpec.from_dict({**spec.to_dict(), "existing_lora": str(path)}), "flux")
    ours, theirs = lora_state(model), lora_state(fresh)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_continue_with_another_alpha_keeps_the_files_update(tmp_path):
    spec = LoraSpec(rank=4, alpha=4.0)
    model, _ = trained(spec)
    path = save_lora(tmp_path, "c", model, spec, metadata={})
    fresh = tiny_flux()
    inject_lora_continuing(fresh, LoraSpec(rank=4, alpha=1.0, rslora=True, existing_lora=str(path)), "flux")
    assert (output(fresh) - output(model)).abs().max() < 1e-5  # B rescaled by (4/4) / (1/2)


def as_kohya(tensors):
    out = {}
    for k, v in tensors.items():
        stem = k[len("diffusion_model."):]
        for ours, theirs in ((".lora_A.weight", ".lora_down.weight"), (".lora_B.weight", ".lora_up.weight"),
                             (".alpha", ".alpha")):
            if stem.endswith(ours):
                out["lora_unet_" + stem[: -len(ours)].replace(".", "_") + theirs] = v
    return out


def test_kohya_and_peft_format_files_load(tmp_path):
    spec = LoraSpec(rank=4, alpha=4.0, targets="attention_mlp")  # scale 1: peft's alpha-less files mean that
    model, _ = trained(spec)
    tensors, _ = read_lora_file(save_lora(tmp_path, "ours", model, spec, metadata={}))
    kohya = tmp_path / "kohya.safetensors"
    save_file(as_kohya(tensors), kohya)
    assert "lora_unet_double_blocks_0_img_mlp_0.lora_down.weight" in as_kohya(tensors)
    peft_bare = tmp_path / "peft.safetensors"
    save_file({k[len("diffusion_model."):]: v for k, v in tensors.items() if not k.endswith(".alpha")}, peft_bare)
    for path in (kohya, peft_bare):
        fresh = tiny_flux()
        inject_lora_continuing(fresh, LoraSpec(rank=4, alpha=4.0, targets="attention_mlp", existing_lora=str(path)),
                               "flux")
        ours, theirs = lora_state(model), lora_state(fresh)
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), path.name
        plain = tiny_flux()
        assert merge_lora_into(plain, path) == 20
        assert (output(plain) - output(model)).abs().max() < 1e-5, path.name


def test_a_kohya_file_with_text_encoder_layers_continues_its_diffusion_model_part(tmp_path):
    """kohya's lora_te1_ keys were read as layers of another architecture; they are left out, with a warning."""
    spec = LoraSpec(rank=4, alpha=4.0, targets="attention_mlp")
    model, _ = trained(spec)
    tensors, _ = read_lora_file(save_lora(tmp_path, "ours", model, spec, metadata={}))
    te = {"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(4, 8),
          "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.zeros(8, 4),
          "lora_te1_text_model_encoder_layers_0_mlp_fc1.alpha": torch.tensor(4.0)}
    save_file(as_kohya(tensors) | te, tmp_path / "with_te.safetensors")
    fresh = tiny_flux()
    with pytest.warns(UserWarning, match=r"3 text-encoder tensors \(e.g. lora_te1_.*\) are left out"):
        inject_lora_continuing(fresh, LoraSpec(rank=4, alpha=4.0, targets="attention_mlp",
                                               existing_lora=str(tmp_path / "with_te.safetensors")), "flux")
    ours, theirs = lora_state(model), lora_state(fresh)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    save_file(te, tmp_path / "te_only.safetensors")
    with pytest.raises(LoraError, match="holds text-encoder layers only"):
        inject_lora_continuing(tiny_flux(), LoraSpec(rank=4, alpha=4.0, targets="attention_mlp",
                                                     existing_lora=str(tmp_path / "te_only.safetensors")), "flux")


def lumina_shaped_file(path):
    t = {}
    for i in range(2):
        for layer in ("attention.qkv", "attention.out", "feed_forward.w1"):
            t[f"diffusion_model.layers.{i}.{layer}.lora_A.weight"] = torch.zeros(4, 128)
            t[f"diffusion_model.layers.{i}.{layer}.lora_B.weight"] = torch.zeros(128, 4)
            t[f"diffusion_model.layers.{i}.{layer}.alpha"] = torch.tensor(4.0)
    save_file(t, path)
    return path


def test_a_lora_for_another_architecture_is_refused(tmp_path):
    path = lumina_shaped_file(tmp_path / "lumina.safetensors")
    model = tiny_flux()
    with pytest.raises(LoraError, match=r"6 of 6 LoRA layers in the file match no layer of this model "
                                        r"\(e\.g\. layers\.0\.attention.*another model architecture"):
        inject_lora_continuing(model, LoraSpec(rank=4, existing_lora=str(path)), "flux")
    assert not any(".lora_" in k for k in model.state_dict())  # the failed setup was undone
    with pytest.raises(LoraError, match="none of the 6 LoRA layers.*another model architecture"):
        merge_lora_into(tiny_flux(), path)


def test_rank_and_target_mismatches_say_what_to_set(tmp_path):
    spec = LoraSpec(rank=4, targets="attention_mlp")
    model, _ = trained(spec)
    path = str(save_lora(tmp_path, "m", model, spec, metadata={}))
    with pytest.raises(LoraError, match="trained with rank 4 but this LoRA setup has rank=8.*set rank=4"):
        inject_lora_continuing(tiny_flux(), LoraSpec(rank=8, targets="attention_mlp", existing_lora=path), "flux")
    with pytest.raises(LoraError, match="trained with targets='attention_mlp'.*set targets/target_regex"):
        inject_lora_continuing(tiny_flux(), LoraSpec(rank=4, targets="attention", existing_lora=path), "flux")
    with pytest.raises(LoraError, match="trained with targets='attention_mlp'.*lacks 6"):
        inject_lora_continuing(tiny_flux(), LoraSpec(rank=4, targets="all_linear", existing_lora=path), "flux")


def test_another_model_size_is_refused(tmp_path):
    spec = LoraSpec(rank=4)
    model, _ = trained(spec)
    path = str(save_lora(tmp_path, "m", model, spec, metadata={}))
    wider = init_tiny_weights_(Flux(dataclasses.replace(FluxParams.tiny(), hidden_size=256, num_heads=2)))
    with pytest.raises(LoraError, match="'double_blocks.0.img_attn.qkv' is 128 -> 384 in the file but 256 -> 768"):
        inject_lora_continuing(wider, LoraSpec(rank=4, existing_lora=path), "flux")
    with pytest.raises(LoraError, match="128 -> 384 in the LoRA but 256 -> 768 in the model"):
        merge_lora_into(wider, path)


# ------------------------------------------------------------------------------------------------------- merge
def test_merge_equals_the_injected_lora(tmp_path):
    spec = LoraSpec(rank=8, alpha=3.0, rslora=True, targets="all_linear")
    model, names = trained(spec)
    path = save_lora(tmp_path, "m", model, spec, metadata={})
    with_lora = output(model)
    remove_lora(model)
    base = output(model)
    assert (with_lora - base).abs().max() > 1e-2  # the LoRA changes the output
    assert merge_lora_into(model, path) == len(names) == 26
    assert (output(model) - with_lora).abs().max() < 1e-5


def test_merge_strength(tmp_path):
    spec = LoraSpec(rank=4)
    model, _ = trained(spec)
    path = save_lora(tmp_path, "m", model, spec, metadata={})
    w0 = tiny_flux().double_blocks[0].img_attn.qkv.weight.detach().clone()
    full, half = tiny_flux(), tiny_flux()
    merge_lora_into(full, path, 1.0)
    merge_lora_into(half, path, 0.5)
    d_full = full.double_blocks[0].img_attn.qkv.weight - w0
    d_half = half.double_blocks[0].img_attn.qkv.weight - w0
    assert d_full.abs().max() > 0 and torch.allclose(d_half, 0.5 * d_full, atol=1e-6)
    with pytest.raises(LoraError, match="has peft LoRA layers"):
        merge_lora_into(model, path)


def test_the_version_of_a_plain_checkout_is_its_pyproject_s(monkeypatch):
    """In ComfyUI's custom_nodes (a git clone, not pip-installed) the LoRA files named version 'unknown': the
    pyproject.toml was looked for in training/, not the checkout's root (found by a helper in a real server)."""
    import re
    from pathlib import Path
    from tightrope.training.lora import files

    def not_installed(name):
        raise files.importlib_metadata.PackageNotFoundError(name)
    monkeypatch.setattr(files.importlib_metadata, "version", not_installed)
    root = Path(files.__file__).resolve().parents[2]
    assert files.tightrope_version() == re.search(r'^version\s*=\s*"([^"]+)"', (root / "pyproject.toml").read_text(),
                                                  re.M).group(1)
