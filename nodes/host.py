"""Where the nodes run: inside ComfyUI (folders, progress bar and interrupt from ComfyUI) or headless (`tightrope run`).

ComfyUI has imported `folder_paths` before it loads any custom node, so its presence in sys.modules tells the two
apart; ComfyUI modules are only imported inside these functions, and only when ComfyUI is running.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

_headless_output: Path | None = None
_headless_run_dir: Path | None = None
_resume = False
_log_dir: Path | None = None


def set_headless_output_dir(path: str | Path) -> None:
    global _headless_output, _headless_run_dir
    _headless_output = Path(path)
    _headless_run_dir = None  # the run dir is the output dir unless set_headless_run_dir says otherwise
    _headless_output.mkdir(parents=True, exist_ok=True)


def set_headless_run_dir(path: str | Path | None) -> None:
    """Headless, after set_headless_output_dir: the run's --output-dir, the same on every rank. Under torchrun the
    other ranks' output_dir() is a private scratch folder; the LoRAs and the cache, read by all, are in run_dir()."""
    global _headless_run_dir
    _headless_run_dir = Path(path) if path is not None else None


def run_dir() -> Path:
    """The run's output folder as every rank sees it (read resume state from here); output_dir() but under torchrun
    on ranks other than 0."""
    return _headless_run_dir if _headless_run_dir is not None and not in_comfyui() else output_dir()


def is_main() -> bool:
    """False on the other ranks of a torchrun run: they train in step but show no progress."""
    from ..training.distributed import current
    return current().is_main


def set_resume(flag: bool) -> None:
    global _resume
    _resume = bool(flag)


def resume_requested() -> bool:
    return _resume


def set_log_dir(path: str | Path | None) -> None:
    """`tightrope run --log-dir`: TensorBoard's folder for Train nodes whose own log_dir is empty."""
    global _log_dir
    _log_dir = Path(path).absolute() if path else None


def tensorboard_dir(node_log_dir: str) -> Path | None:
    """Where a Train node writes TensorBoard scalars: its log_dir (relative to the output folder), else the run's
    --log-dir, else nowhere (None)."""
    if node_log_dir:
        return output_dir() / node_log_dir
    return _log_dir


def in_comfyui() -> bool:
    return _headless_output is None and "folder_paths" in sys.modules


def output_dir() -> Path:
    if in_comfyui():
        import folder_paths
        return Path(folder_paths.get_output_directory())
    return _headless_output or Path("output")


def loras_dir() -> Path:
    """ComfyUI's first `loras` folder (so LoraLoader lists the file at once); the output folder headless."""
    if in_comfyui():
        import folder_paths
        return Path(folder_paths.get_folder_paths("loras")[0])
    return run_dir()  # every rank reads LoRAs from here; under torchrun only rank 0 writes (Save node, trainer)


def state_dir() -> Path:
    """Training state files (for `--resume`) and their locks, where no LoRA list shows them: ComfyUI lists every
    .safetensors under models/loras as a LoRA, so the state lives in its user folder; headless in the output dir."""
    if in_comfyui():
        import folder_paths
        return Path(folder_paths.get_user_directory()) / "tightrope_state"
    return run_dir() / ".tightrope_state"  # rank 0 writes, every rank reads it on --resume


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
    if in_comfyui():
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


def interrupt_requested() -> bool:
    if in_comfyui():
        import comfy.model_management
        return comfy.model_management.processing_interrupted()
    return False


def raise_interrupt() -> None:
    """Let ComfyUI end the prompt as interrupted (after we saved what was trained)."""
    if in_comfyui():
        import comfy.model_management
        comfy.model_management.throw_exception_if_processing_interrupted()
    raise KeyboardInterrupt("training interrupted")
