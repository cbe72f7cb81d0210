"""The token-chunked forwards of ComfyUI's Flux DoubleStreamBlock and SingleStreamBlock
(training/models/comfy_flux_chunks.py) against the blocks' own forwards, in ComfyUI's python (a subprocess running
flux_chunks_runner.py once; every test reads its result): outputs and the gradients of every input and parameter,
LoRA gradients, the calls handed to the plain forward, fp16 clamping, the registry after the adapter wraps a MODEL,
and a whole tiny Flux with every block chunked.

Tolerance (fp32): a chunk runs the block's own ops on a subset of the tokens; rows of a matmul are independent, so
the only differences are rounding: the BLAS kernel chosen for fewer rows may block the feature reduction otherwise,
and a parameter's gradient sums the chunks' contributions in another order. Measured: at most 1.4e-6 of the
largest value (about 12 fp32 ulps); 1e-5 leaves room for another CPU's kernels, while a wrong token offset, pe
slice, gate or residual gives errors of order 1. With one chunk the shapes and ops are the block's own: bit-equal,
but for the single block's linear1 weight gradient, summed from two matmuls (qkv and MLP columns; 1e-7 measured).
"""
import json
import os
import subprocess

import pytest

from comfy_env import COMFYUI_DIR, REPO, needs_comfyui, run_in_comfyui, tightrope_env

pytestmark = needs_comfyui
HERE = os.path.dirname(__file__)
RTOL = 1e-5  # see the module docstring

# runner case -> number of gradients compared (inputs img, txt, vec, pe / x, vec, pe, plus the parameters)
CASES = {**{f"{kind} chunks={n}": grads for kind, grads in (("double", 28), ("single", 11)) for n in (1, 3, 16)},
         "double no pe chunks=3": 27, "single no pe chunks=3": 10,  # no pe: one input gradient fewer
         "double mlp_silu_act chunks=3": 24, "single mlp_silu_act chunks=3": 11, "double yak_mlp chunks=3": 32,
         "double global modulation chunks=3": 24, "single global modulation chunks=3": 9,
         "double lora chunks=3": 24, "single lora chunks=3": 9,  # LoRA: 10 / 3 layers x (A, B) + the inputs
         "single dora chunks=3": 12,  # DoRA: 3 layers x (A, B, magnitude) + the inputs
         "single manual_cast weight_function chunks=3": 11}
FALLBACKS = ("double attn_mask", "double attn1_patch", "double attn1_output_patch", "double modulation_dims_img",
             "double pe of another length", "double unknown keyword", "single attn_mask", "single attn1_patch",
             "single modulation_dims", "single yak_mlp")


@pytest.fixture(scope="module")
def result(tmp_path_factory, comfyui_python):
    from tightrope.demo.tiny_checkpoint import make_tiny_checkpoint
    tmp = tmp_path_factory.mktemp("flux_chunks")
    ckpt = make_tiny_checkpoint(tmp / "tiny_flux.safetensors", seed=3)
    (tmp / "packages").mkdir()
    (tmp / "packages" / "tightrope").symlink_to(REPO, target_is_directory=True)
    proc = subprocess.run([comfyui_python, os.path.join(HERE, "flux_chunks_runner.py"), os.path.abspath(COMFYUI_DIR),
                           str(tmp / "packages"), ckpt], capture_output=True, text=True, timeout=600, cwd=tmp)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"runner failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("case", CASES)
def test_chunked_block_matches_its_own_forward(result, case):
    r = result["blocks"][case]
    print(f"\n{case}: {r}")
    assert r["plain_calls"] == 0 and r["missing_grads"] == [] and r["n_grads"] == CASES[case]
    assert r["unchanged"], "the chunked forward changed its inputs"
    # the single block's linear1 by weight rows (ComfyUI's Linear, its cast path, a LoRA on it), except a DoRA
    assert (r["whole_layers"] > 0) == (case == "single dora chunks=3")
    if case.endswith("chunks=1"):  # the block's own ops: bit-equal, except the single block's gradients through
        # linear1, whose qkv columns (pass 2) and MLP columns (pass 4) are two matmuls
        assert r["out_err"] == 0 and (r["grad_rel"] == 0 or case.startswith("single") and r["grad_rel"] <= RTOL)
    else:
        assert r["out_err"] <= RTOL * r["out_scale"] and r["grad_rel"] <= RTOL


@pytest.mark.parametrize("case", FALLBACKS)
def test_unsupported_calls_go_to_the_plain_forward(result, case):
    """ctx.plain gets exactly the caller's arguments (the same objects) and its result is returned; nothing changed."""
    assert result["fallbacks"][case] == {"plain": True, "unchanged": True}


