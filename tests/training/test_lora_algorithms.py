"""DoRA, LoHa and LoKr: settings, injection through peft, the saved file's keys, continuing from a file and merging
one, checked against the peft model they were trained as (plain PyTorch, fp32, on the tiny Flux)."""
import dataclasses
import json
import math

import pytest
import torch
from demo_setup import demo_session
from tiny_flux import flux_inputs, tiny_flux

from tightrope.headless.input_spec import node_input_specs
from tightrope.memory.strategy import Strategy
from tightrope.nodes.lora_node import TightropeLoraSetup
from tightrope.training.input_checks import check_existing_lora
from tightrope.training.lora.layers import LoraError, LoraSpec, inject_lora, lora_layers, lora_parameters, \
    merge_and_remove_lora
from tightrope.training.lora.algorithms import ADAPTER
from merge_lora import merge_lora_into
from tightrope.training.lora.files import inject_lora_continuing, read_lora_file, save_lora
from tightrope.training.lora.lycoris import file_algorithm
from tightrope.training.trainer import SaveTarget, train

ALGORITHMS = ("lora", "dora", "loha", "lokr")


def trained(spec, seed=0):
    """The tiny Flux with `spec`'s adapter, every factor moved off its init (a fresh adapter is a no-op)."""
    model = tiny_flux()
    torch.manual_seed(seed)  # peft's init
    names = inject_lora(model, spec, "flux")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model, names


def output(model):
    with torch.no_grad():
        return model.forward_latent(*flux_inputs())


def continued(spec, path):
    model = tiny_flux()
    inject_lora_continuing(model, LoraSpec.from_dict({**spec.to_dict(), "existing_lora": str(path)}), "flux")
    return model


# ------------------------------------------------------------------------------------------------------ settings
def test_settings_each_algorithm_refuses():
    with pytest.raises(LoraError, match=r"algorithm='oft' is not supported: choose one of lora, dora, loha, lokr"):
        LoraSpec(algorithm="oft")
    with pytest.raises(LoraError, match=r"dropout=0.1 does not apply to algorithm='loha'.*set dropout=0"):
        LoraSpec(algorithm="loha", dropout=0.1)
    with pytest.raises(LoraError, match=r"init='gaussian' does not apply to algorithm='lokr'.*set init='default'"):
        LoraSpec(algorithm="lokr", init="gaussian")
    assert LoraSpec(algorithm="dora", dropout=0.1, init="gaussian").algorithm == "dora"
    assert LoraSpec.from_dict({"rank": 4}).algorithm == "lora"  # settings saved before the choice existed


@pytest.mark.parametrize("algorithm", ALGORITHMS[1:])
def test_each_algorithm_starts_as_a_no_op_with_fp32_trainable_factors(algorithm):
    model = tiny_flux()
    before = output(model)
    names = inject_lora(model, LoraSpec(rank=4, algorithm=algorithm), "flux")
    assert list(lora_layers(model)) == names
    params = lora_parameters(model)
    assert params and all(p.requires_grad and p.dtype == torch.float32 for p in params.values())
    assert not any(p.requires_grad for n, p in model.named_parameters() if n not in params)
    assert torch.equal(output(model), before)


