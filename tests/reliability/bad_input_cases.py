"""Every bad input a user can give, run through the real node classes: (id, input, node, exception type, words the
message must contain (the input's name and the fix), the call). docs/bad_input.md is generated from these."""
from __future__ import annotations

import io
import shutil
import struct
import zlib
from dataclasses import dataclass
from typing import Callable
from unittest import mock

import torch
from PIL import Image
from reliability_kit import dataset_inputs, load_dataset, lora, resuming, strategy, train_node, world
from safetensors.torch import save_file

from tightrope.headless.comfyui_library import load_comfyui
from tightrope.memory.strategy import Strategy
from tightrope.nodes import host
from tightrope.nodes.dataset_nodes import TightropeLoadDataset
from tightrope.nodes.demo_nodes import TightropeDemoModel
from tightrope.nodes.save_node import TightropeSaveLora
from tightrope.training.state import atomic_write
from tightrope.training.state.resume import state_path
from tightrope.training.state.lock import state_lock


@dataclass
class Ctx:
    out: object   # headless output (= loras) folder
    tmp: object   # scratch folder for inputs

    def folder(self, *files: tuple[str, bytes]):
        """A dataset folder: one good captioned image plus `files` (name, bytes)."""
        d = self.tmp / "data"
        d.mkdir(exist_ok=True)
        (d / "good.png").write_bytes(png(Image.new("RGB", (32, 32), (200, 30, 30))))
        (d / "good.txt").write_text("a red square")
        for name, data in files:
            (d / name).write_bytes(data)
        return str(d)


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def huge_png(width=20000, height=20000) -> bytes:
    """A tiny file whose header claims a huge image (a decompression bomb): IHDR rewritten, CRC fixed."""
    data = bytearray(png(Image.new("L", (1, 1))))
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return bytes(data)


def strict_load(ctx, *files):
    TightropeLoadDataset().load(**dataset_inputs(ctx.folder(*files), strict=True))


def train_with(ctx, **kw):
    model, dataset, spec, strat = world(ctx.out)
    train_node(**({"model": model, "dataset": dataset, "lora_spec": spec, "strat": strat} | kw))


def foreign_lora(ctx):
    path = ctx.out / "sdxl_lora.safetensors"
    save_file({"diffusion_model.input_blocks.1.1.proj_in.lora_A.weight": torch.zeros(4, 320),
               "diffusion_model.input_blocks.1.1.proj_in.lora_B.weight": torch.zeros(320, 4)}, str(path))
    train_with(ctx, lora_spec=lora(existing_lora=str(path)))


def other_model_state(ctx):
    model, dataset, spec, strat = world(ctx.out)
    train_node(model, dataset, spec, strat, steps=1, save_every=1)
    with resuming():
        train_node(TightropeDemoModel().load(1)[0], dataset, spec, strat, steps=2)


def damaged_state(ctx):
    (host.state_dir() / "rt").mkdir(parents=True, exist_ok=True)
    (host.state_dir() / "rt" / "lora.state.safetensors").write_bytes(b"\x10\x00\x00\x00not a header")
    with resuming():
        train_with(ctx)


def locked_state(ctx):
    with state_lock(state_path(host.state_dir(), "rt/lora")):  # as another run training into it holds it
        train_with(ctx)


def other_node_state(ctx):
    model, dataset, spec, strat = world(ctx.out)
    train_node(model, dataset, spec, strat, steps=1, unique_id="7")
    shutil.copy(state_path(host.state_dir(), "rt/lora", "7"), state_path(host.state_dir(), "rt/lora", "8"))
    with resuming():
        train_node(model, dataset, spec, strat, steps=1, unique_id="8")


