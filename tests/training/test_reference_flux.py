"""Reference Flux: BFL key layout at full size (on meta), and tiny-model behaviour on CPU."""
import os

import pytest
import torch

from tightrope.training.models.reference_flux import Flux, FluxParams
from tightrope.demo.tiny_checkpoint import load_reference_flux, make_tiny_checkpoint, read_params

H = 3072  # Flux-dev hidden size
# A representative slice of the original flux1-dev.safetensors layout: key -> shape
DEV_KEYS = {
    "img_in.weight": (H, 64), "img_in.bias": (H,),
    "txt_in.weight": (H, 4096), "txt_in.bias": (H,),
    "time_in.in_layer.weight": (H, 256), "time_in.out_layer.weight": (H, H),
    "vector_in.in_layer.weight": (H, 768), "vector_in.out_layer.bias": (H,),
    "guidance_in.in_layer.weight": (H, 256), "guidance_in.out_layer.bias": (H,),
    "double_blocks.0.img_mod.lin.weight": (6 * H, H), "double_blocks.0.img_mod.lin.bias": (6 * H,),
    "double_blocks.0.img_attn.qkv.weight": (3 * H, H), "double_blocks.0.img_attn.qkv.bias": (3 * H,),
    "double_blocks.0.img_attn.norm.query_norm.scale": (128,),
    "double_blocks.0.img_attn.norm.key_norm.scale": (128,),
    "double_blocks.0.img_attn.proj.weight": (H, H), "double_blocks.0.img_attn.proj.bias": (H,),
    "double_blocks.0.img_mlp.0.weight": (4 * H, H), "double_blocks.0.img_mlp.2.weight": (H, 4 * H),
    "double_blocks.18.txt_mod.lin.weight": (6 * H, H),
    "double_blocks.18.txt_attn.qkv.weight": (3 * H, H),
    "double_blocks.18.txt_attn.norm.key_norm.scale": (128,),
    "double_blocks.18.txt_mlp.2.bias": (H,),
    "single_blocks.0.linear1.weight": (3 * H + 4 * H, H), "single_blocks.0.linear1.bias": (7 * H,),
    "single_blocks.0.linear2.weight": (H, H + 4 * H),
    "single_blocks.0.norm.query_norm.scale": (128,), "single_blocks.0.norm.key_norm.scale": (128,),
    "single_blocks.37.modulation.lin.weight": (3 * H, H),
    "final_layer.linear.weight": (64, H), "final_layer.linear.bias": (64,),
    "final_layer.adaLN_modulation.1.weight": (2 * H, H), "final_layer.adaLN_modulation.1.bias": (2 * H,),
}


def meta_model(params):
    with torch.device("meta"):
        return Flux(params)


def test_dev_state_dict_matches_bfl_layout():
    sd = meta_model(FluxParams.dev()).state_dict()
    for key, shape in DEV_KEYS.items():
        assert key in sd, key
        assert tuple(sd[key].shape) == shape, (key, tuple(sd[key].shape), shape)
    assert len(sd) == 780  # 19*24 double + 38*8 single + 20 embedders/final
    assert not any(k.startswith(("double_blocks.19.", "single_blocks.38.")) for k in sd)
    assert not any(k.endswith(".weight") and "norm" in k.split(".")[-2] for k in sd)  # norms use `.scale`
    n = sum(p.numel() for p in meta_model(FluxParams.dev()).parameters())
    assert n == 11_901_408_320  # flux1-dev: ~11.9 B


def test_schnell_has_no_guidance_in():
    sd = meta_model(FluxParams.schnell()).state_dict()
    assert not any(k.startswith("guidance_in.") for k in sd) and len(sd) == 776


def test_params_validation():
    with pytest.raises(ValueError):
        FluxParams(vec_in_dim=8, context_in_dim=8, hidden_size=128, num_heads=1, depth=1, depth_single_blocks=1,
                   axes_dim=(16, 56, 40), guidance_embed=False)  # axes must sum to head dim
    p = FluxParams(in_channels=64, out_channels=None, vec_in_dim=8, context_in_dim=8, hidden_size=128, num_heads=1,
                   depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56], guidance_embed=False)
    assert p.out_channels == 64 and p.axes_dim == (16, 56, 56)


