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

from comfy_env import COMFYUI_DIR, REPO, needs_comfyui

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
