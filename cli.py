"""`tightrope` command line: run a saved ComfyUI workflow headless, or benchmark.

    tightrope run WORKFLOW.json [--output-dir DIR] [--resume] [--fsdp] [--debug] [--comfyui DIR] [--models-dir DIR]
                                [--custom-node DIR ...] [--log-dir DIR]
    torchrun --nproc_per_node=N -m tightrope run WORKFLOW.json ...   (data parallel: docs/distributed.md)
    tightrope bench ...

Exit codes: 0 success, 2 bad input (the workflow, a node's input or the command line; found before any node runs or
while one runs: bad_input_types), 1 anything else (a bug, a divergence, out of memory, a core node that failed),
130 Ctrl-C, 143 SIGTERM (129 SIGHUP, 138 SIGUSR1: every polite stop saves like Ctrl-C, headless/stop_signals.py).
A user error (bad input: its message names the input and the fix) prints one line; a bug prints its traceback too.
Tightrope's own warnings print as one line each (`warning: ...`), above a running progress bar.
No module-level state: every call of main() stands alone (torchrun will start one per rank).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_WORKFLOW_ERROR = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    with _escaping_stdout():
        return _main(argv)


@contextlib.contextmanager
def _escaping_stdout():
    """stdout writes a character its encoding lacks as an escape (as Python's stderr always does), not raising
    UnicodeEncodeError: on Windows (Python < 3.15) stdout redirected to a file or a pipe is in the ANSI code page
    (cp1252 on Western systems) with errors='strict', and the summary printed after a run names output folders and
    files, which may hold any letter: a finished run exited 1 with a traceback. Restored on return."""
    stream, escaping = sys.stdout, False
    if getattr(stream, "errors", None) == "strict":
        with contextlib.suppress(AttributeError, ValueError, OSError):  # not a reconfigurable text stream
            stream.reconfigure(errors="backslashreplace")
            escaping = True
    try:
        yield
    finally:
        if escaping:
            with contextlib.suppress(AttributeError, ValueError, OSError):
                stream.reconfigure(errors="strict")


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    prefer_expandable_segments(os.environ)
    if argv[:1] == ["bench"]:  # everything after "bench" belongs to the bench CLI, --help included
        return run_bench(argv[1:])
    if argv[:1] == ["cache"]:  # the dataset cache's size, and pruning it (training/data/cache_files.py)
        from .training.data.cache_files import command
        return command(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_request:  # --help, or a usage error argparse already printed
        return exit_request.code if isinstance(exit_request.code, int) else EXIT_WORKFLOW_ERROR
    if args.command != "run":
        parser.print_help(sys.stderr)
        return EXIT_WORKFLOW_ERROR
    return run_command(args.workflow, output_dir=args.output_dir, resume=args.resume, fsdp=args.fsdp,
                       debug=args.debug, comfyui=args.comfyui, models_dir=args.models_dir, log_dir=args.log_dir,
                       custom_nodes=args.custom_node)


def prefer_expandable_segments(environ) -> bool:
    """Our own process (not ComfyUI's): let the CUDA caching allocator grow segments in place unless the user chose
    a configuration. Measured on an H100 (benchmarks/results/h100-2026-11-23): the Flux-dev 2048 px headline at
    offload 1.0 reserved 8.58 GiB with the default allocator and 7.17 GiB with expandable segments, for the same
    5.41 GiB allocated and the same step time. Read at the allocator's first use, so set before any CUDA work;
    Linux only (elsewhere the allocator warns and ignores it)."""
    if sys.platform != "linux" or "PYTORCH_CUDA_ALLOC_CONF" in environ or "PYTORCH_ALLOC_CONF" in environ:
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tightrope", description="Train LoRAs on large diffusion transformers on "
                                     "small GPUs: run Tightrope workflows without ComfyUI.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser("run", help="run a workflow saved from ComfyUI (UI or API format)",
                              description="Run a workflow saved from ComfyUI (Workflow > Save, or Export (API)) "
                                          "using Tightrope's nodes, without ComfyUI.")
    run.add_argument("workflow", metavar="WORKFLOW.json", help="the workflow file")
    run.add_argument("--output-dir", default="output", metavar="DIR",
                     help="where nodes write LoRAs, samples and logs (default: ./output)")
    run.add_argument("--resume", action="store_true",
                     help="continue an interrupted run from its last saved state in the output dir (without it, "
                          "a Train node whose run was interrupted is refused rather than trained over)")
    run.add_argument("--fsdp", action="store_true",
                     help="under torchrun: shard the frozen base weights of each transformer block over the "
                          "processes (FSDP2: the memory strategy's shard='fsdp'), for models too big for one GPU "
                          "(docs/distributed.md)")
    run.add_argument("--debug", action="store_true",
                     help="print the Python traceback of every error, not only of bugs")
    run.add_argument("--comfyui", metavar="DIR", help="run ComfyUI's own nodes too (loaders, samplers, SaveImage), "
                     "in this process, from the ComfyUI in DIR (default: $COMFYUI_DIR when the workflow needs them); "
                     "run with the python ComfyUI runs in")
    run.add_argument("--models-dir", metavar="DIR", help="with ComfyUI: also look for model files in DIR, laid "
                     "out like ComfyUI's models/ folder (diffusion_models/, text_encoders/, vae/, loras/ ...)")
    run.add_argument("--custom-node", metavar="DIR", action="append", help="with ComfyUI: also load this custom "
                     "node pack (its folder under ComfyUI/custom_nodes, e.g. ComfyUI-GGUF for its GGUF loader); "
                     "repeat for several")
    run.add_argument("--log-dir", metavar="DIR", help="write TensorBoard scalars (loss, validation loss, learning "
                     "rate, peak VRAM, H2D GB/s) of every Train node whose own log_dir is empty to DIR (needs "
                     "`pip install tensorboard`)")
    commands.add_parser("bench", help="memory/speed benchmarks (tightrope bench --help)", add_help=False)
    commands.add_parser("cache", help="the dataset cache's size; prune what no load used for a while (tightrope cache "
                        "--help)", add_help=False)
    return parser


def run_command(workflow_path: str, *, output_dir: str, resume: bool, fsdp: bool = False, debug: bool = False,
                comfyui: str | None = None, models_dir: str | None = None, log_dir: str | None = None,
                custom_nodes: list[str] | None = None) -> int:
    from .headless.stop_signals import polite_stops
    started = time.time()
    # polite stops (SIGTERM etc.) stop like Ctrl-C until this returns: a second signal while a stop is saved or
    # reported prints a note instead of killing the process (found by a helper: exit -15 after a reported stop)
    with polite_stops():
        try:
            return _reported(started, workflow_path, output_dir, resume, fsdp, debug, comfyui, models_dir, log_dir,
                             custom_nodes)
        except KeyboardInterrupt as stop:  # a first stop while another ending was reported: its exit code
            from .headless.stop_signals import report_stop
            return report_stop(stop, quiet=True)


def _reported(started: float, workflow_path: str, output_dir: str, resume: bool, fsdp: bool, debug: bool,
              comfyui: str | None, models_dir: str | None, log_dir: str | None, custom_nodes: list[str] | None) -> int:
    """The run, and what ended it reported: its exit code."""
    from .headless.executor import NodeExecutionError
    from .headless.graph import WorkflowError
    from .headless.stop_signals import report_stop
    from .training.distributed import DistributedError, launched
    try:
        try:
            with launched(fsdp=fsdp), one_line_warnings(debug):  # torchrun's process group
                return _run(workflow_path, _output_dir(output_dir), resume, comfyui, models_dir, log_dir,
                            custom_nodes or [])
        finally:
            _close_progress_bars()  # what is printed next starts a line of its own, and no bar is drawn after it
    except (WorkflowError, DistributedError) as exc:
        if debug:
            traceback.print_exception(exc, file=sys.stderr)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_WORKFLOW_ERROR
    except KeyboardInterrupt as stop:  # 130 for Ctrl-C, 128 + the signal for SIGTERM, SIGHUP, SIGUSR1
        from .nodes.host import HEADLESS_STATE_DIR  # the run's host context has ended: its state_dir, spelled out
        ours = getattr(stop, "train_states", None)  # this workflow's Train nodes' (None: stopped before it ran)
        if ours is not None:  # any state of its Train nodes is what --resume goes on from (or returns, finished)
            saved = any(p.is_file() for p in ours)
        else:  # written in this run (coarse mtimes)
            states = (Path(output_dir).expanduser().resolve() / HEADLESS_STATE_DIR).rglob("*.state.safetensors")
            saved = any(p.stat().st_mtime >= started - 1 for p in states)
        return report_stop(stop, saved=saved, quiet=os.environ.get("RANK", "0") != "0")  # rank 0 reports
    except NodeExecutionError as exc:
        user_error = isinstance(exc.__cause__, user_error_types())
        if debug or not user_error:  # a bug: the traceback is what helps
            traceback.print_exception(exc.__cause__ or exc, file=sys.stderr)
        print(f"error: {exc}", file=sys.stderr)
        kept = getattr(exc, "train_states_written", [])
        if kept and os.environ.get("RANK", "0") == "0":  # --resume goes on from these, nothing trained again
            shown = ", ".join(f"{path} ({'finished' if left is None else f'step {left[0]} of {left[1]}'})"
                              for path, left in kept)
            print(f"training state kept for {len(kept)} Train node(s) ({shown}): once fixed, run again with "
                  "--resume to go on from it instead of training again", file=sys.stderr)
        return EXIT_WORKFLOW_ERROR if isinstance(exc.__cause__, bad_input_types()) else EXIT_FAILED
    except Exception as exc:  # a bug, not a workflow problem: the traceback is what helps
        traceback.print_exc(file=sys.stderr)
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED


@contextlib.contextmanager
def one_line_warnings(debug: bool):
    """Tightrope's own warnings (a changed setting on resume, a skipped image) as one line, `warning: ...`, written
    above a running progress bar, not Python's `file:line: UserWarning: ...` plus a source line (--debug keeps
    those). Through `warnings.formatwarning`, restored on exit: warnings recorded by a caller are left alone."""
    if debug:
        yield
        return
    original, ours = warnings.formatwarning, str(Path(__file__).resolve().parent)

    def formatwarning(message, category, filename, lineno, line=None):
        if not (issubclass(category, UserWarning) and str(Path(filename).resolve()).startswith(ours)):
            return original(message, category, filename, lineno, line)
        from tqdm import tqdm
        tqdm.write(f"warning: {message}", file=sys.stderr)  # clears and redraws a running bar around it
        return ""
    warnings.formatwarning = formatwarning
    try:
        yield
    finally:
        warnings.formatwarning = original


def _close_progress_bars() -> None:
    """Close the tqdm bars a run that ended early left open (a bar closes itself at its last step)."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


def _train_states(graph) -> dict[str, Path]:
    """Train node id -> its training state file, for this workflow's Train nodes whose filename_prefix is a literal
    (a linked one is known when the node runs; a bad one, its node's validation names)."""
    from .nodes import host
    from .training.state.resume import state_path
    states = {}
    for node_id, node in graph.items():
        prefix = node.inputs.get("filename_prefix")
        if node.class_type == "TightropeTrain" and isinstance(prefix, str):
            try:
                states[node_id] = state_path(host.state_dir(), prefix, node_id)
            except ValueError:
                continue
    return states


def _written_train_states(graph, started: float) -> list[tuple[Path, tuple[int, int] | None]]:
    """(state file, (step, run end) or None when finished) of this workflow's Train nodes written in this run (since
    `started`, a wall-clock time; coarse mtimes): --resume goes on from them, or returns a finished node's result."""
    from .training.state.resume import unfinished_run
    return [(p, unfinished_run(p)) for p in _train_states(graph).values()
            if p.is_file() and p.stat().st_mtime >= started - 1]


def user_error_types() -> tuple[type[Exception], ...]:
    """Exceptions that mean bad input, not a bug: their message names the input and the fix, so `tightrope run`
    prints it without a traceback (unless --debug): the bad input, and runs that failed for a reason it names."""
    from .headless.graph import WorkflowError
    from .training.lora.rescue import LoraNotSavedError
    from .training.rank_lost import RankLostError  # another rank ended first: its output says why
    from .training.state.atomic_write import FileWriteError
    from .training.trainer import NonFiniteLossError, NonFiniteWeightsError, TrainingOutOfMemoryError
    return bad_input_types() + (WorkflowError, NonFiniteLossError, NonFiniteWeightsError, FileWriteError,
                                LoraNotSavedError, TrainingOutOfMemoryError, RankLostError)


def bad_input_types() -> tuple[type[Exception], ...]:
    """The user errors that are bad input (exit 2, as the checks before any node runs), not a run that failed (a
    divergence, out of memory, a disk that cannot be written, a core node that failed: exit 1)."""
    from .memory.strategy import StrategyError
    from .training.data.image_folder import DatasetError
    from .training.finite_check import NonFiniteDataError
    from .training.state.lock import StateLockedError
    from .training.state.resume import ResumeError
    from .training.train_config import ConfigError  # also LoraError, DistributedError, OutputPathError
    return ConfigError, DatasetError, ResumeError, StrategyError, NonFiniteDataError, StateLockedError


def _output_dir(output_dir: str) -> str:
    """--output-dir as an absolute path; an empty one (`--output-dir ""`, an unset shell variable) is refused rather
    than taken for the working directory."""
    if not output_dir.strip():
        from .headless.graph import WorkflowError
        raise WorkflowError(f"--output-dir {output_dir!r} is empty: pass the folder the run writes into (default "
                            f"'output')")
    return os.path.abspath(os.path.expanduser(output_dir))


def _run(workflow_path: str, output_dir: str, resume: bool, comfyui: str | None = None,
         models_dir: str | None = None, log_dir: str | None = None, custom_nodes: list[str] = ()) -> int:
    from .headless.comfyui_library import comfyui_dir, load_comfyui
    from .headless.custom_nodes import load_custom_nodes
    from .headless.executor import NodeExecutionError, run_workflow, summary_lines
    from .headless.graph import WorkflowError
    from .headless.same_run import check_same_run_on_every_rank
    from .headless.workflow_format import UI_FORMAT, load_workflow, parse_workflow, read_workflow_json, workflow_format
    from .nodes.workflow_checks import train_chain_problems
    from .training.distributed import current

    if log_dir:  # before anything runs: --log-dir without tensorboard installed is a command-line problem
        _check_tensorboard(log_dir)
    data = read_workflow_json(workflow_path)
    comfy_dir = comfyui_dir(comfyui, data, load_node_mappings())
    library = load_comfyui(comfy_dir) if comfy_dir else None
    if custom_nodes:
        if library is None:
            raise WorkflowError("--custom-node loads a ComfyUI custom node pack: it needs ComfyUI (--comfyui DIR or "
                                "COMFYUI_DIR)")
        load_custom_nodes(library, custom_nodes)
    node_mappings = load_node_mappings(library)
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as exc:
        raise WorkflowError(f"cannot create output dir {output_dir!r} ({exc.strerror}): pass --output-dir "
                            f"a folder you can write to") from None
    with headless_host(output_dir, resume, log_dir), _comfyui_folders(library, models_dir):
        try:
            graph = load_workflow(data, node_mappings, path=workflow_path)
        except WorkflowError as exc:  # with ComfyUI, a missing model file is named with the folders searched
            if library is None:
                raise
            raise library.explain_model_files(exc, parse_workflow(data, node_mappings, path=workflow_path)) from None
        chain_problems = train_chain_problems(graph)  # what one node's own validation cannot see
        if chain_problems:
            raise WorkflowError(chain_problems)
        check_same_run_on_every_rank(graph, resume)  # before any node: other ranks' collectives would not line up
        if not resume:
            _refuse_interrupted_runs(graph)
        extra_pnginfo = {"workflow": data} if workflow_format(data) == UI_FORMAT else None
        started, wall = time.monotonic(), time.time()
        main_rank = current().is_main  # under torchrun only rank 0 reports
        try:
            results = run_workflow(graph, node_mappings, on_node=_print_progress if main_rank else None,
                                   extra_pnginfo=extra_pnginfo, call_node=library.call_node if library else None,
                                   lazy_status=library.lazy_status if library else None)
        except NodeExecutionError as exc:
            exc.train_states_written = _written_train_states(graph, wall)  # for the report: --resume uses them
            raise
        except KeyboardInterrupt as stop:
            stop.train_states = list(_train_states(graph).values())  # the stop report: what --resume goes on from
            raise
    if main_rank:
        for line in summary_lines(results, graph, node_mappings, output_dir):
            print(line)
        print(f"ran {len(results)} node(s) in {time.monotonic() - started:.1f} s; output dir: {output_dir}")
    return EXIT_OK


def _refuse_interrupted_runs(graph) -> None:
    """Without --resume, before any node runs: a Train node whose last run was interrupted would train from the start
    and its first save would replace that run's state (its steps lost). Each one is refused, naming --resume (a
    Train node whose filename_prefix is linked is checked when it runs)."""
    from .headless.graph import WorkflowError
    from .training.distributed import on_main_rank
    from .training.state.resume import ResumeError
    from .training.training_run import refuse_unfinished
    for node_id, state_file in _train_states(graph).items():
        try:
            on_main_rank(lambda: refuse_unfinished(state_file, node_id))
        except ResumeError as e:  # a command-line matter (exit 2, one line), like the other checks before any node
            raise WorkflowError(str(e)) from None


def load_node_mappings(library=None) -> dict:
    """The pack's nodes plus ComfyUI's trivial Primitive* nodes, and with a loaded ComfyUI (headless/comfyui_library.py)
    all its core and comfy_extras nodes. Imported lazily: `--help` stays instant."""
    from . import NODE_CLASS_MAPPINGS
    from .headless.comfyui_library import with_core_primitives
    return with_core_primitives({**(library.node_mappings if library else {}), **NODE_CLASS_MAPPINGS})


def _comfyui_folders(library, models_dir: str | None):
    """ComfyUI's folders for this run (outputs into ours, LoRAs from ours, --models-dir), restored afterwards."""
    import contextlib

    from .headless.graph import WorkflowError
    from .nodes import host
    if library is None:
        if models_dir is not None:
            raise WorkflowError("--models-dir is where ComfyUI's loaders look for model files: it needs ComfyUI "
                                "(--comfyui DIR or COMFYUI_DIR)")
        return contextlib.nullcontext()
    if models_dir is not None and not models_dir.strip():  # an unset shell variable: not the working directory
        raise WorkflowError(f"--models-dir {models_dir!r} is empty: pass the folder that holds diffusion_models/, "
                            f"checkpoints/, ... (laid out like ComfyUI's models/)")
    return library.run_folders(host.output_dir(), host.loras_dir(), models_dir)


def headless_host(output_dir: str, resume: bool, log_dir: str | None = None):
    """The nodes run headless inside this block: where to write, whether to resume, where TensorBoard logs go;
    restored on exit."""
    from .nodes import host
    from .training.distributed import current
    scratch = current().scratch_dir  # torchrun ranks other than 0 write only into a private folder
    return host.headless(output_dir if scratch is None else scratch, run_dir=output_dir, resume=resume,
                         log_dir=log_dir)


def _check_tensorboard(log_dir: str) -> None:
    from .headless.graph import WorkflowError
    from .training.tensorboard_log import summary_writer_class
    from .training.train_config import ConfigError
    try:
        summary_writer_class(log_dir, setting="--log-dir")
    except ConfigError as e:
        raise WorkflowError(str(e)) from None


def run_bench(argv: list[str]) -> int:
    from .bench.cli import main as bench_main
    code = bench_main(argv)
    return code if isinstance(code, int) else EXIT_OK


def _print_progress(node_id: str, class_type: str, position: int, total: int) -> None:
    print(f"[{position}/{total}] node {node_id} '{class_type}'", file=sys.stderr, flush=True)