# ---------------------------------------------------------------------------------------------------------- file
@pytest.mark.parametrize("rank,rslora", [(4, False), (8, True)])
def test_file_keys_are_comfyuis(tmp_path, rank, rslora):
    """Per layer, the keys and shapes comfy/weight_adapter reads; alpha / rank is the trained scale."""
    for algorithm in ALGORITHMS[1:]:
        spec = LoraSpec(rank=rank, alpha=3.0, rslora=rslora, algorithm=algorithm)
        model, names = trained(spec)
        tensors, meta = read_lora_file(save_lora(tmp_path, algorithm, model, spec, metadata={}))
        assert meta["tightrope.algorithm"] == algorithm and json.loads(meta["tightrope.lora"])["algorithm"] == algorithm
        for name in names:
            layer, base = lora_layers(model)[name], model.get_submodule(name).get_base_layer().weight
            keys = {k[len(f"diffusion_model.{name}."):]: t for k, t in tensors.items()
                    if k.startswith(f"diffusion_model.{name}.")}
            assert keys["alpha"].item() == pytest.approx(spec.scale * rank)
            out, n_in = base.shape
            if algorithm == "dora":
                assert {k: tuple(t.shape) for k, t in keys.items()} == {
                    "lora_A.weight": (rank, n_in), "lora_B.weight": (out, rank), "dora_scale": (out, 1), "alpha": ()}
                update = layer.scaling[ADAPTER] * layer.lora_B[ADAPTER].weight @ layer.lora_A[ADAPTER].weight
                ratio = (torch.linalg.norm(base, dim=1) + torch.finfo(torch.float32).eps) \
                    / torch.linalg.norm(base + update, dim=1)  # dora_for='comfyui' (dora_scale.py)
                comfyui = layer.lora_magnitude_vector[ADAPTER].weight * ratio
                torch.testing.assert_close(keys["dora_scale"][:, 0], comfyui, rtol=1e-6, atol=0)
            elif algorithm == "loha":
                assert {k: tuple(t.shape) for k, t in keys.items()} == {
                    "hada_w1_a": (out, rank), "hada_w1_b": (rank, n_in), "hada_w2_a": (out, rank),
                    "hada_w2_b": (rank, n_in), "alpha": ()}
            else:
                w1 = keys["lokr_w1"]
                w2 = keys["lokr_w2"] if "lokr_w2" in keys else keys["lokr_w2_a"] @ keys["lokr_w2_b"]
                assert torch.kron(w1, w2).shape == base.shape
                scale = spec.scale if "lokr_w2_b" in keys else 1.0  # ComfyUI's rule: no factor, no alpha
                torch.testing.assert_close(scale * torch.kron(w1, w2), layer.get_delta_weight(ADAPTER))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("rank,rslora", [(4, False), (8, True)])
def test_save_then_continue_gives_the_same_outputs(tmp_path, algorithm, rank, rslora):
    spec = LoraSpec(rank=rank, alpha=3.0, rslora=rslora, algorithm=algorithm, targets="attention_mlp")
    model, _ = trained(spec)
    path = save_lora(tmp_path, "c", model, spec, metadata={})
    fresh = continued(spec, path)
    mine, theirs = lora_parameters(model), lora_parameters(fresh)
    assert mine.keys() == theirs.keys()
    folded = [n for n in lora_layers(model) if algorithm == "lokr" and f"{n}.lokr_w2_b.default" not in mine]
    if folded or algorithm == "dora":
        # a LoKr layer with no factorised weight has its scale folded into lokr_w1 in the file (ComfyUI gives it
        # scale 1) and divided out on loading: w1 * s / s is w1 within one rounding of each op (2 ulp); a DoRA's
        # magnitude likewise goes through * r / r, r = |W_i| / |W_i + update_i| (dora_scale.py)
        for k in mine:
            torch.testing.assert_close(theirs[k], mine[k], rtol=2.5e-7, atol=0)
        torch.testing.assert_close(output(fresh), output(model), rtol=1e-5, atol=1e-6)
    else:
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), "the file did not hold exactly what was trained"
        assert torch.equal(output(fresh), output(model))


def test_lokr_rank_above_the_factor_sizes_folds_the_scale(tmp_path):
    """rank 40 > half of every factor of the tiny Flux's widths: peft keeps w1 and w2 full; the file's lokr_w1 holds
    scale * w1 and ComfyUI (no factor -> scale 1) applies exactly the trained update."""
    spec = LoraSpec(rank=40, alpha=4.0, algorithm="lokr")
    model, names = trained(spec)
    tensors, _ = read_lora_file(save_lora(tmp_path, "k", model, spec, metadata={}))
    assert not any(k.endswith(("_a", "_b")) for k in tensors)
    layer = lora_layers(model)[names[0]]
    torch.testing.assert_close(tensors[f"diffusion_model.{names[0]}.lokr_w1"],
                               layer.lokr_w1[ADAPTER] * 0.1, rtol=0, atol=0)