def test_the_chunked_single_block_computes_linear1_once(result):
    """Forward FLOPs of the single block with a rank-4 LoRA on every Linear: each chunked pass computes only its own
    columns of linear1 (qkv in pass 2, MLP in pass 4), so the chunked forward does the block's own work plus one
    more product with linear1's LoRA A factor (2 r hidden per token), where linear1 whole in both passes would add
    2 x hidden x 7 hidden per token. Attention, modulation and linear2 run the same either way."""
    r = result["single_flops"]
    assert r["chunked"] == r["plain"] + r["lora_a_once_more"], r


def test_fp16_outputs_are_clamped_as_the_blocks_do(result):
    for kind, r in result["fp16"].items():
        assert r["dtypes"] == ["torch.float16"] and r["finite"] and r["clamped"] > 0, kind
        assert r["rel_err"] <= 2 ** -10, kind  # one fp16 ulp (relative): an intermediate rounded otherwise


def test_the_adapter_registers_the_chunked_forwards(result):
    """Nothing before a Flux MODEL is wrapped; ComfyUI's block classes map to ours after; a second wrap and a second
    registration change nothing."""
    r = result["registration"]
    assert r["before"] == [None, None]
    assert r["after"] == r["again"] == ["chunked_double_stream", "chunked_single_stream"]


def test_a_whole_flux_with_chunked_blocks_matches(result):
    """The tiny Flux MODEL through the adapter's predict(), every block called by ComfyUI's Flux.forward_orig and
    routed to its registered chunked forward: the velocity and the gradients of all 52 LoRA tensors; the same under
    the memory runtime (every block its own checkpoint, whose recompute skips the output chunks; poisoned slots)."""
    r = result["whole_model"]
    print(f"\n{r}")
    assert r["n_lora"] == 52 and r["whole_layers"] == 0
    assert r["skipped_output_chunks"] > 0  # the runtime's block recompute did skip output chunks
    for way in ("chunked", "runtime"):
        assert r[f"{way}_out_err"] <= RTOL * r["out_scale"] and r[f"{way}_grad_rel"] <= RTOL, way


WHOLE_SEQUENCE_OPS = """
    import collections
    import comfy.ops
    from comfy.ldm.flux.layers import DoubleStreamBlock, EmbedND, SingleStreamBlock
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from tightrope.memory.token_chunks import ChunkContext
    from tightrope.training.models import comfy_flux_chunks as cfc

    # 28 text and 40 image tokens, 68 in all: no other dimension here (1, 2, 4, 8, 16, 64, 192, 256, 320, 448) nor
    # any chunk of 2 or 8 chunks equals one of these, and the text is cut at both counts (2 and 6 chunks)
    N_TXT, N_IMG, HIDDEN, HEADS = 28, 40, 64, 4
    mm.in_training = True  # ComfyUI's autograd-safe RoPE, as in training


    class WholeSequenceOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.wide_inputs = collections.Counter(), 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            whole = {N_TXT, N_IMG, N_TXT + N_IMG}
            self.ops.update(str(func) for t in tree_leaves(out)
                            if isinstance(t, torch.Tensor) and whole.intersection(t.shape))
            if func is torch.ops.aten.cat.default and whole.intersection(out.shape):  # views into larger buffers
                self.wide_inputs += sum(t.untyped_storage().nbytes() > t.numel() * t.element_size() for t in args[0])
            return out


    def count(kind, chunks):
        torch.manual_seed(0)
        ops = comfy.ops.disable_weight_init
        block = DoubleStreamBlock(HIDDEN, HEADS, 4.0, qkv_bias=True, operations=ops) if kind == "double" else \\
            SingleStreamBlock(HIDDEN, HEADS, 4.0, operations=ops)
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(0.1 * torch.randn_like(p))
        ids = torch.randint(0, 8, (1, N_TXT + N_IMG, 3)).float()
        kw = {"vec": torch.randn(1, HIDDEN, requires_grad=True), "pe": EmbedND(HIDDEN // HEADS, 10000, [4, 6, 6])(ids)}
        ctx = ChunkContext(chunks)
        if kind == "double":
            img, txt = (torch.randn(1, n, HIDDEN, requires_grad=True) for n in (N_IMG, N_TXT))
            outs = cfc.chunked_double_stream(block, ctx, img=img, txt=txt, **kw)
        else:
            outs = (cfc.chunked_single_stream(block, ctx, torch.randn(1, N_TXT + N_IMG, HIDDEN, requires_grad=True),
                                              **kw),)
        loss = sum(o.sum() for o in outs)
        with WholeSequenceOps() as counted:
            loss.backward()
        return {"ops": dict(counted.ops), "wide_inputs": counted.wide_inputs}


    result({kind: {chunks: count(kind, chunks) for chunks in (2, 8)} for kind in ("double", "single")})
"""


