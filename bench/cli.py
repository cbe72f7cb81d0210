"""`tightrope bench`: the benchmark suite's command line (the top-level CLI dispatches `tightrope bench ...` here).

    tightrope bench --quick                                   # tiny model, CPU, small grid (~1 min on 2 cores)
    tightrope bench --model flux-dev --device cuda            # the full grid on a GPU (H100/H200)
    tightrope bench --runtime-overhead                        # MemoryRuntime overhead and checkpoint RSS (CPU)
    tightrope bench gpu-check [--out DIR]                     # CUDA correctness + 2048 px headline (make gpu-check)
    tightrope bench gpu-bench [--out DIR]                     # planner budgets, compile, H2D (make gpu-bench)
    tightrope bench --host-memory                             # host RAM above the loaded model, per offload (CPU)
    tightrope bench --host-memory --device cuda               # the same training on a GPU, pinned in place
    tightrope bench headline-plan [--out FILE|DIR]            # predicted 2048 px headline peak from shapes (CPU)
    tightrope bench reserved-replay [--out FILE|DIR]          # its reserved memory: the CUDA allocator modelled (CPU)
"""
from __future__ import annotations

import argparse
import sys

GiB = 1 << 30


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tightrope bench", description="Memory/speed benchmarks of the Tightrope "
                                 "runtime: a grid of strategies, batch sizes and resolutions, plus a planner check. "
                                 "Writes JSON, markdown and PNG charts.",
                                 epilog="subcommands (each with its own --help): gpu-check (CUDA correctness and the "
                                 "2048 px headline: make gpu-check), gpu-bench (planner budgets, compile, H2D: make "
                                 "gpu-bench), headline-plan (the headline's predicted peak from shapes, CPU), "
                                 "reserved-replay (its reserved memory, the CUDA allocator modelled, CPU)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny model on CPU with a small grid (well under 5 minutes on 2 cores)")
    ap.add_argument("--model", choices=("tiny", "flux-2b", "flux-dev"), help="benchmark model (default: tiny with "
                    "--quick or on CPU, else flux-dev)")
    ap.add_argument("--device", choices=("cpu", "cuda"), help="default: cpu with --quick, else cuda")
    ap.add_argument("--out", metavar="DIR", help="output folder (default benchmarks/results/<device>-<date>)")
    ap.add_argument("--steps", type=int, help="measured steps per configuration (default 3 quick, 5 full)")
    ap.add_argument("--warmup", type=int, help="warm-up steps per configuration (default 1 quick, 2 full)")
    ap.add_argument("--budgets", metavar="GIB", type=float, nargs="+",
                    help="planner budgets in GiB (default 8 12 16 24 on CUDA; fractions of the model's peak on CPU)")
    ap.add_argument("--no-planner", action="store_true", help="skip the planner check")
    ap.add_argument("--probe-compile", choices=("auto", "on", "off"), default="auto",
                    help="measure per-block compile in the probe, so the planner may choose it (auto: on CUDA)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU intra-op threads (default 1: repeatable figures on small or shared machines)")
    ap.add_argument("--runtime-overhead", action="store_true",
                    help="run the runtime-overhead benchmark instead (CPU; see bench/runtime_overhead.py)")
    ap.add_argument("--host-memory", action="store_true",
                    help="run the host-memory benchmark instead (CPU, or --device cuda; see bench/host_memory.py)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["gpu-check"]:
        from .gpu_check import main as gpu_check
        return gpu_check(argv[1:])
    if argv[:1] == ["headline-plan"]:
        from .headline_plan import main as headline_plan
        return headline_plan(argv[1:])
    if argv[:1] == ["reserved-replay"]:
        from .reserved_report import main as reserved_replay
        return reserved_replay(argv[1:])
    if argv[:1] == ["gpu-bench"]:
        from .gpu_bench import main as gpu_bench
        return gpu_bench(argv[1:])
    if "--runtime-overhead" in argv:
        from .runtime_overhead import main as overhead_main
        return overhead_main([a for a in argv if a != "--runtime-overhead"])
    if "--host-memory" in argv:
        from .host_memory import main as host_memory_main
        return host_memory_main([a for a in argv if a != "--host-memory"])
    args = build_parser().parse_args(argv)
    if args.steps is not None and args.steps < 1:
        print("error: --steps must be at least 1", file=sys.stderr)
        return 2
    device = args.device or ("cpu" if args.quick else "cuda")
    model = args.model or ("tiny" if args.quick or device == "cpu" else "flux-dev")
    from ..memory.strategy import StrategyError
    from .report import markdown
    from .suite import run_suite
    try:
        result, _ = run_suite(model, device, quick=args.quick, steps=args.steps, warmup=args.warmup, out_dir=args.out,
                  budgets=[int(g * GiB) for g in args.budgets] if args.budgets else None,
                  run_planner=not args.no_planner,
                  measure_compile={"auto": None, "on": True, "off": False}[args.probe_compile],
                  cpu_threads=args.threads)
    except StrategyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
