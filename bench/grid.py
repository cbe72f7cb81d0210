"""The benchmark grid: which (strategy, batch, resolution) configurations a run measures.

The strategy sweep runs at one "primary" batch and resolution (those points make the memory-vs-speed frontier);
a batch/resolution sweep runs with every block checkpointed. Every configuration that offloads weights gets an
offload-0 twin (same everything else) if the grid lacks one: its measured compute is what the physical bound of the
offloading run is built from.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..memory.strategy import Strategy


@dataclass(frozen=True)
class BenchConfig:
    strategy: Strategy
    batch: int
    resolution: int

    @property
    def label(self) -> str:
        return strategy_label(self.strategy)

    @property
    def name(self) -> str:
        return f"{self.label} b{self.batch} r{self.resolution}"

    def twin_without_offload(self) -> "BenchConfig":
        return BenchConfig(self.strategy.replace(offload_fraction=0.0, offload_blocks=None, prefetch_depth=1),
                           self.batch, self.resolution)


def strategy_label(s: Strategy) -> str:
    """Short and unique within a grid: 'off0.50/d2 ckpt-all actoff compile@0.5', 'off1.00/d0 ckpt-all chunks8'."""
    off, ckpt = s.offload, s.checkpointing
    parts = [f"off{off.fraction:.2f}" + (f"/d{off.prefetch_depth}" if off.fraction and off.prefetch_depth != 1
                                         else "")]
    parts.append({"off": "ckpt-off", "all": "ckpt-all", "every_n": f"ckpt-every{ckpt.every}"}[ckpt.mode])
    if s.activations.enabled:
        parts.append("actoff")
    if ckpt.token_chunks > 1:
        parts.append(f"chunks{ckpt.token_chunks}")
    if s.compiler.per_block:
        parts.append(f"compile@{s.compiler.activation_memory_budget:g}")
    if s.optimizer.enabled:
        parts.append("optoff")
    return " ".join(parts)


def _sweep(base: Strategy, batch: int, res: int, extra_points: list[tuple[int, int]],
           fractions: tuple[float, ...], compile_budgets: tuple[float, ...]) -> list[BenchConfig]:
    s = [base.replace(checkpoint=c) for c in ("off", "every_n", "all")]
    s += [base.replace(offload_fraction=f, checkpoint="all") for f in fractions if f > 0]
    s += [base.replace(offload_fraction=1.0, checkpoint="all", prefetch_depth=2),
          base.replace(offload_fraction=0.5, checkpoint="off"),
          base.replace(checkpoint="all", activation_offload=True),
          base.replace(offload_fraction=1.0, checkpoint="all", activation_offload=True)]
    for b in compile_budgets:
        s.append(base.replace(compile="per_block", activation_memory_budget=b))
    if compile_budgets:
        s.append(base.replace(compile="per_block", checkpoint="all"))
    configs = [BenchConfig(x, batch, res) for x in s]
    configs += [BenchConfig(base.replace(checkpoint="all"), b, r) for b, r in extra_points]
    return with_references(configs)


def quick_grid() -> list[BenchConfig]:
    """Tiny model on CPU: 14 configurations, about half a minute on 2 cores. Compile uses the partitioner without code
    generation (aot_eager_decomp_partition) so no C++ compiler runs."""
    base = Strategy.of(compute_dtype="fp32", compile_backend="aot_eager_decomp_partition")
    return _sweep(base, 2, 128, [(1, 128), (4, 128), (2, 256)], (0.5, 1.0), (0.5,))


def full_grid(device: str) -> list[BenchConfig]:
    """The GPU grid (bf16, inductor): offload 0-1 in quarters, checkpoint modes, activation offload, per-block
    compile at budgets 1.0/0.5; batch 1-4 at 512 and 1024 px."""
    if device == "cpu":
        base = Strategy.of(compute_dtype="fp32", compile_backend="aot_eager_decomp_partition")
        return _sweep(base, 2, 256, [(1, 256), (4, 256), (2, 512)], (0.25, 0.5, 0.75, 1.0), (1.0, 0.5))
    base = Strategy.of(compute_dtype="bf16")
    return _sweep(base, 1, 1024, [(2, 1024), (4, 1024), (1, 512), (4, 512)], (0.25, 0.5, 0.75, 1.0), (1.0, 0.5))


def with_references(configs: list[BenchConfig]) -> list[BenchConfig]:
    """The grid, de-duplicated, plus an offload-0 twin for every offloading configuration that lacks one."""
    out: list[BenchConfig] = []
    for c in configs + [c.twin_without_offload() for c in configs if c.strategy.offload.fraction > 0]:
        if c not in out:
            out.append(c)
    return out
