"""Runs in ComfyUI's python (test_comfy_flux_chunks.py): the token-chunked forwards of ComfyUI's Flux blocks
against the blocks' own forwards, fp32 on the CPU. Prints one line `RESULT {json}` of measured errors and facts; the
test asserts on them.

    python flux_chunks_runner.py COMFYUI_DIR PACKAGES TINY_FLUX_CHECKPOINT
"""
import contextlib
import json
import sys

comfy_dir, packages, ckpt = sys.argv[1:4]
sys.path[:0] = [comfy_dir, packages]

import torch  # noqa: E402
from torch import nn  # noqa: E402
from comfy.cli_args import args  # noqa: E402

args.cpu = True
import comfy.model_management as mm  # noqa: E402
import comfy.ops  # noqa: E402
import comfy.sd  # noqa: E402
from comfy.ldm.flux.layers import DoubleStreamBlock, EmbedND, Modulation, SingleStreamBlock  # noqa: E402

from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from tightrope.memory import runtime as runtime_module  # noqa: E402
from tightrope.memory.runtime import MemoryRuntime  # noqa: E402
from tightrope.memory.strategy import Strategy  # noqa: E402
from tightrope.memory.token_chunks import ChunkContext, chunked_forward_for, recompute_region  # noqa: E402
from tightrope.training.lora import linear_columns  # noqa: E402
from tightrope.training.lora.layers import LoraSpec, inject_lora, lora_parameters  # noqa: E402
from tightrope.training.models import comfy_flux_chunks as cfc  # noqa: E402
from tightrope.training.models.comfy import ComfyModelAdapter, _guard_in_place_residuals  # noqa: E402

HIDDEN, HEADS, B, N_TXT, N_IMG = 64, 4, 2, 5, 10  # head dim 16; 15 tokens: 3 chunks do not divide either stream
out = {}
whole_layers = []  # linear_columns' fallbacks: a layer run whole, then sliced
_full_columns = linear_columns.full_columns
linear_columns.full_columns = lambda *a: whole_layers.append(1) or _full_columns(*a)


