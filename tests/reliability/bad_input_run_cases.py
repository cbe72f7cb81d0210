"""Bad inputs found by running a whole workflow, and bad files: a bad value late in a chain of nodes (caught in
validation before the first training step), and data that is damaged, NaN or cannot be written (nothing trained is
lost). One node's bad inputs and the shared helpers are in bad_input_cases.py; CASES here is the whole list, in the
order docs/bad_input.md shows it."""
from __future__ import annotations

import bad_input_cases
import bad_input_feature_cases
import bad_input_video_cases
from bad_input_cases import CHAIN, DATA, LORA, SAVE, STRAT, TRAIN, Case, train_with
from reliability_kit import load_dataset, lora, resuming, strategy, train_node, widgets, world
from safetensors import safe_open
from safetensors.torch import save_file

from tightrope import NODE_CLASS_MAPPINGS
from tightrope.headless import load_workflow, run_workflow
from tightrope.nodes import host
from tightrope.nodes.save_node import TightropeSaveLora
from tightrope.nodes.strategy_node import TightropeMemoryStrategy
from tightrope.training.state.resume import state_path

CASES = list(bad_input_cases.CASES)


# --- failfast ---
# Found before the first training step: a whole chain (two Train nodes, then Save LoRA) run headless with the bad
# value in one of its last nodes fails in validation, before any node runs.


def chain_prompt(train2: dict | None = None, save: dict | None = None, lora_setup: dict | None = None,
                 strategy_node: dict | None = None) -> dict:
    """The demo's chain in API format, tiny (4 images of 32 px, 2 + 2 steps on the CPU); the dicts override inputs
    of the second Train node, the Save LoRA node, the LoRA Setup and the Memory Strategy."""
    strategy_widgets = {k: v[1]["default"] for k, v in TightropeMemoryStrategy.INPUT_TYPES()["required"].items()}
    return {
        "1": {"class_type": "TightropeDemoModel", "inputs": {"seed": 0}},
        "2": {"class_type": "TightropeDemoEncoders", "inputs": {"seed": 0}},
        "3": {"class_type": "TightropeDemoImages", "inputs": {"subfolder": "imgs", "count": 4, "size": 32, "seed": 0}},
        "4": {"class_type": "TightropeLoadDataset", "inputs": {"folder": ["3", 0], "vae": ["2", 0], "clip": ["2", 1],
                                                              "resolution": 32, "caption_dropout": 0.0,
                                                              "use_repeats": True, "strict": False}},
        "5": {"class_type": "TightropeLoraSetup", "inputs": {"rank": 4, "alpha": 4.0, "rslora": False, "dropout": 0.0,
                                                            "targets": "attention", "init": "default"}
              | (lora_setup or {})},
        "6": {"class_type": "TightropeMemoryStrategy",
              "inputs": strategy_widgets | {"compute_dtype": "fp32"} | (strategy_node or {})},
        "7": {"class_type": "TightropeTrain", "inputs": widgets() | {"model": ["1", 0], "dataset": ["4", 0],
                                                                     "lora": ["5", 0], "strategy": ["6", 0]}},
        "8": {"class_type": "TightropeTrain", "inputs": widgets() | {"session": ["7", 0]} | (train2 or {})},
        "9": {"class_type": "TightropeSaveLora", "inputs": {"session": ["8", 0], "filename_prefix": "rt/final"}
              | (save or {})},
    }


def run_chain(ctx, **changes):
    return run_workflow(load_workflow(chain_prompt(**changes), NODE_CLASS_MAPPINGS), NODE_CLASS_MAPPINGS)