def out_of_memory(ctx):
    model, dataset, spec, strat = world(ctx.out)
    real, calls = model.predict, []

    def predict(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(*args, **kwargs)
    model.predict = predict
    try:
        train_node(model, dataset, spec, strat, steps=3)
    finally:
        del model.predict


def nan_loss(ctx):
    model, dataset, spec, strat = world(ctx.out)
    real, calls = model.predict, []
    model.predict = lambda *a, **k: real(*a, **k) * (float("nan") if calls.append(1) or len(calls) == 2 else 1.0)
    try:
        train_node(model, dataset, spec, strat, steps=3)
    finally:
        del model.predict


@dataclass
class Case:
    id: str
    input: str
    node: str
    error: str
    words: tuple[str, ...]
    run: Callable[[Ctx], object]


DATA, LORA, STRAT, TRAIN = "Load Dataset", "LoRA Setup", "Memory Strategy", "Train LoRA"
SAVE, CHAIN = "Save LoRA", " (chain)"
CASES = [
    Case("missing_folder", "dataset folder that does not exist", DATA, "DatasetError", ("'<tmp>/nope'", "pass the"),
         lambda c: load_dataset(c.tmp / "nope")),
    Case("empty_folder", "empty dataset folder", DATA, "DatasetError", ("has no images", "put"),
         lambda c: load_dataset((c.tmp / "empty").mkdir() or c.tmp / "empty")),
    Case("corrupt_image", "corrupt image (strict)", DATA, "DatasetError", ("bad.png", "re-export"),
         lambda c: strict_load(c, ("bad.png", b"not an image at all"), ("bad.txt", b"x"))),
    Case("truncated_image", "truncated image (strict)", DATA, "DatasetError", ("cut.png", "re-export"),
         lambda c: strict_load(c, ("cut.png", png(Image.new("RGB", (64, 64), (1, 2, 3)))[:60]), ("cut.txt", b"x"))),
    Case("empty_caption", "zero-byte caption file (strict)", DATA, "DatasetError", ("b.txt", "write a caption"),
         lambda c: strict_load(c, ("b.png", png(Image.new("RGB", (32, 32)))), ("b.txt", b""))),
    Case("bad_utf8_caption", "caption that is not UTF-8 (strict)", DATA, "DatasetError", ("b.txt", "UTF-8"),
         lambda c: strict_load(c, ("b.png", png(Image.new("RGB", (32, 32)))), ("b.txt", b"caf\xe9 \xff"))),
    Case("caption_case_twins", "two caption files whose names differ only in case ('A.txt' and 'a.TXT' for "
         "'a.png', a case-sensitive file system)", DATA, "DatasetError", ("A.txt, a.TXT", "keep one"),
         lambda c: strict_load(c, ("a.png", png(Image.new("RGB", (32, 32)))), ("A.txt", b"x"), ("a.TXT", b"y"))),
    Case("huge_image", "decompression bomb (20000x20000 header)", DATA, "DatasetError", ("huge.png", "downscale"),
         lambda c: strict_load(c, ("huge.png", huge_png()), ("huge.txt", b"x"))),
    Case("all_images_bad", "every image unusable (strict off)", DATA, "DatasetError", ("no usable images", "bad.png"),
         lambda c: _all_bad(c)),
    Case("repeats_date_folder", "a subfolder named like a date, read as kohya repeats ('20240615_beach')", DATA,
         "DatasetError", ("'<tmp>/dated/20240615_beach' asks for 20240615 repeats", "rename the folder",
                          "use_repeats to false"), lambda c: _dated(c)),
    Case("rank_0", "LoRA rank 0", LORA, "LoraError", ("rank=0", "rank of 1 or more"), lambda c: lora(rank=0)),
    Case("rank_too_big", "LoRA rank larger than the layer", TRAIN, "LoraError", ("rank=512", "use rank <= 128"),
         lambda c: train_with(c, lora_spec=lora(rank=512, alpha=512.0))),
    Case("alpha_0", "LoRA alpha 0", LORA, "LoraError", ("alpha=0", "greater than 0"), lambda c: lora(alpha=0.0)),
    Case("alpha_negative", "LoRA alpha < 0", LORA, "LoraError", ("alpha=-1", "greater than 0"),
         lambda c: lora(alpha=-1.0)),
    Case("lr_0", "learning rate 0", TRAIN, "ConfigError", ("learning_rate=0", "greater than 0"),
         lambda c: train_with(c, learning_rate=0.0)),
    Case("lr_negative", "learning rate < 0", TRAIN, "ConfigError", ("learning_rate=-0.001", "greater than 0"),
         lambda c: train_with(c, learning_rate=-1e-3)),
    Case("lr_nan", "learning rate NaN", TRAIN, "ConfigError", ("learning_rate=nan", "give a number"),
         lambda c: train_with(c, learning_rate=float("nan"))),
    Case("steps_0", "steps 0", TRAIN, "ConfigError", ("steps=0", "at least 1 step"), lambda c: train_with(c, steps=0)),
    Case("batch_too_big", "batch larger than the dataset", TRAIN, "DatasetError", ("batch_size=64", "lower batch_size"),
         lambda c: train_with(c, batch_size=64)),
    Case("offload_over_1", "offload fraction > 1", STRAT, "StrategyError", ("offload_fraction=1.5", "0.0 to 1.0"),
         lambda c: strategy(offload_fraction=1.5)),
    Case("offload_negative", "offload fraction < 0", STRAT, "StrategyError", ("offload_fraction=-0.1", "0.0 to 1.0"),
         lambda c: strategy(offload_fraction=-0.1)),
    Case("block_lists_missing", "strategy block_lists naming a missing list", TRAIN, "StrategyError",
         ("block_lists names 'blocks'", "give the dotted path"),
         lambda c: train_with(c, strat=Strategy.of(compute_dtype="fp32", block_lists=("blocks",)))),
    Case("offload_blocks_range", "strategy offload_blocks out of range", TRAIN, "StrategyError",
         ("offload_blocks has indices [9]", "use indices in that range"),
         lambda c: train_with(c, strat=Strategy.of(compute_dtype="fp32", offload_blocks=(9,)))),
    Case("lora_other_model", "existing LoRA for another architecture", TRAIN, "LoraError",
         ("sdxl_lora.safetensors", "pick a LoRA made for this model"), foreign_lora),
    Case("lora_not_safetensors", "existing LoRA that is not .safetensors", LORA, "LoraError",
         ("old.ckpt", "never pickled"), lambda c: lora(existing_lora="old.ckpt")),
    Case("lora_missing", "existing LoRA that does not exist", LORA, "LoraError", ("gone.safetensors", "was not found"),
         lambda c: lora(existing_lora="gone.safetensors")),
    Case("prefix_dotdot", "filename prefix with '..'", TRAIN, "OutputPathError", ("'../escape'", "may only go down"),
         lambda c: train_with(c, filename_prefix="../escape")),
    Case("prefix_absolute", "absolute filename prefix", TRAIN, "OutputPathError",
         ("'/tmp/escape'", "relative to the folder files go under"),
         lambda c: train_with(c, filename_prefix="/tmp/escape")),
    Case("prefix_home", "filename prefix starting with '~'", TRAIN, "OutputPathError",
         ("'~/loras/x' starts with '~'", "not a home folder"), lambda c: train_with(c, filename_prefix="~/loras/x")),
    Case("prefix_windows_long_path", "filename prefix whose files' paths pass the 259 characters of Windows "
         "without long paths", TRAIN, "OutputPathError", ("LongPathsEnabled", "_00001_.safetensors", "shorter"),
         lambda c: _windows_short_paths(c)),
    Case("save_prefix_dotdot", "Save LoRA prefix with '..'", "Save LoRA", "OutputPathError", ("'a/../../x'", "only go down"),
         lambda c: TightropeSaveLora().save(train_node(*world(c.out), steps=1)[0], "a/../../x")),
    Case("resume_other_model", "resume file of another model", TRAIN + " (--resume)", "ResumeError",
         ("lora.state.safetensors", "belongs to another model"), other_model_state),
    Case("resume_damaged", "damaged resume file", TRAIN + " (--resume)", "ResumeError",
         ("lora.state.safetensors", "delete it"), damaged_state),
    Case("out_of_memory", "out of GPU memory in a step", TRAIN, "TrainingOutOfMemoryError",
         ("out of memory", "offload_fraction=1.0, checkpoint='all'"), out_of_memory),
    Case("nan_loss", "loss becomes NaN (on_nonfinite='stop')", TRAIN, "NonFiniteLossError",
         ("learning_rate", "on_nonfinite='skip'"), nan_loss),
    # --- resume ---
    Case("state_locked", "a second run into a training state file in use", TRAIN, "StateLockedError",
         ("lora.state.safetensors", "another run is training into", "another output folder"), locked_state),
    Case("resume_other_node", "resume file of another Train node", TRAIN + " (--resume)", "ResumeError",
         ("lora.node-8.state.safetensors' belongs to node 7, not to this node 8", "delete it"), other_node_state),
    # --- hostram ---
    Case("host_ram_too_small", "auto strategy with a host-RAM budget smaller than the model", TRAIN,
         "StrategyError", ("host_ram_budget_gb", "8-bit weights"),
         lambda c: train_with(c, strat=strategy(mode="auto", vram_budget_gb=1.0, host_ram_budget_gb=0.004))),
    # --- headlesscomfy ---
    Case("comfyui_dir_missing", "--comfyui DIR that does not exist", "tightrope run", "ComfyUIUnavailable",
         ("'<tmp>/nope'", "pass --comfyui DIR"), lambda c: load_comfyui(c.tmp / "nope")),
    Case("comfyui_not_comfyui", "--comfyui DIR that is not a ComfyUI", "tightrope run", "ComfyUIUnavailable",
         ("is not a ComfyUI", "main.py and nodes.py"), lambda c: load_comfyui(c.tmp)),
    Case("comfyui_too_old", "--comfyui DIR holding a ComfyUI older than 0.33", "tightrope run", "ComfyUIUnavailable",
         ("version 0.3.10", "0.33 and newer"), lambda c: load_comfyui(fake_comfyui(c.tmp / "old", "0.3.10"))),
]


def _windows_short_paths(c):
    """Windows with long paths not enabled (the default), simulated: a 260-character path fails there."""
    with mock.patch.object(atomic_write, "windows_short_paths", lambda: True):
        train_with(c, filename_prefix="tightrope/" + "x" * 120 + "/" + "y" * 100)


def _dated(c):
    """A folder named by date: kohya reads 20 million repeats an image (found by a helper: minutes and gigabytes per
    Train node, then out of memory)."""
    d = c.tmp / "dated" / "20240615_beach"
    d.mkdir(parents=True)
    (d / "a.png").write_bytes(png(Image.new("RGB", (32, 32), (200, 30, 30))))
    (d / "a.txt").write_text("a beach")
    return load_dataset(c.tmp / "dated")


def _all_bad(c):
    d = c.tmp / "allbad"
    d.mkdir()
    (d / "bad.png").write_bytes(b"junk")
    (d / "bad.txt").write_text("x")
    return load_dataset(d)


# --- headlesscomfy ---
def fake_comfyui(folder, version: str):
    """A folder shaped like a ComfyUI checkout of `version` (files only: it is refused before anything is imported)."""
    (folder / "comfy").mkdir(parents=True)
    for name in ("nodes.py", "folder_paths.py", "execution.py"):
        (folder / name).write_text("")
    (folder / "comfyui_version.py").write_text(f'__version__ = "{version}"\n')
    return folder
