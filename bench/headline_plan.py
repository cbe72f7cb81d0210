"""`tightrope bench headline-plan`: the PREDICTED peak of the headline run, Flux-dev r16 bf16 2048 px batch 1,
from shapes alone (no GPU, no weights; well under a minute on a CPU).

The profile the planner reads is built without running the model:
  - weights exactly, from the model built on the `meta` device with its rank-16 LoRA (bench/models.py);
  - per-block activation bytes (saved, kept at the checkpoint boundary, the peak over forward + backward) from one
    double and one single block run under FakeTensorMode (memory/shape_profile.py says how close that is to CUDA),
    every block of a type alike, each also with its token-chunked forward at probe.TOKEN_CHUNKS chunks; inputs
    every block receives (vec, RoPE table) counted once; what the layers outside the blocks save from a fake run
    of the whole model with each block replaced by a copy of its inputs;
  - times from FLOPs at an assumed ASSUMED_FLOPS (bf16 on an H100, about 40 % of its dense peak) and
    ASSUMED_H2D_BYTES_PER_S pinned (PCIe 4 x16 as measured on common hosts): they only order the candidates the
    planner compares, the peak does not depend on them.
Then plan_cost.predict gives each configuration's peak and its breakdown, and the planner the best plan for a
budget. `make gpu-check` measures the same configurations (bench/gpu_check.py headline_configs).
"""
from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from ..memory.blocks import discover_blocks
from ..memory.memory_model import measure_weight_sizes
from ..memory.plan_cost import Prediction, predict
from ..memory.planner import Plan, autotune_batch, candidate_strategies, plan
from ..memory.probe import TOKEN_CHUNKS
from ..memory.profile import ChunkedBlock, Profile
from ..memory.shape_profile import BlockShape, fake_parameters, measure_block, saved_bytes_of
from ..memory.strategy import Strategy, StrategyError
from ..memory.token_chunks import ChunkContext, chunked_forward_for
from .grid import strategy_label
from .report import markdown_target
from .models import MODEL_PARAMS, TEXT_TOKENS, _meta_model

GB = 10 ** 9
ASSUMED_FLOPS = 400e12
ASSUMED_H2D_BYTES_PER_S = 24e9
HEADLINE_BUDGET = 4 * GB


def headline_profile(model_name: str = "flux-dev", resolution: int = 2048, batch: int = 1,
                     lora_rank: int = 16) -> tuple[Profile, dict[str, BlockShape]]:
    """The profile of `model_name` at (resolution, batch), bf16, as the probe would measure it on CUDA (computed once
    per process and arguments: callers must not change it)."""
    return _profile(model_name, resolution, batch, lora_rank)


