"""Host-memory benchmark inside a real ComfyUI server (CPU): what a training prompt adds to the server's RSS.

Needs COMFYUI_DIR (ComfyUI's source dir) and its python, COMFYUI_PYTHON (default $COMFYUI_DIR/../venv/bin/python),
with Tightrope's requirements installed. For offload 0 / 0.5 / 1.0, one fresh server per configuration (--cpu, an
in-memory database, a temporary base directory with this checkout as its only custom node):
1. a load prompt: UNETLoader reads a Flux-shaped checkpoint of W bytes (fp32, written once), a Preview node shows
   it; the server's RSS a few seconds later is the loaded level. (The training prompts reuse this model: traced in
   session 5b, UNETLoader ran once per server and the weights kept their storages; ComfyUI 0.33's default
   RAM-pressure cache drops an output the running prompt uses only when free RAM is below its headroom: see
   benchmarks/results/cpu-2026-11-23/host_memory_notes.md);
2. training prompts (Demo Images -> Load Dataset -> LoRA Setup -> Memory Strategy -> Train -> Save LoRA), each with
   a new seed so ComfyUI's cache re-runs the training but keeps the loaded model; the RSS is sampled from outside
   (/proc/PID/status, every 20 ms): the plateau (median while the prompt runs) and the peak, above the loaded level;
3. after each prompt (settled), the RSS against the loaded level (target: within 2 %).
With control=True, one more server runs sampling prompts instead (ComfyUI's KSampler, 2 steps on the same model at
the training images' token count, no Tightrope node but the stand-in conditioning): what ComfyUI itself keeps after a
prompt that runs the model, to set against what a training prompt keeps.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

from .comfy_server import Server, comfy_python

REPO = Path(__file__).resolve().parents[1]
SKIP_REASON = "COMFYUI_DIR is not set: set it to a ComfyUI source dir to measure inside a real ComfyUI server"
PROMPTS = 3        # training prompts per server (does what a prompt keeps repeat?)
SETTLE_S = 3.0     # after a prompt, before reading the RSS it settled at


def memory_status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) * 1024
    return out


class RssSampler:
    """Samples a process's VmRSS every `period` seconds in a thread, while `with`-entered."""

    def __init__(self, pid: int, period: float = 0.02):
        self.pid, self.period, self.samples = pid, period, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(memory_status(self.pid)["VmRSS"])
            except (OSError, KeyError):
                return
            time.sleep(self.period)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _inputs(class_type: str, **given) -> dict:
    """Every required widget's default from Tightrope's INPUT_TYPES (ComfyUI's own nodes: only what is given)."""
    from .. import NODE_CLASS_MAPPINGS
    cls, out = NODE_CLASS_MAPPINGS.get(class_type), {}
    for name, (kind, opts) in (cls.INPUT_TYPES()["required"].items() if cls else ()):
        if isinstance(kind, list):
            out[name] = opts.get("default", kind[0])
        elif "default" in opts:
            out[name] = opts["default"]
    return {"class_type": class_type, "inputs": {**out, **given}}


def prompts(checkpoint: str, offload: float) -> tuple[dict, callable]:
    """The load prompt, and train(seed) -> a training prompt sharing its loader node (so ComfyUI's cache keeps the
    loaded model)."""
    load = {"1": _inputs("UNETLoader", unet_name=checkpoint, weight_dtype="default"),
            "2": _inputs("PreviewAny", source=["1", 0])}

    def train(seed: int) -> dict:
        return {"1": load["1"],
                "3": _inputs("TightropeDemoImages", subfolder="host_memory_images", count=4, size=32, seed=0),
                "4": _inputs("TightropeDemoEncoders", seed=0),
                "5": _inputs("TightropeLoadDataset", folder=["3", 0], vae=["4", 0], clip=["4", 1], resolution=32),
                "6": _inputs("TightropeLoraSetup", rank=4, alpha=4.0),
                "7": _inputs("TightropeMemoryStrategy", mode="manual", offload_fraction=offload,
                             compute_dtype="fp32"),
                "8": _inputs("TightropeTrain", steps=2, device="cpu", filename_prefix=f"host_memory/run{seed}",
                             seed=seed, model=["1", 0], dataset=["5", 0], lora=["6", 0], strategy=["7", 0]),
                "9": _inputs("TightropeSaveLora", session=["8", 0], filename_prefix=f"host_memory/final{seed}")}
    return load, train


def sample(load: dict, seed: int) -> dict:
    """The control prompt: ComfyUI's KSampler, 2 steps at 64 tokens (a 128 px latent, as the 32 px training images
    under the demo VAE's 2x downscale), sharing the load prompt's loader node; PreviewAny is its output."""
    return {"1": load["1"],
            "3": _inputs("TightropeDemoConditioning", model=["1", 0], text="a red circle", tokens=16, seed=0),
            "4": _inputs("EmptySD3LatentImage", width=128, height=128, batch_size=1),
            "5": _inputs("KSampler", model=["1", 0], seed=seed, steps=2, cfg=1.0, sampler_name="euler",
                         scheduler="simple", positive=["3", 0], negative=["3", 0], latent_image=["4", 0],
                         denoise=1.0),
            "6": _inputs("PreviewAny", source=["5", 0])}


