"""The small workflow the distributed tests run (API format): the embedded demo, a few steps."""


def workflow(*, images: int = 9, steps: int = 4, learning_rate: float = 1e-3, batch_size: int = 4,
             grad_accumulation: int = 1, optimizer_offload: bool = False,
             offload_fraction: float = 0.5, checkpoint: str = "every_n", prefix: str = "dist/lora") -> dict:
    graph = {
        "1": {"class_type": "TightropeDemoModel", "inputs": {"seed": 0}},
        "2": {"class_type": "TightropeDemoEncoders", "inputs": {"seed": 0}},
        "3": {"class_type": "TightropeDemoImages",
              "inputs": {"subfolder": "images", "count": images, "size": 32, "seed": 0}},
        "4": {"class_type": "TightropeLoadDataset",
              "inputs": {"folder": ["3", 0], "vae": ["2", 0], "clip": ["2", 1], "resolution": 32,
                         "caption_dropout": 0.0, "use_repeats": True, "strict": True}},
        "5": {"class_type": "TightropeLoraSetup",
              "inputs": {"rank": 4, "alpha": 4.0, "rslora": False, "dropout": 0.0, "targets": "attention_mlp",
                         "init": "default", "target_regex": "", "existing_lora": ""}},
        "6": {"class_type": "TightropeMemoryStrategy",
              "inputs": {"mode": "manual", "vram_budget_gb": 0.0, "offload_fraction": offload_fraction,
                         "offload_policy": "spread", "prefetch_depth": 1, "activation_offload": False,
                         "checkpoint": checkpoint, "checkpoint_every": 2, "compile": "off",
                         "activation_memory_budget": 1.0, "compile_mode": "default", "compute_dtype": "fp32",
                         "weight_dtype": "auto", "pin_memory": False}},
        "7": {"class_type": "TightropeTrain",
              "inputs": {"steps": steps, "learning_rate": learning_rate, "optimizer": "adamw",
                         "schedule": "constant", "warmup_steps": 0, "batch_size": batch_size,
                         "grad_accumulation": grad_accumulation,
                         "seed": 0, "timestep_sampling": "logit_normal", "timestep_shift": 1.0, "guidance": 1.0,
                         "save_every": 0, "filename_prefix": prefix + "_checkpoint", "device": "cpu",
                         "on_nonfinite": "stop", "model": ["1", 0], "dataset": ["4", 0], "lora": ["5", 0],
                         "strategy": ["6", 0]}},
        "8": {"class_type": "TightropeSaveLora", "inputs": {"session": ["7", 0], "filename_prefix": prefix}},
        "9": {"class_type": "TightropePlots", "inputs": {"session": ["7", 0], "filename_prefix": "dist/plot"}},
    }
    if optimizer_offload:  # an optional input: workflows saved before it leave it out
        graph["6"]["inputs"]["optimizer_offload"] = True
    return graph