@functools.lru_cache(maxsize=4)
def _profile(model_name: str, resolution: int, batch: int, lora_rank: int) -> tuple[Profile, dict[str, BlockShape]]:
    params = MODEL_PARAMS[model_name]()
    model = _meta_model(model_name, torch.bfloat16, lora_rank)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # LoRA weights are fp32 in training (build_bench_model), cast per op by autocast
    blocks = discover_blocks(model)
    sizes = measure_weight_sizes(model, [b.module for b in blocks], None)
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_img, n_txt = (resolution // 16) ** 2, TEXT_TOKENS[model_name]
    h, bf16 = params.hidden_size, torch.bfloat16
    mode = FakeTensorMode()
    with mode:
        vec = torch.empty(batch, h, dtype=bf16)
        pe = torch.empty(batch, 1, n_img + n_txt, params.head_dim // 2, 2, 2, dtype=torch.float32)
        img = torch.empty(batch, n_img, h, dtype=bf16, requires_grad=True)
        txt = torch.empty(batch, n_txt, h, dtype=bf16, requires_grad=True)
        x = torch.empty(batch, n_img + n_txt, h, dtype=bf16, requires_grad=True)
    inputs = {"DoubleStreamBlock": ((), {"img": img, "txt": txt, "vec": vec, "pe": pe}),
              "SingleStreamBlock": ((x,), {"vec": vec, "pe": pe})}
    shapes: dict[str, BlockShape] = {}
    recompute_flops: dict[str, float] = {}
    for b in blocks:
        kind = type(b.module).__name__
        if kind not in shapes:
            fake_parameters(b.module, mode)
            args, kwargs = inputs[kind]
            shapes[kind] = measure_block(b.module, args, kwargs, list(b.module.parameters()), mode,
                                         compute_dtype=bf16)
            fn, ctx = chunked_forward_for(b.module), ChunkContext(TOKEN_CHUNKS, plain=b.module.forward)
            if fn is not None:
                shapes[f"{kind}, {TOKEN_CHUNKS} token chunks"] = measure_block(
                    functools.partial(fn, b.module, ctx), args, kwargs, list(b.module.parameters()), mode,
                    compute_dtype=bf16)
                recompute_flops[kind] = saved_bytes_of(lambda: fn(b.module, ctx.rerun(), *args, **kwargs),
                                                       list(b.module.parameters()), mode, compute_dtype=bf16)[1]
    shared = vec.untyped_storage().nbytes() + pe.untyped_storage().nbytes()
    other_saved, other_flops = _outside_blocks(model, [b.module for b in blocks], mode,
                                               _model_inputs(params, batch, resolution, n_txt, mode))
    per = [shapes[type(b.module).__name__] for b in blocks]
    chunked = [shapes.get(f"{type(b.module).__name__}, {TOKEN_CHUNKS} token chunks") for b in blocks]
    profile = Profile(
        device="cuda", batch=batch, block_names=[b.name for b in blocks],
        block_types=[type(b.module).__name__ for b in blocks], block_frozen=list(sizes.block_frozen),
        block_packed=list(sizes.block_packed), block_trainable=list(sizes.block_trainable),
        other_weight_bytes=sizes.other, trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
        trainable_numel=sum(p.numel() for p in trainable), act_full=[s.saved for s in per],
        act_ckpt=[s.inputs - shared for s in per], act_shared=shared, act_other=other_saved,
        fwd_s=[s.fwd_flops / ASSUMED_FLOPS for s in per], bwd_s=[s.bwd_flops / ASSUMED_FLOPS for s in per],
        other_s=3 * other_flops / ASSUMED_FLOPS, h2d_bytes_per_s=ASSUMED_H2D_BYTES_PER_S,
        optimizer_s=16 * sum(p.numel() for p in trainable) / 2e12,  # AdamW: ~16 B/element at ~2 TB/s
        act_full_alloc=[s.alloc for s in per], block_peak_alloc=[s.peak for s in per], token_chunks=TOKEN_CHUNKS,
        chunked=[c and ChunkedBlock(saved=max(c.saved, c.alloc), peak=c.peak, fwd_s=c.fwd_flops / ASSUMED_FLOPS,
                                    bwd_s=c.bwd_flops / ASSUMED_FLOPS,
                                    recompute_s=recompute_flops[type(b.module).__name__] / ASSUMED_FLOPS)
                 for c, b in zip(chunked, blocks)])
    return profile, shapes


def _outside_blocks(model, blocks, mode: FakeTensorMode, inputs: dict[str, Any]) -> tuple[int, float]:
    """Bytes the layers outside the blocks save (embedders, final layer, loss) and their forward FLOPs: the whole
    model on fake tensors with each block replaced by its inputs plus a zero that requires grad (so the layers after
    the blocks save what they save in training, and the stubs save nothing)."""
    fake_parameters(model, mode, skip=tuple(blocks))
    with mode:
        zero = torch.zeros((), dtype=torch.bfloat16, requires_grad=True)
        target = torch.empty(inputs["x"].shape)
    stubs = {"DoubleStreamBlock": lambda img, txt, vec, pe: (img + zero, txt + zero),
             "SingleStreamBlock": lambda x, vec, pe: x + zero}
    try:
        for b in blocks:
            b.forward = stubs[type(b).__name__]
        params = [p for p in model.parameters() if p.device.type != "meta"]
        return saved_bytes_of(lambda: F.mse_loss(model(**inputs).float(), target), params, mode,
                              compute_dtype=torch.bfloat16)
    finally:
        for b in blocks:
            del b.forward


def _model_inputs(params, batch: int, resolution: int, n_txt: int, mode: FakeTensorMode) -> dict[str, Any]:
    lat = resolution // 8
    with mode:
        inputs = {"x": torch.empty(batch, 16, lat, lat), "timesteps": torch.empty(batch),
                  "context": torch.empty(batch, n_txt, params.context_in_dim),
                  "y": torch.empty(batch, params.vec_in_dim)}
        if params.guidance_embed:
            inputs["guidance"] = torch.empty(batch)
    return inputs


def headline_strategies() -> list[tuple[str, Strategy]]:
    base = Strategy.of(compute_dtype="bf16", checkpoint="all", activation_offload=True)
    chunked = base.replace(offload_fraction=1.0, token_chunks=TOKEN_CHUNKS)
    return [("offload 0.9", base.replace(offload_fraction=0.9)), ("offload 1.0", base.replace(offload_fraction=1.0)),
            (f"offload 1.0 + {TOKEN_CHUNKS} token chunks", chunked),
            (f"offload 1.0 + {TOKEN_CHUNKS} token chunks", chunked.replace(prefetch_depth=0))]


def least_peak(profile: Profile, optimizer_offload: bool = True) -> tuple[Strategy, Prediction]:
    """The planner's candidate with the least predicted peak (what no budget below it can be given), with optimizer
    offload among the candidates or not (as planner.plan's optimizer_offload)."""
    scored = [(s, off, predict(profile, s, offloaded=off, timed=False)) for s, off in
              candidate_strategies(profile, Strategy.of(compute_dtype="bf16"), allow_compile=False,
                                   optimizer_offload=optimizer_offload)]
    least = min(p.peak_bytes for _, _, p in scored)  # then the fastest of those: only they need timing
    return min(((s, predict(profile, s, offloaded=off)) for s, off, p in scored if p.peak_bytes == least),
               key=lambda sp: sp[1].step_s)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB ({n / GB:.2f} GB)"


def breakdown_rows(profile: Profile, p: Prediction) -> list[tuple[str, int]]:
    b = p.breakdown
    return [("device weights (resident blocks, slots, outside the blocks, LoRA)", b["weights"]),
            ("  of which offload slots", b.get("slots", 0)),
            ("LoRA gradients (optimizer offload: those in flight)", b["gradients"]),
            ("AdamW state (2 fp32 moments; in host memory under optimizer offload)", b["optimizer"]),
            ("kept activations (incl. the activation-offload window)", b["activations"]),
            ("largest block transient (forward + backward)", b["transient"]), ("margin", b["margin"]),
            ("PEAK", p.peak_bytes)] + \
        ([("host memory: the LoRA, its gradients and AdamW state (optimizer offload)", b["host_optimizer"])]
         if b.get("host_optimizer") else [])


def report(resolution: int = 2048, budget: int = HEADLINE_BUDGET) -> str:
    profile, shapes = headline_profile(resolution=resolution)
    lines = [f"# Headline plan: Flux-dev r16 bf16 {resolution} px, batch 1 (predicted from shapes, no GPU)", "",
             "Command: `tightrope bench headline-plan`"
             + (f" --resolution {resolution}" if resolution != 2048 else ""), "",
             "| block type | inputs (kept when checkpointed) | saved (no checkpoint) | peak fwd+bwd | fwd+bwd TFLOP |",
             "| --- | --- | --- | --- | --- |"]
    for kind, s in shapes.items():
        lines.append(f"| {kind} | {_gib(s.inputs)} | {_gib(s.saved)} | {_gib(s.peak)} | "
                     f"{(s.fwd_flops + s.bwd_flops) / 1e12:.1f} |")
    lines += ["", f"Shared inputs (vec, RoPE) {_gib(profile.act_shared)}; saved outside the blocks "
              f"{_gib(profile.act_other)}; blocks {profile.n_blocks}, frozen block weights "
              f"{_gib(sum(profile.block_frozen))}, outside the blocks {_gib(profile.other_weight_bytes)}, LoRA "
              f"{profile.trainable_numel / 1e6:.1f} M parameters.", ""]
    for name, strategy in headline_strategies():
        p = predict(profile, strategy)
        depth = strategy.offload.prefetch_depth
        lines += [f"## {name} + activation offload + checkpoint all, prefetch depth {depth}", "",
                  f"Offloaded blocks: {len(p.offloaded)} of {profile.n_blocks}.", "", "| part | bytes |",
                  "| --- | --- |"]
        lines += [f"| {what} | {_gib(n)} |" for what, n in breakdown_rows(profile, p)]
        lines.append("")
    for allowed in (False, True):
        lines += planner_section(profile, budget, allowed)
    return "\n".join(lines) + "\n"


def planner_section(profile: Profile, budget: int, optimizer_offload: bool) -> list[str]:
    """The planner's choice at `budget`, without optimizer offload (what `make gpu-check` measures) or with it
    allowed (picked where it is faster by the model, or where nothing else fits), and its breakdown."""
    lines = [f"## The planner at a {budget / GB:g} GB budget, optimizer offload "
             + ("allowed" if optimizer_offload else "off"), ""]
    try:
        best: Plan | None = plan(profile, budget, optimizer_offload=optimizer_offload)
        lines += [best.explanation, "", f"Strategy: `{best.strategy.to_json()}`", ""]
        chosen = best.prediction
    except StrategyError as exc:
        lines += [f"No plan: {exc}", ""]
        strategy, chosen = least_peak(profile, optimizer_offload)
        lines += [f"The least peak of its candidates (`{strategy_label(strategy)}`): "
                  f"`{strategy.to_json()}`", ""]
    lines += ["| part | bytes |", "| --- | --- |"]
    lines += [f"| {what} | {_gib(n)} |" for what, n in breakdown_rows(profile, chosen)]
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tightrope bench headline-plan", description=__doc__.splitlines()[0])
    ap.add_argument("--resolution", type=int, default=2048)
    ap.add_argument("--budget-gb", type=float, default=HEADLINE_BUDGET / GB)
    ap.add_argument("--out", metavar="FILE|DIR", help="also write the markdown here (in a folder: headline_plan.md)")
    args = ap.parse_args(argv)
    try:  # before the planning: a bad path fails in a second
        out = markdown_target(args.out, "headline_plan.md")
    except ValueError as e:
        ap.error(str(e))
    text = report(args.resolution, int(args.budget_gb * GB)) + "\n" + largest_batch_section()
    print(text, end="")
    if out is not None:
        out.write_text(text, encoding="utf-8")
    return 0


BATCH_BUDGETS = (8 * GB, 16 * GB, 24 * GB)


def largest_batches(profile: Profile, budgets=BATCH_BUDGETS) -> dict[int, tuple[int, Plan] | None]:
    """Per budget: the largest batch whose best plan fits it, and that plan (None: not even batch 1 fits). The
    profile is scaled linearly from its own batch (Profile.at_batch), not re-measured per batch: a fake-tensor profile
    per batch takes ~8 s on a CPU, and for flux-dev at 1024 px profiles measured at each batch found and the next one
    gave the same batches at 8, 16 and 24 GB (2026-11-23)."""
    found: dict[int, tuple[int, Plan] | None] = {}
    for budget in budgets:
        try:
            batch = autotune_batch(profile, budget)
        except StrategyError:  # not even batch 1
            found[budget] = None
            continue
        found[budget] = batch, plan(profile.at_batch(batch), budget)
    return found


def largest_batch_section(resolution: int = 1024, budgets=BATCH_BUDGETS, model_name: str = "flux-dev") -> str:
    """The report's last section: the largest batch of the headline model that fits each budget."""
    profile, _ = headline_profile(model_name, resolution)
    lines = [f"## Largest batch that fits, {resolution} px", "",
             f"The batch-1 profile at {resolution} px scaled linearly (activations and compute grow with the batch, "
             "weights do not), the largest batch whose best plan fits (memory/planner.py autotune_batch).", "",
             "| budget | largest batch | predicted peak | strategy |", "| --- | --- | --- | --- |"]
    for budget, found in largest_batches(profile, budgets).items():
        if found is None:
            lines.append(f"| {budget / GB:g} GB | none: batch 1 does not fit | | |")
            continue
        batch, best = found
        lines.append(f"| {budget / GB:g} GB | {batch} | {_gib(best.predicted_peak_bytes)} | "
                     f"`{strategy_label(best.strategy)}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
