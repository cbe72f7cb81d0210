"""Host-memory benchmark for a MODEL that ComfyUI loaded for dynamic VRAM (comfy-aimdo, ComfyUI's default on NVIDIA
GPUs), emulated on the CPU: how much host RAM a training run adds above the loaded model, as multiples of W.

Under dynamic VRAM ComfyUI maps the model file read-only and its modules hold the mapping's tensors, in the file's
dtype. ModelPatcherDynamic itself needs CUDA, so `load_dynamic` loads the model with ComfyUI's own dynamic-VRAM file
loading (aimdo's mapping; tensors assigned as they are) under a ModelPatcher that says it is dynamic, and puts on each
cast module the state ModelPatcherDynamic.load and a sampling run leave there (with ComfyUI's own pin-state structure); the integration
test tests/integration/test_comfy_dynamic_vram.py uses the same emulation.

Two fresh processes in ComfyUI's python, the same Flux-shaped checkpoint (bench/host_memory.py's MODEL): each loads
it, reads every weight once (a server that sampled with the model has its file pages resident: the loaded level),
resets the peak-RSS mark, trains 2 steps at offload 1.0 on the CPU device and reports its peak RSS (anonymous and
file-backed) above the loaded level:
- "tightrope": the Train node's own path (the training copy shares the mapped weights);
- "reload": the same after ComfyUI's own trainer's first step, `clone(force_deepcopy=True)`, which loads the file
  again into an ordinary model (what Tightrope did before session 6).
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .comfy_server import comfy_python

REPO = Path(__file__).resolve().parents[1]
MODES = ("tightrope", "reload")


def load_dynamic(checkpoint: str, **model_options):
    """(ComfyUI's MODEL for `checkpoint` as dynamic VRAM leaves it, emulated on the CPU; the list its file-reloads
    are appended to). Needs ComfyUI imported, comfy-aimdo installed."""
    import importlib

    import comfy.memory_management
    import comfy.model_patcher as mp
    import comfy.sd
    import comfy_aimdo.control
    import comfy_aimdo.host_buffer
    import torch
    if not comfy_aimdo.control.init("cuda"):  # loads aimdo's library; its file mapping needs no GPU
        raise RuntimeError("comfy-aimdo could not load its library")
    importlib.reload(comfy_aimdo.host_buffer)  # imported by ComfyUI before the library was loaded

    class Dynamic(mp.ModelPatcher):
        def is_dynamic(self):
            return True

    saved = comfy.memory_management.aimdo_enabled, mp.CoreModelPatcher
    comfy.memory_management.aimdo_enabled, mp.CoreModelPatcher = True, Dynamic
    try:
        p = comfy.sd.load_diffusion_model(checkpoint, model_options=model_options)
    finally:
        comfy.memory_management.aimdo_enabled, mp.CoreModelPatcher = saved
    dev = torch.device("cuda:0")
    p.model.dynamic_pins = {}
    mp.ModelPatcherDynamic.register_load_device(p, dev)
    for name, m in p.model.diffusion_model.named_modules():
        if hasattr(m, "comfy_cast_weights"):
            m.comfy_cast_weights, m.seed_key, m._pin_state = True, name, p.model.dynamic_pins[dev]
            m._v, m._v_signature = (0, 0, 4096), None
            m.weight_lowvram_function = m.bias_lowvram_function = None
            m.weight_function, m.bias_function = [], []
            if getattr(m, "weight", None) is None:
                continue
            # what a sampling run leaves after ComfyUI unloads the model (comfy.ops.cast_modules_with_vbar and
            # resolve_cast_module_with_vbar, comfy.pinned_memory.pin_memory; the unload frees their memory, not the
            # attributes): the staged device weights and their signature, the pin bookkeeping
            m._v_signature = object()
            m._v_weight = torch.empty(m.weight.shape, dtype=getattr(m, "weight_comfy_model_dtype", None) or
                                      m.weight.dtype, device="meta")  # device memory: no host bytes here
            m._v_bias = None if m.bias is None else torch.empty(m.bias.shape, dtype=m.bias.dtype, device="meta")
            m._pins = {"weights": {"registered": False, "balancer_priority": 0, "stack_index": 0}}
    for blocks in (m for m in p.model.diffusion_model.children() if isinstance(m, torch.nn.ModuleList)):
        for block in blocks:  # comfy/model_prefetch.py's per-block state (a captured CUDA graph with enable_graph)
            block._v_block_faulted, block._comfy_graph = False, {"graph": _CapturedGraph(), "signature": None}
    loads, (loader, args) = [], p.cached_patcher_init[:2]
    p.cached_patcher_init = (lambda *a, **k: loads.append(a) or loader(*a, **k), args)
    return p, loads


class _CapturedGraph:
    """Stands for a torch.cuda.CUDAGraph in a block's `_comfy_graph`: it cannot be copied."""

    def __deepcopy__(self, memo):
        raise TypeError("a captured CUDA graph cannot be deep-copied")


