"""Memory from shapes: fake tensors count what real tensors take, live bytes are per storage, and the CUDA autocast
policy for layer_norm is scoped."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from tightrope.memory.shape_profile import LiveBytes, cuda_autocast_policy, fake_parameters, measure_block
from tightrope.training.models.reference_flux import DoubleStreamBlock, FluxParams, SingleStreamBlock


def test_live_bytes_count_each_storage_once():
    live = LiveBytes()
    with live:
        a = torch.ones(1000)            # 4000 bytes
        view = a[:10].view(2, 5)        # a view: nothing new
        a.add_(1)                       # in place: nothing new
        b = a * 2                       # 4000 more
        assert (live.live, live.peak) == (8000, 8000)
        del b
        assert live.live == 4000 and view.numel() == 10
    assert live.peak == 8000


def test_cuda_autocast_policy_is_scoped():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.layer_norm(x, (8,)).dtype == torch.bfloat16  # CPU autocast's own policy
        with cuda_autocast_policy():
            assert F.layer_norm(x, (8,)).dtype == torch.float32  # as CUDA autocast runs it
        assert F.layer_norm(x, (8,)).dtype == torch.bfloat16  # restored


def _inputs(kind, p, tokens, make):
    h, txt = p.hidden_size, 16
    vec, pe = make(2, h, dtype=torch.bfloat16), make(2, 1, tokens + txt, p.head_dim // 2, 2, 2)
    if kind is DoubleStreamBlock:
        return (), {"img": make(2, tokens, h, dtype=torch.bfloat16).requires_grad_(),
                    "txt": make(2, txt, h, dtype=torch.bfloat16).requires_grad_(), "vec": vec, "pe": pe}
    return (make(2, tokens + txt, h, dtype=torch.bfloat16).requires_grad_(),), {"vec": vec, "pe": pe}


@pytest.mark.parametrize("kind", [DoubleStreamBlock, SingleStreamBlock])
def test_fake_tensors_count_what_real_ones_take(kind):
    """The same block, forward + backward on fake tensors and on real CPU tensors: the same saved bytes, live-bytes
    peak and FLOPs, so only the device's kernels (shape_profile docstring) separate the figures from a CUDA run."""
    p = FluxParams.tiny()
    args = (p.hidden_size, p.num_heads, p.mlp_ratio) if kind is DoubleStreamBlock else (p.hidden_size, p.num_heads)
    torch.manual_seed(0)
    real_block = kind(*args).to(torch.bfloat16)
    real = measure_block(real_block, *_inputs(kind, p, 64, torch.randn), list(real_block.parameters()),
                         contextlib.nullcontext(), compute_dtype=torch.bfloat16)
    with torch.device("meta"):
        meta_block = kind(*args).to(torch.bfloat16)
    mode = FakeTensorMode()
    fake_parameters(meta_block, mode)
    with mode:
        args_kwargs = _inputs(kind, p, 64, torch.empty)
    fake = measure_block(meta_block, *args_kwargs, list(meta_block.parameters()), mode, compute_dtype=torch.bfloat16)
    assert fake == real
    # the block saves far more than its inputs, and its peak exceeds what it saves (gradients come on top)
    assert real.saved > 4 * real.inputs and real.peak > real.saved and real.fwd_flops > 0 and real.bwd_flops > 0
