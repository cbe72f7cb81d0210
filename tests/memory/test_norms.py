"""A non-affine layer norm that keeps its bf16 input for backward where autocast computes it in fp32
(memory/norms.py). CUDA autocast's fp32 layer_norm is reproduced on the CPU by shape_profile.cuda_autocast_policy
(the policy the shape-only profile runs under), so the path CUDA takes runs here."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tightrope.memory.norms import LayerNorm, layer_norm, upcasts
from tightrope.memory.shape_profile import cuda_autocast_policy
from tightrope.training.models.reference_flux import SingleStreamBlock

BF16 = torch.bfloat16


def _cuda_like_autocast():
    """CPU autocast in bf16 with CUDA's rule for layer_norm (fp32)."""
    policy, autocast = cuda_autocast_policy(), torch.autocast("cpu", dtype=BF16)

    class Both:
        def __enter__(self):
            policy.__enter__()
            autocast.__enter__()

        def __exit__(self, *exc):
            autocast.__exit__(*exc)
            policy.__exit__(*exc)
    return Both()


def _saved_bytes(fn, *inputs) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages autograd saves while fn runs, and fn's output."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    return sum(seen.values()), out


def _x(shape=(2, 64, 256), seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3 + 1).to(BF16).requires_grad_()


def test_where_autocast_computes_it_in_fp32_it_keeps_the_bf16_input_not_the_fp32_copy():
    x = _x()
    with _cuda_like_autocast():
        assert upcasts(x)
        native, y_native = _saved_bytes(lambda t: F.layer_norm(t, (256,), eps=1e-6), x)
        ours, y = _saved_bytes(lambda t: layer_norm(t, (256,), eps=1e-6), x)
    # native: the fp32 cast (4 B per element) + mean and rstd (fp32, one per row); ours: x (2 B) + mean and rstd
    rows = 2 * 64
    assert native == x.numel() * 4 + 2 * rows * 4 and ours == x.numel() * 2 + 2 * rows * 4
    assert y.dtype == y_native.dtype == torch.float32 and torch.equal(y, y_native)  # the native forward, bitwise


def test_its_gradient_is_the_native_ones():
    """Both gradients are the fp32 gradient rounded to x's bf16: each within half a bf16 ulp (2^-9 relative) of an
    fp64 reference, up to the fp32 arithmetic (~1e-6 relative); 2^-8 leaves twice that margin, while a dropped term
    of the formula is off by O(1) (checked)."""
    x = _x()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    xd = x.detach().double().requires_grad_()
    reference = torch.autograd.grad(F.layer_norm(xd, (256,), eps=1e-6), xd, dy.double())[0]
    grads = {}
    with _cuda_like_autocast():
        for name, fn in (("native", F.layer_norm), ("ours", layer_norm)):
            grads[name] = torch.autograd.grad(fn(x, (256,), eps=1e-6), x, dy)[0]
    for g in grads.values():
        assert g.dtype == BF16
        torch.testing.assert_close(g.double(), reference, rtol=2 ** -8, atol=1e-6)
    assert (grads["ours"] == grads["native"]).float().mean() > 0.99  # mostly the very same bf16 values
    # the control: without its projection term the gradient is far off
    xd64 = x.detach().double()
    rstd = torch.rsqrt(xd64.var(-1, unbiased=False, keepdim=True) + 1e-6)
    wrong = rstd * (dy.double() - dy.double().mean(-1, keepdim=True))
    assert not torch.allclose(wrong, reference, rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("case", ["fp32", "cpu autocast", "no grad"])
def test_elsewhere_it_is_the_native_op(case):
    x = _x().float().detach().requires_grad_() if case == "fp32" else _x()
    ctx = torch.autocast("cpu", dtype=BF16) if case == "cpu autocast" else torch.no_grad() if case == "no grad" \
        else torch.autocast("cpu", enabled=False)
    with ctx:
        assert not (upcasts(x) and torch.is_grad_enabled())
        y = layer_norm(x, (256,), eps=1e-6)
        assert torch.equal(y, F.layer_norm(x, (256,), eps=1e-6))
    assert y.grad_fn is None or "NativeLayerNorm" in type(y.grad_fn).__name__


def test_the_module_keeps_the_native_modules_keys_and_affine_norms_stay_native():
    plain, affine = LayerNorm(256, elementwise_affine=False, eps=1e-6), LayerNorm(256)
    assert isinstance(plain, nn.LayerNorm) and not plain.state_dict()
    assert affine.state_dict().keys() == nn.LayerNorm(256).state_dict().keys()
    x = _x()
    with _cuda_like_autocast():
        assert "KeepingInput" in type(plain(x).grad_fn).__name__
        assert "KeepingInput" not in type(affine(x).grad_fn).__name__


def test_a_reference_flux_single_block_saves_half_its_normalised_inputs_bytes_less():
    """Under CUDA-like autocast the single block's pre_norm kept an fp32 copy of its bf16 input x; now it keeps x:
    x.numel() * 2 bytes less (nothing else saves x: the residual add keeps nothing)."""
    torch.manual_seed(0)
    block = SingleStreamBlock(hidden_size=256, num_heads=2).to(BF16)
    x = _x((1, 32, 256))
    vec = torch.randn(1, 256).to(BF16)
    pe = torch.randn(1, 1, 32, 64, 2, 2)

    def saved():
        with _cuda_like_autocast():
            return _saved_bytes(lambda t: block(t, vec=vec, pe=pe), x)[0]
    ours = saved()
    block.pre_norm = nn.LayerNorm(256, elementwise_affine=False, eps=1e-6)
    assert saved() - ours == x.numel() * 2