@pytest.mark.parametrize("algorithm", ALGORITHMS[1:])
def test_merge_equals_the_trained_model(tmp_path, algorithm):
    """merge_and_remove_lora (the headless MODEL output) computes what the injected adapter computes; so does
    merge_lora_into (a small LoraLoader) for LoHa and LoKr. fp32: merged weight vs separate branches differ by
    rounding only (1e-5 of outputs of size ~1)."""
    spec = LoraSpec(rank=4, alpha=3.0, algorithm=algorithm, targets="all_linear")
    model, _ = trained(spec)
    expected = output(model)
    path = save_lora(tmp_path, "m", model, spec, metadata={})
    merged = trained(spec)[0]
    assert merge_and_remove_lora(merged) == len(lora_layers(model)) and not lora_layers(merged)
    torch.testing.assert_close(output(merged), expected, rtol=1e-5, atol=1e-5)
    if algorithm != "dora":
        plain = tiny_flux()
        assert merge_lora_into(plain, path) == len(lora_layers(model))
        torch.testing.assert_close(output(plain), expected, rtol=1e-5, atol=1e-5)


def test_merged_dora_file_is_comfyuis_033_math(tmp_path):
    """ComfyUI 0.33 divides DoRA's rows by the base weight's row norms, peft by those of W + update; the default
    file folds the ratio into dora_scale (dora_scale.py), so merge_lora_into (ComfyUI's math) gives the trained
    output (more in test_dora_file.py)."""
    spec = LoraSpec(rank=4, alpha=3.0, algorithm="dora")
    model, names = trained(spec)
    path = save_lora(tmp_path, "d", model, spec, metadata={})
    plain = tiny_flux()
    merge_lora_into(plain, path)
    torch.testing.assert_close(output(plain), output(model), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- refusals
def test_a_file_of_another_algorithm_is_refused(tmp_path):
    paths = {}
    for algorithm in ALGORITHMS:
        spec = LoraSpec(rank=4, algorithm=algorithm)
        paths[algorithm] = save_lora(tmp_path, algorithm, trained(spec)[0], spec, metadata={})
    for have, file in (("lora", "loha"), ("loha", "lokr"), ("dora", "lora"), ("lokr", "dora")):
        names = {"lora": "LoRA", "dora": "DoRA", "loha": "LoHa", "lokr": "LoKr"}
        message = rf"is a {names[file]} file but this setup trains algorithm='{have}': set algorithm='{file}'"
        with pytest.raises(LoraError, match=message):
            continued(LoraSpec(rank=4, algorithm=have), paths[file])
        with pytest.raises(LoraError, match=rf"existing_lora='{file}_00001_.safetensors'.*" + message):
            check_existing_lora(f"{file}_00001_.safetensors", tmp_path, have)
    assert check_existing_lora("lokr_00001_.safetensors", tmp_path, "lokr") == str(paths["lokr"])


@pytest.mark.parametrize("algorithm", ALGORITHMS[1:])
def test_a_file_of_another_rank_or_targets_is_refused(tmp_path, algorithm):
    spec = LoraSpec(rank=4, algorithm=algorithm)
    path = save_lora(tmp_path, "r", trained(spec)[0], spec, metadata={})
    with pytest.raises(LoraError, match=r"layer 'double_blocks\.0\.img_attn\.qkv' holds .* but this setup "
                                        r"\(rank=2\) has .*: set rank=4 to continue from it"):
        continued(LoraSpec(rank=2, algorithm=algorithm), path)
    with pytest.raises(LoraError, match=r"does not cover the same layers as this .* setup \(it was trained with "
                                        r"targets='attention'\).*set targets/target_regex"):
        continued(LoraSpec(rank=4, algorithm=algorithm, targets="attention_mlp"), path)


# ---------------------------------------------------------------------------------------------- node and trainer
def test_lora_setup_node_takes_the_algorithm_last_so_saved_workflows_still_load():
    types = TightropeLoraSetup.INPUT_TYPES()
    assert [*types["required"], *types["optional"]][-1] == "algorithm"  # widgets_values are positional
    choices, options = types["optional"]["algorithm"]
    assert tuple(choices) == ALGORITHMS and options["default"] == "lora" and "lokr" in options["tooltip"]
    node = TightropeLoraSetup()
    assert node.setup(4, 4.0, False, 0.0, "attention", "default", "", "")[0].algorithm == "lora"  # 8 old widgets
    assert node.setup(4, 4.0, False, 0.0, "attention", "default", "", "", "lokr")[0].algorithm == "lokr"
    queued = {n: s.default for n, s in node_input_specs(TightropeLoraSetup).items()}
    assert TightropeLoraSetup.VALIDATE_INPUTS(**queued | {"algorithm": "dora", "dropout": 0.1}) is True
    assert "does not apply to algorithm='loha'" in TightropeLoraSetup.VALIDATE_INPUTS(
        **queued | {"algorithm": "loha", "dropout": 0.1})


@pytest.mark.parametrize("algorithm", ALGORITHMS[1:])
def test_train_save_and_continue_under_layer_offload(tmp_path, algorithm):
    """The trainer trains each algorithm with every block offloaded and checkpointed, saves its file, and continues
    from that file: the continued run starts from exactly the saved weights."""
    spec = LoraSpec(rank=4, algorithm=algorithm, targets="attention_mlp")
    strategy = Strategy.of(compute_dtype="fp32", offload_fraction=1.0, checkpoint="all")
    session = dataclasses.replace(demo_session(tmp_path, strategy=strategy), lora=spec)
    result = train(session, 2, device="cpu", save=SaveTarget(tmp_path / "out", "run", every=2))
    assert all(map(math.isfinite, result.losses))
    (path,) = result.saved  # written inside the runtime, every block's base weight offloaded
    tensors, meta = read_lora_file(path)
    assert meta["tightrope.algorithm"] == algorithm and file_algorithm(tensors) == algorithm
    fresh = tiny_flux()
    continued_spec = dataclasses.replace(spec, existing_lora=path)
    inject_lora_continuing(fresh, continued_spec, "flux")
    again = dataclasses.replace(session, lora=continued_spec)
    assert train(again, 1, device="cpu").step == 1
    state = lora_parameters(fresh)
    assert state.keys() == result.lora_state.keys()
    for k, p in state.items():  # fp32 file: exactly what was trained (LoKr's folded w1: 2 ulp, see above)
        torch.testing.assert_close(p, result.lora_state[k], rtol=2.5e-7, atol=0)


def test_dora_on_fp8_stored_base_weights_is_refused_before_training():
    """DoRA's peft layer adds its update to the raw base weight; torch cannot promote fp8 there (it would fail in the
    first step), so injection refuses it, naming the layer and the fix; the model is left as it was."""
    model = tiny_flux()
    layer = model.get_submodule("double_blocks.0.img_attn.qkv")
    layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn)
    with pytest.raises(LoraError, match=r"algorithm='dora' reads the base weight .* 'double_blocks\.0\.img_attn\.qkv'"
                                        r" is stored as torch\.float8_e4m3fn: load the model in bf16/fp16"):
        inject_lora(model, LoraSpec(rank=4, algorithm="dora"), "flux")
    assert not lora_layers(model)
    assert inject_lora(model, LoraSpec(rank=4, algorithm="lokr"), "flux")  # LoKr leaves W to the base layer