def measure_one(comfy_dir: str, checkpoint: Path, offload: float | None) -> dict:
    """offload None: the sampling control (no training prompt)."""
    with tempfile.TemporaryDirectory(prefix="tightrope-host-memory-") as tmp:
        base = Path(tmp)
        (base / "custom_nodes").mkdir()
        (base / "custom_nodes" / "tightrope").symlink_to(REPO, target_is_directory=True)
        (base / "models" / "diffusion_models").mkdir(parents=True)
        (base / "models" / "diffusion_models" / checkpoint.name).symlink_to(checkpoint)
        server = Server(comfy_dir, base)
        try:
            server.wait_ready()
            load, train = prompts(checkpoint.name, 0.0 if offload is None else offload)
            if offload is None:
                train = partial(sample, load)
            started = memory_status(server.proc.pid)
            server.run(load)
            time.sleep(SETTLE_S)
            loaded = memory_status(server.proc.pid)
            runs = []
            for seed in range(1, PROMPTS + 1):
                with RssSampler(server.proc.pid) as sampler:
                    server.run(train(seed))
                time.sleep(SETTLE_S)
                runs.append({"plateau_rss_bytes": int(statistics.median(sampler.samples)),
                             "peak_rss_bytes": max(sampler.samples), "samples": len(sampler.samples),
                             "after": memory_status(server.proc.pid)})
            return {"offload": offload, "started": started, "loaded": loaded, "runs": runs}
        finally:
            server.stop()


def environment() -> dict[str, str]:
    """The ComfyUI version (its comfyui_version.py) and the torch version of its python."""
    comfy_dir = os.path.abspath(os.environ["COMFYUI_DIR"])
    version_file = Path(comfy_dir) / "comfyui_version.py"
    text = version_file.read_text(encoding="utf-8") if version_file.exists() else ""
    comfyui = next((line.split("=", 1)[1].strip().strip("\"'") for line in text.splitlines()
                    if line.startswith("__version__")), "unknown")
    torch_version = subprocess.run([comfy_python(comfy_dir), "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    return {"comfyui": comfyui, "torch": torch_version}


def write_checkpoint(folder: Path, params) -> Path:
    from ..demo.tiny_checkpoint import make_tiny_checkpoint
    return Path(make_tiny_checkpoint(folder / "host_memory_flux.safetensors", params=params, seed=0))


def measure(params, offloads: tuple[float, ...], weights_bytes: int, control: bool = False) -> list[dict]:
    """One fresh server per offload (and one for the sampling control, offload None, with `control`); figures as
    multiples of W = `weights_bytes`."""
    comfy_dir = os.path.abspath(os.environ["COMFYUI_DIR"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="tightrope-host-memory-ckpt-") as tmp:
        checkpoint = write_checkpoint(Path(tmp), params)
        for offload in (*offloads, None) if control else offloads:
            r = measure_one(comfy_dir, checkpoint, offload)
            base = r["loaded"]["VmRSS"]
            r["weights_bytes"] = weights_bytes
            r["loaded_above_started_w"] = (base - r["started"]["VmRSS"]) / weights_bytes
            for run in r["runs"]:
                run["plateau_above_loaded_w"] = (run["plateau_rss_bytes"] - base) / weights_bytes
                run["peak_above_loaded_w"] = (run["peak_rss_bytes"] - base) / weights_bytes
                run["after_vs_loaded"] = run["after"]["VmRSS"] / base - 1
            rows.append(r)
            print(f"server, {_label(offload)}: " + json.dumps(
                [{k: round(v, 3) for k, v in run.items() if isinstance(v, float)} for run in r["runs"]]), flush=True)
    return rows


def _label(offload: float | None) -> str:
    return "control (KSampler, no training)" if offload is None else f"offload {offload:g}"


def markdown(rows: list[dict], env: dict[str, str] | None = None) -> list[str]:
    where = f" (ComfyUI {env['comfyui']}, torch {env['torch']}, --cpu)" if env else ""
    lines = [f"## Inside a real ComfyUI server{where}", "",
             "One fresh server per row; a load prompt (UNETLoader + Preview), then "
             f"{PROMPTS} training prompts of 2 steps each (64-token images, batch 1), each with a new seed. "
             "Loaded: the "
             "server's RSS after the load prompt. Plateau: the median RSS while a prompt runs; peak: its maximum "
             "(sampled every 20 ms from outside); after: settled, vs loaded, and the anonymous and file-backed "
             "(library code) parts of it in MiB."
             + (" Control: a server whose prompts sample (ComfyUI's KSampler, 2 steps at the same 64 tokens) instead "
                "of training: what ComfyUI keeps after a prompt that runs the model." if any(
                    r["offload"] is None for r in rows) else ""), "",
             "| offload | loaded (above the idle server) | prompt | plateau above loaded | peak above loaded | "
             "after vs loaded | after: anon / file |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for k, run in enumerate(r["runs"], 1):
            anon, file = ((run["after"][key] - r["loaded"][key]) / 2**20 for key in ("RssAnon", "RssFile"))
            offload = "control" if r["offload"] is None else f"{r['offload']:g}"
            lines.append(f"| {offload} | +{r['loaded_above_started_w']:.2f} W | {k} | "
                         f"{run['plateau_above_loaded_w']:+.2f} W | {run['peak_above_loaded_w']:+.2f} W | "
                         f"{100 * run['after_vs_loaded']:+.2f} % | {anon:+.1f} / {file:+.1f} |")
    return lines