def blocks(ops=comfy.ops.disable_weight_init, **variant):
    """A double and a single block with random weights, in a holder laid out like Flux (the LoRA presets and the
    adapter's in-place-residual guard find them there, as in training). `ops`: ComfyUI's layers, left
    uninitialised (filled below)."""
    torch.manual_seed(0)
    holder = nn.Module()
    single_variant = {k: v for k, v in variant.items() if k != "proj_bias"}
    holder.double_blocks = nn.ModuleList([DoubleStreamBlock(HIDDEN, HEADS, 4.0, qkv_bias=True, operations=ops,
                                                            **variant)])
    holder.single_blocks = nn.ModuleList([SingleStreamBlock(HIDDEN, HEADS, 4.0, operations=ops, **single_variant)])
    with torch.no_grad():
        for name, p in holder.named_parameters():
            if name.endswith("_norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.ndim == 2:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
            else:
                p.copy_(0.1 * torch.randn_like(p))
    _guard_in_place_residuals(holder)
    return holder


def inputs(with_pe=True):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8, (B, N_TXT + N_IMG, 3), generator=g).float()
    pe = EmbedND(HIDDEN // HEADS, 10000, [4, 6, 6])(ids) if with_pe else None
    return {"img": torch.randn(B, N_IMG, HIDDEN, generator=g), "txt": torch.randn(B, N_TXT, HIDDEN, generator=g),
            "vec": torch.randn(B, HIDDEN, generator=g), "pe": pe}


def call(kind, fn, t, transformer_options, global_mod=None):
    """The block called as comfy/ldm/flux/model.py calls it (keywords; the single block's x positional). With
    `global_mod` (Modulation modules img, txt, single), vec is modulated outside the blocks, as Flux does with
    params.global_modulation for blocks built with modulation=False."""
    vec = t["vec"]
    if kind == "double":
        if global_mod:
            vec = (global_mod[0](vec), global_mod[1](vec))
        return fn(img=t["img"], txt=t["txt"], vec=vec, pe=t["pe"], attn_mask=None,
                  transformer_options=transformer_options)
    if global_mod:
        vec = global_mod[2](vec)[0]
    return fn(t["x"], vec=vec, pe=t["pe"], attn_mask=None, transformer_options=transformer_options)


def forward_backward(kind, fn, t, params, global_mod):
    """Outputs, and the gradients of every input and of `params` for a fixed random weighting of the outputs. The
    inputs are handed over as copies, which are checked unchanged (values and autograd version counters)."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in t.items() if v is not None}
    given = {k: (leaves[k].clone() if k in leaves else None) for k in t}
    versions = {k: v._version for k, v in given.items() if v is not None}
    for p in params.values():
        p.grad = None
    outs = call(kind, fn, given, {"block_type": kind, "block_index": 0}, global_mod)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(2)
    sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs).backward()
    unchanged = all(given[k]._version == versions[k] and torch.equal(given[k], leaves[k]) for k in versions)
    grads = {f"input.{k}": v.grad for k, v in leaves.items()}
    grads.update({k: p.grad for k, p in params.items()})
    return [o.detach() for o in outs], grads, unchanged


def compare(kind, holder, t, chunks, params=None, global_mod=None):
    block = (holder.double_blocks if kind == "double" else holder.single_blocks)[0]
    params = params if params is not None else dict(block.named_parameters())
    if kind == "single":
        t = {"x": torch.cat((t["txt"], t["img"]), 1), "vec": t["vec"], "pe": t["pe"]}
    ref_out, ref_grads, _ = forward_backward(kind, block, t, params, global_mod)
    plain_calls = []
    whole_layers.clear()
    ctx = ChunkContext(chunks=chunks, run=recompute_region, plain=lambda *a, **k: plain_calls.append(1))
    fn = cfc.chunked_double_stream if kind == "double" else cfc.chunked_single_stream
    outs, grads, unchanged = forward_backward(kind, lambda *a, **k: fn(block, ctx, *a, **k), t, params, global_mod)
    missing = sorted(k for k in ref_grads if (ref_grads[k] is None) != (grads[k] is None))
    rel = {k: ((grads[k] - g).abs().max() / g.abs().max()).item() for k, g in ref_grads.items()
           if g is not None and grads[k] is not None}
    return {"out_err": max((o - r).abs().max().item() for o, r in zip(outs, ref_out)),
            "out_scale": min(r.abs().max().item() for r in ref_out), "grad_rel": max(rel.values()),
            "n_grads": len(rel), "missing_grads": missing, "unchanged": unchanged, "plain_calls": len(plain_calls),
            "whole_layers": len(whole_layers)}


def single_flops(rank=4):
    """Forward FLOPs of the single block with a rank-`rank` LoRA on every Linear, its own forward vs chunked."""
    holder = blocks()
    inject_lora(holder, LoraSpec(rank=rank, targets="all_linear"), "flux")
    block, t = holder.single_blocks[0], inputs()
    x = torch.cat((t["txt"], t["img"]), 1).requires_grad_(True)
    ctx = ChunkContext(chunks=3, run=recompute_region, plain=None)
    counts = []
    for fn in (block, lambda *a, **k: cfc.chunked_single_stream(block, ctx, *a, **k)):
        with FlopCounterMode(display=False) as counter:
            fn(x.clone(), vec=t["vec"], pe=t["pe"], attn_mask=None, transformer_options={})  # residual added in place
        counts.append(counter.get_total_flops())
    return {"plain": counts[0], "chunked": counts[1], "lora_a_once_more": 2 * x.shape[0] * x.shape[1] * rank * HIDDEN}


def fallbacks():
    """Calls the chunked forwards must hand to ctx.plain, with exactly the caller's arguments."""
    holder = blocks()
    double, single = holder.double_blocks[0], holder.single_blocks[0]
    yak = blocks(yak_mlp=True).single_blocks[0]
    t = inputs()
    x = torch.cat((t["txt"], t["img"]), 1)
    mask = torch.zeros(N_TXT + N_IMG, N_TXT + N_IMG)
    patched = {"patches": {"attn1_patch": [lambda q, k, v, **kw: {}]}}
    out_patched = {"patches": {"attn1_output_patch": [lambda attn, extra: attn]}}
    short_pe = t["pe"][:, :, :-1]
    cases = {
        "double attn_mask": (double, (), dict(img=t["img"], txt=t["txt"], vec=t["vec"], pe=t["pe"], attn_mask=mask)),
        "double attn1_patch": (double, (t["img"], t["txt"], t["vec"], t["pe"]), dict(transformer_options=patched)),
        "double attn1_output_patch": (double, (), dict(img=t["img"], txt=t["txt"], vec=t["vec"], pe=t["pe"],
                                                       transformer_options=out_patched)),
        "double modulation_dims_img": (double, (), dict(img=t["img"], txt=t["txt"], vec=t["vec"], pe=t["pe"],
                                                        modulation_dims_img=[(0, N_IMG, 0)])),
        "double pe of another length": (double, (t["img"], t["txt"], t["vec"], short_pe), {}),
        "double unknown keyword": (double, (t["img"], t["txt"], t["vec"], t["pe"]), dict(new_option=1)),
        "single attn_mask": (single, (x, t["vec"], t["pe"], mask), {}),
        "single attn1_patch": (single, (x,), dict(vec=t["vec"], pe=t["pe"], transformer_options=patched)),
        "single modulation_dims": (single, (x,), dict(vec=t["vec"], pe=t["pe"], modulation_dims=[(0, 15, 0)])),
        "single yak_mlp": (yak, (x,), dict(vec=t["vec"], pe=t["pe"])),
    }
    result = {}
    for name, (block, a, k) in cases.items():
        seen = []
        sentinel = object()
        ctx = ChunkContext(chunks=3, plain=lambda *pa, **pk: seen.append((pa, pk)) or sentinel)
        fn = chunked_forward_for(block)
        copies = [v.clone() for v in (*a, *k.values()) if isinstance(v, torch.Tensor)]
        got = fn(block, ctx, *a, **k)
        same_args = len(seen) == 1 and len(seen[0][0]) == len(a) and all(u is w for u, w in zip(seen[0][0], a)) \
            and seen[0][1].keys() == k.keys() and all(seen[0][1][n] is k[n] for n in k)
        unchanged = all(torch.equal(c, v) for c, v in zip(copies, [v for v in (*a, *k.values())
                                                                      if isinstance(v, torch.Tensor)]))
        result[name] = {"plain": got is sentinel and same_args, "unchanged": unchanged}
    return result


def registration():
    """The registry before and after the adapter wraps a tiny Flux MODEL, and after a second wrap."""
    holder = blocks()
    before = [chunked_forward_for(holder.double_blocks[0]), chunked_forward_for(holder.single_blocks[0])]
    with torch.inference_mode():
        patcher = comfy.sd.load_diffusion_model(ckpt)
        ComfyModelAdapter(patcher)
        after = [chunked_forward_for(holder.double_blocks[0]), chunked_forward_for(holder.single_blocks[0])]
        ComfyModelAdapter(patcher)
        cfc.register_comfy_flux_chunks()
    again = [chunked_forward_for(holder.double_blocks[0]), chunked_forward_for(holder.single_blocks[0])]
    names = [[f.__name__ if f else None for f in fs] for fs in (before, after, again)]
    return {"before": names[0], "after": names[1], "again": names[2]}, patcher


def whole_model(patcher):
    """The tiny Flux MODEL through the adapter's predict(), every block routed through its registered chunked
    forward (as the memory runtime will call it) vs plain: output and LoRA gradients."""
    adapter = ComfyModelAdapter(patcher)
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(2, 16, 6, 8, generator=g), torch.tensor([0.3, 0.7])
    context, pooled = torch.randn(2, 7, 64, generator=g), torch.randn(2, 32, generator=g)
    with adapter.training_module() as module:
        inject_lora(module, LoraSpec(rank=4, targets="all_linear"), "flux")
        lora = lora_parameters(module)
        with torch.no_grad():
            for p in lora.values():
                p.normal_(0, 0.1)  # B too (peft starts it at zero, which would leave A's gradient zero)
        results = []
        whole_layers.clear()
        # plain; every block through its chunked forward; and under the memory runtime: each block its own checkpoint
        # (whose recompute skips the output chunks), weights streamed through poisoned slots, 3 chunks
        runtime = Strategy.of(compute_dtype="fp32", offload_fraction=1.0, checkpoint="all", token_chunks=3)
        stand_ins, real_stand_in = [], runtime_module.stand_in
        runtime_module.stand_in = lambda *a: stand_ins.append(1) or real_stand_in(*a)
        for way in ("plain", "chunked", "runtime"):
            for p in lora.values():
                p.grad = None
            blocks_ = [*module.double_blocks, *module.single_blocks]
            try:
                for b in blocks_ if way == "chunked" else []:
                    ctx = ChunkContext(chunks=3, plain=b.forward)
                    b.forward = (lambda b, ctx: lambda *a, **k: chunked_forward_for(b)(b, ctx, *a, **k))(b, ctx)
                with (MemoryRuntime(module, runtime, "cpu", poison_slots=True) if way == "runtime"
                      else contextlib.nullcontext()):
                    v = adapter.predict(module, x, t, context, pooled, 3.5)
                    (v * torch.randn(v.shape, generator=torch.Generator().manual_seed(4))).sum().backward()
            finally:
                for b in blocks_:
                    b.__dict__.pop("forward", None)
            results.append((v.detach(), {k: p.grad.clone() for k, p in lora.items()}))
    runtime_module.stand_in = real_stand_in
    (ref, ref_grads), *others = results
    out = {"out_scale": ref.abs().max().item(), "n_lora": len(ref_grads), "whole_layers": len(whole_layers),
           "skipped_output_chunks": len(stand_ins)}
    for way, (got, grads) in zip(("chunked", "runtime"), others):
        out[f"{way}_out_err"] = (got - ref).abs().max().item()
        out[f"{way}_grad_rel"] = max(((grads[k] - r).abs().max() / r.abs().max()).item() for k, r in ref_grads.items())
    return out


def fp16():
    """fp16 forwards (no grad): the blocks' nan_to_num clamp of an overflowing output, per chunk. The first txt
    token is fp16's largest value and the last MLP layers are scaled up, so residual sums overflow to inf, which the
    blocks clamp to 65504 (the double block only its txt)."""
    holder = blocks().half()
    with torch.no_grad():
        holder.double_blocks[0].txt_mlp[2].weight *= 100
        holder.single_blocks[0].linear2.weight *= 100
    t = {k: v.half() for k, v in inputs().items()}
    t["txt"][:, 0] = 65504.0
    result = {}
    with torch.no_grad():
        for kind, block in (("double", holder.double_blocks[0]), ("single", holder.single_blocks[0])):
            tk = t if kind == "double" else {"x": torch.cat((t["txt"], t["img"]), 1), "vec": t["vec"], "pe": t["pe"]}
            fn = cfc.chunked_double_stream if kind == "double" else cfc.chunked_single_stream
            ctx = ChunkContext(chunks=3, plain=None)
            ref = call(kind, block, {k: v.clone() for k, v in tk.items()}, {})
            got = call(kind, lambda *a, **k: fn(block, ctx, *a, **k), tk, {})
            ref, got = (ref if isinstance(ref, tuple) else (ref,)), (got if isinstance(got, tuple) else (got,))
            result[kind] = {"dtypes": sorted({str(o.dtype) for o in got}), "finite": all(o.isfinite().all().item()
                                                                                       for o in got),
                            "clamped": int(sum((r == 65504).sum().item() for r in ref)),
                            "rel_err": max(((o.float() - r.float()).abs().max() / r.float().abs().max()).item()
                                           for o, r in zip(got, ref))}
    return result


out["registration"], tiny_patcher = registration()
previous = mm.in_training
mm.in_training = True  # as inside the adapter's training_module: ComfyUI's autograd-safe RoPE
try:
    out["blocks"] = {f"{kind} chunks={n}": compare(kind, blocks(), inputs(), n)
                     for kind in ("double", "single") for n in (1, 3, 16)}
    variants = {"no pe": ({}, inputs(with_pe=False)), "mlp_silu_act": ({"mlp_silu_act": True}, inputs())}
    for name, (variant, t) in variants.items():
        for kind in ("double", "single"):
            out["blocks"][f"{kind} {name} chunks=3"] = compare(kind, blocks(**variant), t, 3)
    out["blocks"]["double yak_mlp chunks=3"] = compare("double", blocks(yak_mlp=True), inputs(), 3)
    torch.manual_seed(5)
    global_mod = [Modulation(HIDDEN, double=d, operations=nn) for d in (True, True, False)]
    for kind in ("double", "single"):
        out["blocks"][f"{kind} global modulation chunks=3"] = compare(kind, blocks(modulation=False), inputs(), 3,
                                                                       global_mod=global_mod)
    for kind in ("double", "single"):
        holder = blocks()
        inject_lora(holder, LoraSpec(rank=4, targets="all_linear"), "flux")
        lora = lora_parameters(holder)
        with torch.no_grad():
            for p in lora.values():
                p.normal_(0, 0.1)
        out["blocks"][f"{kind} lora chunks=3"] = compare(kind, holder, inputs(), 3, params=lora)
    holder = blocks()  # DoRA on linear1: not computed by rows, run whole and sliced
    inject_lora(holder, LoraSpec(rank=4, targets="all_linear", algorithm="dora"), "flux")
    lora = lora_parameters(holder)
    with torch.no_grad():
        for name, p in lora.items():
            if "magnitude" not in name:  # A, B; the magnitudes start as the base rows' norms
                p.normal_(0, 0.1)
    out["blocks"]["single dora chunks=3"] = compare("single", holder, inputs(), 3, params=lora)
    holder = blocks(ops=comfy.ops.manual_cast)  # ComfyUI's cast path: the weight and bias its functions give
    holder.single_blocks[0].linear1.weight_function = [lambda w: 1.5 * w]
    holder.single_blocks[0].linear1.bias_function = [lambda b: b + 0.1]
    out["blocks"]["single manual_cast weight_function chunks=3"] = compare("single", holder, inputs(), 3)
    out["single_flops"] = single_flops()
    out["fallbacks"] = fallbacks()
    out["fp16"] = fp16()
finally:
    mm.in_training = previous
out["whole_model"] = whole_model(tiny_patcher)
print("RESULT " + json.dumps(out))