def test_a_chunked_blocks_backward_does_no_more_whole_sequence_work_with_more_chunks(tmp_path):
    """As for the reference Flux (tests/training/test_reference_flux_chunks.py): a whole-sequence tensor read in
    chunks (the block's input, pe, attention's output) is cut by one split, not a slice per chunk, whose backward
    would zero-fill a whole-sequence gradient and add it into the tensor's (on a GPU ~5 % of a step at 8 chunks,
    growing with the count). The ops of one backward whose results span a whole stream or the sequence are as many
    at 8 chunks as at 2 (the slices made 118 vs 46 in the double block, 67 vs 31 in the single one), and what a
    split's backward concatenates are buffers of their own, not views keeping larger ones alive (own_grad: the
    single block's pieces of attention's output, concatenated with the MLP activation)."""
    r, _ = run_in_comfyui(tmp_path, WHOLE_SEQUENCE_OPS, env=tightrope_env(tmp_path))
    print(f"\n{r}")
    for kind, counts in r.items():
        two, eight = counts["2"], counts["8"]
        assert sum(eight["ops"].values()) == sum(two["ops"].values()), (kind, counts)
        assert "aten.slice_backward.default" not in eight["ops"], (kind, counts)
        assert two["wide_inputs"] == eight["wide_inputs"] == 0, (kind, counts)


NORMS_UNDER_CUDA_AUTOCAST = """
    import comfy.ops
    from comfy.ldm.flux.layers import DoubleStreamBlock, EmbedND
    from torch import nn
    from tightrope.memory.shape_profile import cuda_autocast_policy
    from tightrope.training.models import comfy as adapter

    N_TXT, N_IMG, HIDDEN, HEADS = 12, 20, 64, 4
    mm.in_training = True


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            block = DoubleStreamBlock(HIDDEN, HEADS, 4.0, qkv_bias=True, operations=comfy.ops.disable_weight_init)
            with torch.no_grad():
                for p in block.parameters():
                    p.copy_(0.1 * torch.randn_like(p))
            self.double_blocks = nn.ModuleList([block.to(torch.bfloat16)])


    def run(fast):
        model = Model()
        adapter._guard_in_place_residuals(model)
        if not fast:  # today's guard without the input-keeping norm: every norm a native one on a copy
            adapter.upcasts = lambda x: False
        g = torch.Generator().manual_seed(1)
        img, txt = (torch.randn(1, n, HIDDEN, generator=g).to(torch.bfloat16).requires_grad_() for n in (N_IMG, N_TXT))
        vec = torch.randn(1, HIDDEN, generator=g).to(torch.bfloat16)
        pe = EmbedND(HIDDEN // HEADS, 10000, [4, 6, 6])(torch.randint(0, 8, (1, N_TXT + N_IMG, 3)).float())
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                # copies in: the block adds to its inputs in place (as checkpointing hands it its own)
                out_img, out_txt = model.double_blocks[0](img=img.clone(), txt=txt.clone(), vec=vec, pe=pe)
            (out_img.float().square().sum() + out_txt.float().square().sum()).backward()
        return sum(seen.values()), [img.grad, txt.grad]

    fast_bytes, fast = run(True)
    native_bytes, native = run(False)
    result({"saved_less": native_bytes - fast_bytes, "img": N_IMG * HIDDEN, "txt": N_TXT * HIDDEN,
            "max_rel": max(float(((a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-2)).max())
                           for a, b in zip(fast, native)),
            "equal_share": min(float((a == b).float().mean()) for a, b in zip(fast, native))})
"""


def test_comfyuis_flux_norms_keep_their_bf16_input_under_cuda_autocast(tmp_path):
    """ComfyUI's Flux double block under CUDA's autocast rule for layer_norm (fp32), with the adapter's norm guard:
    each of its 4 non-affine LayerNorms saves the bf16 copy of its input, not an fp32 cast of it (memory/norms.py):
    2 bytes an element less, for img_norm1/2 and txt_norm1/2; the gradients are the native ones up to bf16 rounding
    of the same fp32 values (most bitwise equal, the rest one bf16 ulp, 2^-8 relative, apart)."""
    r, _ = run_in_comfyui(tmp_path, NORMS_UNDER_CUDA_AUTOCAST, env=tightrope_env(tmp_path))
    assert r["saved_less"] == 2 * 2 * (r["img"] + r["txt"]), r
    assert r["max_rel"] <= 2 ** -7 and r["equal_share"] > 0.9, r
