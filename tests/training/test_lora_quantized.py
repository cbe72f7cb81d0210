"""LoRA on a layer that is no torch Linear, marked as a quantized Linear (what training/models/comfy.py does with
ComfyUI's mixed-precision layers): peft's LoRA Linear goes on it through peft's custom-module dispatch, its base
output is the layer's own forward, only plain LoRA is accepted. The layer here is a stand-in in plain PyTorch (fp8
bytes and a per-tensor scale, dequantized in forward); tests/integration/test_comfy_scaled_fp8.py runs ComfyUI's."""
import pytest
import torch
from torch import nn

from tightrope.training.lora.files import load_lora_file_into, save_lora
from tightrope.training.lora.layers import LoraSpec, inject_lora, lora_layers, lora_parameters, remove_lora
from tightrope.training.lora.targets import LoraError, mark_quantized_linear


class Fp8Linear(nn.Module):
    """Like ComfyUI's mixed-precision Linear: a torch Module (not nn.Linear) with fp8 weight bytes and a scale.
    (peft finds in/out features by the class name 'Linear' or these attributes; with another name it warns.)"""

    def __init__(self, n_in, n_out, g):
        super().__init__()
        self.in_features, self.out_features = n_in, n_out
        w = torch.randn(n_out, n_in, generator=g) / n_in ** 0.5
        scale = w.abs().max() / 448.0
        self.qdata = nn.Parameter((w / scale).to(torch.float8_e4m3fn), requires_grad=False)
        self.scale = nn.Parameter(scale.reshape(()), requires_grad=False)
        self.bias = nn.Parameter(0.02 * torch.randn(n_out, generator=g), requires_grad=False)

    def forward(self, x):
        return nn.functional.linear(x, self.qdata.to(x.dtype) * self.scale.to(x.dtype), self.bias.to(x.dtype))


class Block(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.attn = nn.Module()
        self.attn.qkv = Fp8Linear(16, 48, g)
        self.attn.proj = nn.Linear(16, 16)


class Model(nn.Module):
    def __init__(self, marked=True):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.blocks = nn.ModuleList([Block(g) for _ in range(2)])
        if marked:
            for b in self.blocks:
                mark_quantized_linear(b.attn.qkv, "float8_e4m3fn")


pytestmark = pytest.mark.filterwarnings("ignore:Unsupported layer type")
REGEX = r"blocks\.\d+\.attn\.(qkv|proj)"


def test_lora_on_a_marked_quantized_layer_adds_to_its_own_forward():
    """Output = the layer's own forward + scale * B(A(x)), exactly peft's sum: the reference is the dequantized
    weight (qdata.float() * scale) @ x + bias + scale * B(A(x)) in fp32, the same ops in the same order, so the
    bound is fp32 rounding of one matmul of width 16 (1e-6 on outputs of size ~1)."""
    model = Model()
    spec = LoraSpec(rank=4, alpha=2.0, target_regex=REGEX)
    names = inject_lora(model, spec, "flux")
    assert names == ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.1.attn.qkv", "blocks.1.attn.proj"]
    layer = model.blocks[0].attn.qkv
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.normal_(0, 0.1)
    x = torch.randn(3, 5, 16, requires_grad=True)
    out = layer(x)
    base = layer.base_layer
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    w = base.qdata.float() * base.scale
    reference = x @ w.T + base.bias + spec.scale * (x @ a.T) @ b.T
    assert (out - reference).abs().max().item() <= 1e-6
    out.square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0  # the gradient flows through the base to the input
    assert not any(p.requires_grad for p in base.parameters())  # the quantized weight gets no gradient
    assert a.grad is not None and b.grad is not None
    assert all(p.dtype == torch.float32 for p in lora_parameters(model).values())


def test_the_saved_file_names_the_quantized_layers_and_loads_back(tmp_path):
    model = Model()
    spec = LoraSpec(rank=4, target_regex=REGEX)
    inject_lora(model, spec, "flux")
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.normal_(0, 0.1)
    path = save_lora(tmp_path, "q", model, spec, metadata={})
    from safetensors.torch import load_file
    keys = set(load_file(path))
    assert "diffusion_model.blocks.0.attn.qkv.lora_A.weight" in keys
    assert "diffusion_model.blocks.1.attn.qkv.alpha" in keys
    other = Model()
    inject_lora(other, spec, "flux")
    assert load_lora_file_into(other, path) == 4
    for k, p in lora_parameters(model).items():
        assert torch.equal(p, lora_parameters(other)[k])
    remove_lora(other)
    assert not lora_layers(other) and type(other.blocks[0].attn.qkv) is Fp8Linear


@pytest.mark.parametrize("algorithm,words", [
    ("dora", ("algorithm='dora' reads the base weight", "'blocks.0.attn.qkv'", "float8_e4m3fn",
              "use algorithm 'lora'")),
    ("loha", ("algorithm='loha' has no peft layer", "'blocks.0.attn.qkv'", "use algorithm 'lora'")),
    ("lokr", ("algorithm='lokr' has no peft layer", "use algorithm 'lora'")),
])
def test_other_algorithms_on_a_quantized_layer_are_refused(algorithm, words):
    model = Model()
    with pytest.raises(LoraError) as e:
        inject_lora(model, LoraSpec(rank=4, algorithm=algorithm, target_regex=REGEX), "flux")
    for w in words:
        assert w in str(e.value)
    assert not lora_layers(model)  # refused before anything changed
    assert all(p.requires_grad for p in model.blocks[0].attn.proj.parameters())


def test_an_unmarked_layer_of_another_class_is_still_refused():
    """Without the model adapter's mark, a layer that is no torch Linear is no LoRA target (the message says so)."""
    model = Model(marked=False)
    with pytest.raises(LoraError, match=r"matches 'blocks.0.attn.qkv', a Fp8Linear: LoRA goes on Linear layers only"):
        inject_lora(model, LoraSpec(rank=4, target_regex=REGEX), "flux")