def child(comfy_dir: str, checkpoint: str, mode: str, txt_len: int, resolution: int) -> dict:
    sys.path.insert(0, comfy_dir)
    from comfy.cli_args import args
    args.cpu = True
    import torch

    from ..demo.conditioning import demo_conditioning
    from ..memory.strategy import Strategy
    from ..training.data.builder import dataset_from_conditioning
    from ..training.lora.layers import LoraSpec
    from ..training.train_config import TrainConfig
    from ..training.training_run import run_training_node
    from .proc_memory import process_memory, status_bytes
    with torch.inference_mode():  # as ComfyUI runs nodes
        patcher, loads = load_dynamic(checkpoint)
        weights = sum(t.nbytes for t in patcher.model.diffusion_model.parameters())
        for t in patcher.model.diffusion_model.parameters():
            t.sum()  # every file page read once, as sampling with the model did
        g = torch.Generator().manual_seed(0)
        cond = demo_conditioning(patcher, "a red circle", txt_len, 0)
        side = resolution // 8
        data = dataset_from_conditioning({"samples": torch.randn(1, 16, side, side, generator=g)}, cond)
        gc.collect()
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # resets VmHWM to the current RSS
        loaded = process_memory()
        model = patcher.clone(force_deepcopy=True) if mode == "reload" else patcher
        with tempfile.TemporaryDirectory() as out:
            run_training_node(TrainConfig(learning_rate=1e-5), 2, session=None, model=model, dataset=data,
                              lora=LoraSpec(rank=4), strategy=Strategy.of(offload_fraction=1.0, compute_dtype="fp32"),
                              device="cpu", save_dir=Path(out), filename_prefix="bench", save_every=0, progress=None,
                              should_stop=None)
        peak = status_bytes("VmHWM")
    return {"mode": mode, "weights_bytes": weights, "loaded": loaded, "peak_rss_bytes": peak,
            "after": process_memory(), "reloads": len(loads), "torch": torch.__version__}


def measure(model: dict) -> list[dict]:
    """One fresh ComfyUI-python process per mode for `model` (bench/host_memory.py's MODEL); needs COMFYUI_DIR."""
    from .host_memory_server import write_checkpoint
    comfy_dir = os.path.abspath(os.environ["COMFYUI_DIR"])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_checkpoint(Path(tmp), model["params"])
        pythonpath = Path(tmp) / "pythonpath"
        pythonpath.mkdir()
        (pythonpath / "tightrope").symlink_to(REPO, target_is_directory=True)
        env = {**os.environ, "PYTHONPATH": str(pythonpath), "OMP_NUM_THREADS": "1"}
        for mode in MODES:
            proc = subprocess.run([comfy_python(comfy_dir), "-m", "tightrope.bench.host_memory_dynamic", comfy_dir,
                                   str(checkpoint), mode, str(model["txt_len"]), str(model["resolution"])],
                                  capture_output=True, text=True, env=env, cwd=tmp)
            if proc.returncode != 0:
                raise RuntimeError(f"dynamic-VRAM host-memory child ({mode}) failed (exit {proc.returncode}):\n"
                                   f"{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            w, loaded = r["weights_bytes"], r["loaded"]
            r["peak_above_loaded_w"] = (r["peak_rss_bytes"] - loaded["rss"]) / w
            r["after_anon_above_loaded_w"] = (r["after"]["anon"] - loaded["anon"]) / w
            rows.append(r)
    return rows


def main(out: str | None, model: dict) -> int:
    """`tightrope bench --host-memory --dynamic-only`: host_memory_dynamic.json/.md under `out`."""
    import datetime

    from .report import save_cpu_result
    if not os.environ.get("COMFYUI_DIR"):
        print("skipping the ComfyUI dynamic-VRAM part: COMFYUI_DIR is not set (a ComfyUI source dir with "
              "comfy-aimdo installed in its python)")
        return 0
    rows = measure(model)
    result = {"date": datetime.date.today().isoformat(), "device": "cpu", "torch": rows[0]["torch"], "rows": rows}
    save_cpu_result("host_memory_dynamic", result, "\n".join(markdown(result)) + "\n", out)
    return 0


def markdown(result: dict) -> list[str]:
    rows = result["rows"]
    by = {r["mode"]: r for r in rows}
    lines = [f"# Host memory of a dynamic-VRAM ComfyUI MODEL, emulated on the CPU ({result['date']})", "",
             f"torch {result['torch']} (ComfyUI's python), {os.cpu_count()} cores; W = "
             f"{rows[0]['weights_bytes'] / 2**20:.0f} MiB of fp32 weights (bench/host_memory.py's model).", "",
             "A MODEL as ComfyUI's dynamic VRAM holds it (the model file mapped read-only; see "
             "bench/host_memory_dynamic.py), every file page read once, then 2 training steps at offload 1.0 on the "
             "CPU device; one fresh process per row. The loaded level counts the mapped file's pages (file-backed). "
             "A server under dynamic VRAM uploads weights with file reads, so its own RSS may leave them out; they "
             "sit in the kernel's page cache either way (shared with it, not a copy), and streaming from host RAM "
             "needs them resident: Tightrope page-locks them, read-only, for the run.",
             "", "| path | file reloads | peak RSS above loaded | loaded: anon / file-backed (MiB) |",
             "| --- | --- | --- | --- |"]
    for mode, label in (("tightrope", "Tightrope: the copy shares the mapped weights"),
                        ("reload", "ComfyUI's trainer: `clone(force_deepcopy=True)` first (Tightrope before "
                                   "session 6)")):
        r = by[mode]
        lines.append(f"| {label} | {r['reloads']} | +{r['peak_above_loaded_w']:.2f} W | "
                     f"{r['loaded']['anon'] / 2**20:.0f} / {r['loaded']['file'] / 2**20:.0f} |")
    lines += ["", "The peak includes the simulated device slots and the step's own activations, gradients and AdamW "
              "state, the same in both rows; the reload adds "
              f"{by['reload']['peak_above_loaded_w'] - by['tightrope']['peak_above_loaded_w']:+.2f} W."]
    return lines


if __name__ == "__main__":
    print(json.dumps(child(*sys.argv[1:4], *map(int, sys.argv[4:6]))))