def blocked_folder(ctx):
    """The loras folder's subfolder 'blocked' is a file, so nothing can be saved under 'blocked/' (even as root)."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "blocked").write_text("a file, not a folder")
    return run_chain(ctx, save={"filename_prefix": "blocked/final"})


def unreadable_lora(ctx):
    (ctx.tmp / "broken.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    return run_chain(ctx, lora_setup={"existing_lora": str(ctx.tmp / "broken.safetensors")})


CASES += [
    Case("chain_save_prefix_dotdot", "Save LoRA prefix with '..' after two Train nodes", SAVE + CHAIN, "WorkflowError",
         ("node 9 'TightropeSaveLora'", "'../x'", "only go down"),
         lambda c: run_chain(c, save={"filename_prefix": "../x"})),
    Case("chain_save_prefix_colon", "Save LoRA prefix with ':' after two Train nodes", SAVE + CHAIN, "WorkflowError",
         ("node 9 'TightropeSaveLora'", "'lora:v2'", "':'", "use letters, digits"),
         lambda c: run_chain(c, save={"filename_prefix": "lora:v2"})),
    Case("chain_save_prefix_empty", "empty Save LoRA prefix", SAVE + CHAIN, "WorkflowError",
         ("node 9 'TightropeSaveLora'", "filename_prefix=''", "give a file name"),
         lambda c: run_chain(c, save={"filename_prefix": ""})),
    Case("chain_save_folder_blocked", "Save LoRA folder that cannot be created (a file is in the way)",
         SAVE + CHAIN, "WorkflowError", ("node 9 'TightropeSaveLora'", "filename_prefix='blocked/final'",
                                         "is a file", "move or rename that file"), blocked_folder),
    Case("chain_train_prefix_absolute", "absolute prefix in the second Train node", TRAIN + CHAIN, "WorkflowError",
         ("node 8 'TightropeTrain'", "'/tmp/escape'", "relative to the folder files go under"),
         lambda c: run_chain(c, train2={"filename_prefix": "/tmp/escape"})),
    Case("chain_lr_nan", "NaN learning rate in the second Train node", TRAIN + CHAIN, "WorkflowError",
         ("node 8 'TightropeTrain'", "input 'learning_rate' is nan", "use a value in 1e-07..1.0"),
         lambda c: run_chain(c, train2={"learning_rate": float("nan")})),
    Case("chain_guidance_inf", "infinite guidance in the second Train node", TRAIN + CHAIN, "WorkflowError",
         ("node 8 'TightropeTrain'", "input 'guidance' is inf", "use a value in 0.0..100.0"),
         lambda c: run_chain(c, train2={"guidance": float("inf")})),
    Case("chain_lora_unreadable", "existing LoRA with a damaged header", LORA + CHAIN, "WorkflowError",
         ("node 5 'TightropeLoraSetup'", "existing_lora='<tmp>/broken.safetensors'", "save or download it again"),
         unreadable_lora),
    Case("chain_weight_bf16_compute_fp32", "strategy weight_dtype bf16 with compute_dtype fp32", STRAT + CHAIN,
         "WorkflowError", ("node 6 'TightropeMemoryStrategy'", "weight_dtype='bf16'", "set compute_dtype='bf16'"),
         lambda c: run_chain(c, strategy_node={"weight_dtype": "bf16", "compute_dtype": "fp32"})),
    Case("weight_bf16_compute_fp32", "strategy weight_dtype bf16 with compute_dtype fp32", STRAT, "StrategyError",
         ("weight_dtype='bf16'", "set compute_dtype='bf16'"),
         lambda c: strategy(weight_dtype="bf16", compute_dtype="fp32")),
    Case("lora_unreadable", "existing LoRA with a damaged header", LORA, "LoraError",
         ("broken.safetensors", "save or download it again"),
         lambda c: (c.out.mkdir(parents=True, exist_ok=True), (c.out / "broken.safetensors").write_bytes(b"\x01"),
                    lora(existing_lora="broken.safetensors"))),
    Case("save_prefix_colon", "Save LoRA prefix with ':' (node run directly)", SAVE, "OutputPathError",
         ("'lora:v2'", "use letters, digits"),
         lambda c: TightropeSaveLora().save(train_node(*world(c.out), steps=1)[0], "lora:v2")),
    Case("dataset_folder_unset", "Load Dataset folder left empty", DATA, "DatasetError",
         ("folder=''", "pass the folder"), lambda c: load_dataset("")),
]


# --- nothinglost ---
def _poisoned(path, pick="lora"):
    """Rewrite the safetensors file `path` with one value of its first tensor whose name contains `pick` NaN."""
    with safe_open(str(path), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    key = next(k for k in tensors if pick in k)
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, str(path), metadata=meta)
    return path


def nan_existing_lora(ctx):
    model, dataset, spec, strat = world(ctx.out)
    (saved,) = TightropeSaveLora().save(train_node(model, dataset, spec, strat, steps=1)[0], "diverged")["result"]
    train_node(model, dataset, lora(existing_lora=str(_poisoned(saved))), strat)


def nan_state(ctx):
    model, dataset, spec, strat = world(ctx.out)
    train_node(model, dataset, spec, strat, steps=1, save_every=1)
    _poisoned(state_path(host.state_dir(), "rt/lora"))  # the state file of that Train node
    with resuming():
        train_node(model, dataset, spec, strat, steps=2)


def nan_cached_latent(ctx):
    model, dataset, spec, strat = world(ctx.out)
    cached = {p: p.read_bytes() for p in (ctx.out / ".tightrope_cache" / "latents").rglob("*.safetensors")}
    try:
        for path in cached:
            _poisoned(path, pick="latent")
        train_node(model, dataset, spec, strat)
    finally:  # the cache is shared with the other cases of test_the_process_goes_on_after_errors
        for path, data in cached.items():
            path.write_bytes(data)


def disk_full(ctx):
    from tightrope.training.state import atomic_write
    real = atomic_write._write_all

    def write_all(fd, data):
        if b"tightrope-training-state" in data[:100_000]:
            raise OSError(28, "No space left on device")
        return real(fd, data)
    atomic_write._write_all = write_all
    try:
        train_with(ctx, save_every=1)
    finally:
        atomic_write._write_all = real


def unwritable_save_folder(ctx):
    from tightrope.training.state import atomic_write
    session = train_node(*world(ctx.out), steps=1)[0]
    real = atomic_write._create_temp

    def create_temp(path):
        if path.parent.name == "readonly":
            raise PermissionError(13, "Permission denied")
        return real(path)
    atomic_write._create_temp = create_temp
    try:
        TightropeSaveLora().save(session, "readonly/my_lora")
    finally:
        atomic_write._create_temp = real


CASES += [
    Case("nan_existing_lora", "existing LoRA with NaN weights", TRAIN, "NonFiniteDataError",
         ("diverged_00001_.safetensors", "pick an earlier LoRA file"), nan_existing_lora),
    Case("nan_state", "resume file with NaN", TRAIN + " (--resume)", "NonFiniteDataError",
         ("lora.state.safetensors", "delete it"), nan_state),
    Case("nan_cached_latent", "cached latent with NaN", TRAIN, "NonFiniteDataError",
         ("dataset cache file", "delete it"), nan_cached_latent),
    Case("disk_full", "disk full while saving", TRAIN, "FileWriteError",
         ("lora.state.safetensors", "No space left on device", "LoRA of step 1 was saved"), disk_full),
    Case("unwritable_save_folder", "Save LoRA folder not writable", "Save LoRA", "LoraNotSavedError",
         ("readonly/my_lora_00001_.safetensors", "Permission denied", "was kept in", "tightrope_rescue_my_lora_step1"),
         unwritable_save_folder),
]
CASES += bad_input_feature_cases.CASES  # the training features' inputs
CASES += bad_input_video_cases.CASES  # video clips', last
