"""Where the nodes run: inside ComfyUI (folders, progress bar and interrupt from ComfyUI) or headless (`tightrope run`).

ComfyUI has imported `folder_paths` before it loads any custom node, so its presence in sys.modules tells the two
apart; ComfyUI modules are only imported inside these functions, and only when ComfyUI is running. A headless run
happens inside `with headless(...)` (the CLI enters it): the nodes see its folders and --resume flag for the block
only, and whatever was there before (ComfyUI, or an outer block) is back when it exits.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator


@dataclass(frozen=True)
class HeadlessRun:
    """What the nodes of one headless run need to know about it."""
    output: Path   # this process's outputs: --output-dir (on other torchrun ranks a private scratch folder)
    run_dir: Path  # the run's --output-dir, the same on every rank: LoRAs, the cache and resume state are read here
    resume: bool   # --resume: go on from the training state files in run_dir
    log_dir: Path | None = None  # --log-dir: TensorBoard's folder for Train nodes whose own log_dir is empty


_headless: HeadlessRun | None = None  # set only inside `with headless(...)`


@contextlib.contextmanager
def headless(output_dir: str | Path, *, run_dir: str | Path | None = None,
             resume: bool = False, log_dir: str | Path | None = None) -> Iterator[HeadlessRun]:
    """Run the nodes headless for the block: outputs go to `output_dir` (created), shared reads come from `run_dir`
    (default: `output_dir`). The previous host is restored on exit, however the block ends."""
    global _headless
    run = HeadlessRun(Path(output_dir), Path(run_dir if run_dir is not None else output_dir), bool(resume),
                      Path(log_dir).absolute() if log_dir else None)
    run.output.mkdir(parents=True, exist_ok=True)
    previous, _headless = _headless, run
    try:
        yield run
    finally:
        _headless = previous


def run_dir() -> Path:
    """The run's output folder as every rank sees it (read resume state from here); output_dir() but under torchrun
    on ranks other than 0."""
    return _headless.run_dir if _headless is not None else output_dir()


def is_main() -> bool:
    """False on the other ranks of a torchrun run: they train in step but show no progress."""
    from ..training.distributed import current
    return current().is_main


def resume_mode(widget: bool = True) -> str:
    """How a Train node goes on from its training state file (training_run.run_training_node's `resume`): headless,
    "asked" with --resume, else "unasked" (an interrupted run's state is not trained over); in ComfyUI, "same run"
    while the node's `resume` widget is on, else "off"."""
    if _headless is not None:
        return "asked" if _headless.resume else "unasked"
    return "same run" if widget and in_comfyui() else "off"


def tensorboard_dir(node_log_dir: str) -> Path | None:
    """Where a Train node writes TensorBoard scalars: its log_dir (relative to the output folder), else the run's
    --log-dir, else nowhere (None)."""
    if node_log_dir:
        return output_dir() / node_log_dir
    return _headless.log_dir if _headless is not None else None


def in_comfyui() -> bool:
    return _headless is None and "folder_paths" in sys.modules


def comfyui_device_type() -> str | None:
    """The type of the device ComfyUI runs models on ('cuda', 'mps', 'xpu', 'privateuseone' for DirectML, 'cpu');
    None headless or where ComfyUI cannot say."""
    if not in_comfyui():
        return None
    try:
        import comfy.model_management
        return comfy.model_management.get_torch_device().type
    except Exception:  # noqa: BLE001  (a note's detail: never a reason to fail a node)
        return None


def output_dir() -> Path:
    if in_comfyui():
        import folder_paths
        return Path(folder_paths.get_output_directory())
    return _headless.output if _headless is not None else Path("output")


def loras_dir() -> Path:
    """ComfyUI's first `loras` folder (so LoraLoader lists the file at once); the output folder headless."""
    if in_comfyui():
        import folder_paths
        return Path(folder_paths.get_folder_paths("loras")[0])
    return run_dir()  # every rank reads LoRAs from here; under torchrun only rank 0 writes (Save node, trainer)


HEADLESS_STATE_DIR = ".tightrope_state"  # state_dir's folder in a headless run's output dir


def state_dir() -> Path:
    """Training state files (for `--resume`) and their locks, where no LoRA list shows them: ComfyUI lists every
    .safetensors under models/loras as a LoRA, so the state lives in its user folder; headless in the output dir."""
    if in_comfyui():
        import folder_paths
        return Path(folder_paths.get_user_directory()) / "tightrope_state"
    return run_dir() / HEADLESS_STATE_DIR  # rank 0 writes, every rank reads it on --resume


def notify(message: str) -> None:
    """A one-line note for the user (ComfyUI's console, or stderr headless); torchrun ranks other than 0 stay quiet."""
    if is_main():
        from tqdm import tqdm
        tqdm.write(f"tightrope: {message}", file=sys.stderr)  # on a line of its own, above a running progress bar


def preview_dir() -> tuple[Path, str]:
    """Folder for preview images, and ComfyUI's name for its kind ("temp" is served to the UI)."""
    if in_comfyui():
        import folder_paths
        return Path(folder_paths.get_temp_directory()), "temp"
    return output_dir(), "output"


def cache_dir() -> Path:
    """Latent/embedding cache; it survives restarts (ComfyUI's temp folder does not)."""
    if in_comfyui():
        import folder_paths
        return Path(folder_paths.get_user_directory()) / "tightrope_cache"
    return run_dir() / ".tightrope_cache"  # shared by all ranks: writes are atomic and content-addressed


def progress_reporter(total: int) -> Callable[[int, int, float], None]:
    if in_comfyui():  # the server's progress hook raises on an interrupt: interrupt_exceptions() covers it
        import comfy.utils
        bar = comfy.utils.ProgressBar(total)
        return lambda done, _total, _loss: bar.update_absolute(done, total)
    if not is_main():
        return lambda done, _total, _loss: None
    from tqdm import tqdm
    bar = tqdm(total=total, desc="training", unit="step", dynamic_ncols=True)

    def report(done: int, _total: int, loss: float) -> None:
        bar.n = done
        bar.set_postfix(loss=f"{loss:.4f}")
        if done >= total:
            bar.close()

    return report


def work_progress(what: str, unit: str = "image") -> Callable[[int, int], None]:
    """progress(done, total) for work before training (encoding a dataset, an `auto` strategy's probe): ComfyUI's
    progress bar, which also ends the work when the user interrupts (ComfyUI's own interrupt exception); a tqdm bar
    headless (rank 0)."""
    bars: dict = {}
    if in_comfyui():
        import comfy.model_management
        import comfy.utils

        def report(done: int, total: int) -> None:
            comfy.model_management.throw_exception_if_processing_interrupted()
            if "bar" not in bars:  # the total is known once the folder is scanned
                bars["bar"] = comfy.utils.ProgressBar(total)
            bars["bar"].update_absolute(done, total)
        return report
    if not is_main():
        return lambda done, total: None
    from tqdm import tqdm

    def report_tqdm(done: int, total: int) -> None:
        if "bar" not in bars:
            bars["bar"] = tqdm(total=total, desc=what, unit=unit, dynamic_ncols=True)
        bars["bar"].n = done
        bars["bar"].refresh()
        if done >= total:
            bars["bar"].close()
    return report_tqdm


def interrupt_requested() -> bool:
    if in_comfyui():
        import comfy.model_management
        return comfy.model_management.processing_interrupted()
    return False


def interrupt_exceptions() -> tuple[type[BaseException], ...]:
    """What the host raises inside a step on an interrupt: ComfyUI's ops check its flag before every op and raise
    (taking the flag); the trainer ends the run as interrupted on it (trainer.train)."""
    if in_comfyui():
        import comfy.model_management
        return (comfy.model_management.InterruptProcessingException,)
    return ()


def raise_interrupt() -> None:
    """Let ComfyUI end the prompt as interrupted (after we saved what was trained), whether or not an op already took
    its interrupt flag."""
    if in_comfyui():
        import comfy.model_management
        comfy.model_management.interrupt_current_processing(False)
        raise comfy.model_management.InterruptProcessingException()
    raise KeyboardInterrupt("training interrupted")