def inputs(params, batch=2, h=6, w=10, txt_len=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(batch, params.in_channels // 4, h, w, generator=g),
                timesteps=torch.rand(batch, generator=g),
                context=torch.randn(batch, txt_len, params.context_in_dim, generator=g),
                y=torch.randn(batch, params.vec_in_dim, generator=g),
                guidance=torch.full((batch,), 3.5))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny_flux.safetensors")


@pytest.mark.parametrize("hw", [(6, 10), (7, 5)])  # odd sizes: circular pad to the patch, crop back
def test_forward_latent_shape_round_trip(tiny_path, hw):
    model = load_reference_flux(tiny_path)
    inp = inputs(model.params, h=hw[0], w=hw[1])
    with torch.no_grad():
        out = model.forward_latent(**inp)
    assert out.shape == inp["x"].shape and out.dtype == torch.float32
    assert torch.isfinite(out).all() and 0.1 < out.std() < 10


def test_forward_latent_matches_token_forward(tiny_path):
    """forward_latent is exactly patchify -> forward -> unpatchify, with row/column ids."""
    model = load_reference_flux(tiny_path)
    inp = inputs(model.params, batch=1, h=4, w=6)
    x = inp["x"]
    img = x.reshape(1, 16, 2, 2, 3, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, 6, 64)
    ids = torch.tensor([[0.0, r, c] for r in range(2) for c in range(3)])[None]
    with torch.no_grad():
        tok = model(img, ids, inp["context"], torch.zeros(1, 5, 3), inp["timesteps"], inp["y"], inp["guidance"])
        lat = model.forward_latent(**inp)
    assert torch.equal(lat[0, :, 0:2, 2:4], tok[0, 1].reshape(16, 2, 2))  # token (row 0, col 1)
    assert torch.equal(lat[0, :, 2:4, 4:6], tok[0, 5].reshape(16, 2, 2))  # token (row 1, col 2)


def test_checkpoint_round_trip_identical(tiny_path, tmp_path):
    from tightrope.demo.tiny_checkpoint import init_tiny_weights_
    fresh = init_tiny_weights_(Flux(FluxParams.tiny()), seed=0)
    loaded = load_reference_flux(tiny_path, FluxParams.tiny())
    assert read_params(tiny_path) == FluxParams.tiny()
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    inp = inputs(FluxParams.tiny())
    with torch.no_grad():
        assert torch.equal(fresh.forward_latent(**inp), loaded.forward_latent(**inp))
    assert not [f for f in os.listdir(os.path.dirname(tiny_path)) if f.startswith(".tmp-")]  # no temp leftovers


def test_seed_determinism(tmp_path):
    a = make_tiny_checkpoint(tmp_path / "a.safetensors", seed=7)
    b = make_tiny_checkpoint(tmp_path / "b.safetensors", seed=7)
    c = make_tiny_checkpoint(tmp_path / "c.safetensors", seed=8)
    assert open(a, "rb").read() == open(b, "rb").read()
    sa, sc = load_reference_flux(a).state_dict(), load_reference_flux(c).state_dict()
    assert not torch.equal(sa["img_in.weight"], sc["img_in.weight"])


def test_bf16_checkpoint(tmp_path):
    model = load_reference_flux(make_tiny_checkpoint(tmp_path / "bf16.safetensors", dtype=torch.bfloat16))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    inp = {k: (v.bfloat16() if k in ("x", "context", "y") else v) for k, v in inputs(model.params).items()}
    with torch.no_grad():
        assert model.forward_latent(**inp).dtype == torch.bfloat16


def test_load_mismatch_names_file(tiny_path):
    wrong = FluxParams(vec_in_dim=32, context_in_dim=64, hidden_size=128, num_heads=1, depth=3,
                       depth_single_blocks=2, axes_dim=(16, 56, 56), guidance_embed=False)
    with pytest.raises(ValueError, match="tiny_flux.safetensors") as e:
        load_reference_flux(tiny_path, wrong)
    assert "double_blocks.2." in str(e.value) and "guidance_in." in str(e.value)


def test_guidance_required_for_dev_style_model(tiny_path):
    model = load_reference_flux(tiny_path)
    inp = inputs(model.params)
    inp["guidance"] = None
    with pytest.raises(ValueError, match="guidance"):
        model.forward_latent(**inp)


def test_gradients_reach_every_parameter(tiny_path):
    model = load_reference_flux(tiny_path)
    model.forward_latent(**inputs(model.params)).square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_blocks_are_called_with_keywords(tiny_path):
    """The memory runtime wraps block.forward and relies on these call shapes."""
    model = load_reference_flux(tiny_path)
    seen = []
    for kind in ("double_blocks", "single_blocks"):
        for block in getattr(model, kind):
            orig = block.forward

            def wrapped(*args, _orig=orig, _kind=kind, **kwargs):
                seen.append((_kind, len(args), tuple(sorted(kwargs))))
                return _orig(*args, **kwargs)
            block.forward = wrapped
    with torch.no_grad():
        model.forward_latent(**inputs(model.params))
    assert seen == [("double_blocks", 0, ("img", "pe", "txt", "vec"))] * 2 + [("single_blocks", 1, ("pe", "vec"))] * 2
