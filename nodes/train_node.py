"""The training-step node: N steps on a new or continued session (train, preview, train on)."""
from __future__ import annotations

from ..training.flow_loss import LOSSES
from ..training.input_checks import check_output_target
from ..training.optimizer import optimizer_class
from ..training.train_config import OPTIMIZERS, ON_NONFINITE, SCHEDULES, ConfigError, TrainConfig
from ..training.tensorboard_log import summary_writer_class
from ..training.timesteps import SAMPLINGS
from ..training.distributed import check_batch_size, resolve_device
from ..training.training_run import require_start_inputs, run_training_node
from . import host
from .input_validation import validation_result

_C = TrainConfig()

# added after the inputs saved workflows already hold, so their widget values keep their places
_VALIDATION_AND_LOSS_INPUTS = {
    "loss": (list(LOSSES), {"default": _C.loss,
                            "tooltip": "Distance to the flow-matching target: mse (standard), huber (large errors "
                                       "pull less), l1. No min-SNR timestep weighting: it weights by the noise level "
                                       "of epsilon/v-prediction models; flow matching's velocity target has one scale "
                                       "at every timestep, and timestep_sampling/shift set where training focuses."}),
    "huber_delta": ("FLOAT", {"default": _C.huber_delta, "min": 1e-4, "max": 100.0, "step": 0.01, "round": False,
                              "tooltip": "loss=huber: errors above this count linearly, not squared."}),
    "validation_fraction": ("FLOAT", {"default": _C.validation_fraction, "min": 0.0, "max": 0.99, "step": 0.01,
                                      "tooltip": "Hold this fraction of the dataset's images out of training (drawn "
                                                 "from the seed) and report their loss (0: none held out)."}),
    "validation_every": ("INT", {"default": _C.validation_every, "min": 1, "max": 1_000_000,
                                 "tooltip": "Validation loss every N steps (and at the run's first and last step), "
                                            "with fixed noise and timesteps: same seed, same curve."}),
    "validation_dataset": ("TIGHTROPE_DATASET", {"tooltip": "A second dataset (e.g. another Load Dataset folder) "
                                                            "to validate on, instead of validation_fraction."}),
    "log_dir": ("STRING", {"default": "", "tooltip": "Write TensorBoard scalars (loss, validation loss, learning "
                                                     "rate, peak VRAM, H2D GB/s) to this folder, relative to the "
                                                     "output folder (needs `pip install tensorboard`; empty: off)."}),
}

_RANGE = ("Timesteps trained: 0 clean .. 1 pure noise (t = sigma after the shift); timesteps are drawn from the "
          "timestep_sampling/shift distribution restricted to timestep_min..timestep_max (validation too). For a model "
          "split into experts by noise level, train each expert's LoRA in its own range: Wan 2.2 A14B's high_noise "
          "model 0.875 to 1, its low_noise model 0 to 0.875. 0 to 1: every timestep.")
_TIMESTEP_RANGE_INPUTS = {
    "timestep_min": ("FLOAT", {"default": _C.timestep_min, "min": 0.0, "max": 1.0, "step": 0.005, "round": False,
                               "tooltip": _RANGE + " This is the low end (below timestep_max)."}),
    "timestep_max": ("FLOAT", {"default": _C.timestep_max, "min": 0.0, "max": 1.0, "step": 0.005, "round": False,
                               "tooltip": _RANGE + " This is the high end."}),
}


class TightropeTrain:
    DESCRIPTION = ("Trains the LoRA for N steps under the memory strategy, with a progress bar; interrupting saves "
                   "the LoRA of the last completed step and its training state: queue the workflow again and the "
                   "node goes on from there (`tightrope run --resume` headless). Wire its session into another Train "
                   "node to go on.")
    CATEGORY = "Tightrope/train"
    RETURN_TYPES = ("TIGHTROPE_SESSION", "MODEL", "STRING")
    RETURN_NAMES = ("session", "model", "report")
    FUNCTION = "train"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "steps": ("INT", {"default": 100, "min": 1, "max": 1_000_000, "tooltip": "Optimizer steps in this run."}),
            "learning_rate": ("FLOAT", {"default": _C.learning_rate, "min": 1e-7, "max": 1.0, "step": 1e-5,
                                        "round": False, "tooltip": "Peak learning rate of the LoRA weights."}),
            "optimizer": (list(OPTIMIZERS), {"default": _C.optimizer,
                                              "tooltip": "adamw8bit needs bitsandbytes and CUDA; adafactor uses the "
                                                         "least memory; prodigy (prodigyopt) sets its own step size: "
                                                         "use learning_rate 1.0; adamw_schedulefree (schedulefree) "
                                                         "needs schedule constant."}),
            "schedule": (list(SCHEDULES), {"default": _C.schedule, "tooltip": "cosine decays the rate over this "
                                                                               "run's steps after the warmup."}),
            "warmup_steps": ("INT", {"default": _C.warmup_steps, "min": 0, "max": 100_000,
                                     "tooltip": "Linear warmup over the session's first steps."}),
            "batch_size": ("INT", {"default": _C.batch_size, "min": 1, "max": 1024,
                                   "tooltip": "Images per micro-batch (from one aspect-ratio bucket)."}),
            "grad_accumulation": ("INT", {"default": _C.grad_accumulation, "min": 1, "max": 1024,
                                          "tooltip": "Micro-batches per optimizer step."}),
            "seed": ("INT", {"default": _C.seed, "min": 0, "max": 2**63 - 1, "control_after_generate": "fixed",
                             "tooltip": "Seeds data order, noise and timesteps: same seed, same run."}),
            "timestep_sampling": (list(SAMPLINGS), {"default": _C.timestep_sampling,
                                                     "tooltip": "How training timesteps are drawn."}),
            "timestep_shift": ("FLOAT", {"default": _C.timestep_shift, "min": 0.0, "max": 100.0, "step": 0.05,
                                         "round": False,
                                         "tooltip": "0: the shift the model samples with (after any ModelSampling "
                                                    "node; Flux and Qwen-Image 3.16, SD3.5 3.0, Lumina 2 "
                                                    "6.0, Wan 8.0). > 1 trains more on noisy timesteps, 1.0 is "
                                                    "none."}),
            "guidance": ("FLOAT", {"default": _C.guidance, "min": 0.0, "max": 100.0, "step": 0.1,
                                   "tooltip": "Guidance fed to guidance-distilled models (Flux-dev) in training."}),
            "save_every": ("INT", {"default": 0, "min": 0, "max": 1_000_000,
                                   "tooltip": "Write a LoRA every N steps and at the last step (0: only if the run "
                                              "stops early; Save LoRA writes the result). Each is a new file, "
                                              "<prefix>_00001_ on (its step in the tightrope.steps metadata); none "
                                              "is deleted."}),
            "filename_prefix": ("STRING", {"default": "tightrope/lora",
                                           "tooltip": "Name of the LoRA files written while training, inside the "
                                                      "loras folder."}),
            "device": (["auto", "cuda", "cpu"], {"default": "auto", "tooltip": "auto: CUDA when available."}),
            "on_nonfinite": (list(ON_NONFINITE), {"default": _C.on_nonfinite,
                                                   "tooltip": "A NaN loss stops (keeping the last good LoRA) or "
                                                              "skips the step."}),
        }, "optional": {
            "session": ("TIGHTROPE_SESSION", {"tooltip": "Continue this session (its model, data and LoRA); the "
                                                         "inputs below are then optional."}),
            "model": ("MODEL", {"tooltip": "The base model to train a LoRA for."}),
            "dataset": ("TIGHTROPE_DATASET", {"tooltip": "From Load Dataset."}),
            "lora": ("TIGHTROPE_LORA", {"tooltip": "From LoRA Setup."}),
            "strategy": ("TIGHTROPE_STRATEGY", {"tooltip": "From Memory Strategy (default: everything on the GPU, "
                                                           "bf16)."}),
            "ema_decay": ("FLOAT", {"default": _C.ema_decay, "min": 0.0, "max": 0.999999, "step": 0.0001,
                                    "round": False,
                                    "tooltip": "0: off. Else keep an exponential moving average of the LoRA "
                                               "weights on the CPU (no GPU memory), e.g. 0.999, warmed up as "
                                               "diffusers does (decay min(this, (1+n)/(10+n)) at update n); Save "
                                               "LoRA writes it as a second file ending in _ema."}),
            **_VALIDATION_AND_LOSS_INPUTS,
            "resume": ("BOOLEAN", {"default": True,
                                   "tooltip": "Interrupted (or the server stopped)? Queue the same workflow again: "
                                              "this node goes on from its last completed step (saved at every "
                                              "save_every and at the interrupt), to the very LoRA an uninterrupted "
                                              "run gives; a finished node returns its result untrained. Only from "
                                              "the same run: another input, setting or step count trains anew. "
                                              "Off: always train anew. Headless: `tightrope run --resume` decides."}),
            **_TIMESTEP_RANGE_INPUTS,  # after every input saved workflows hold: their widget values keep their places
        }, "hidden": {"unique_id": "UNIQUE_ID"}}  # keys this node's training state file

    def train(self, steps, save_every, filename_prefix, device, session=None, model=None, dataset=None, lora=None,
              strategy=None, unique_id=None, validation_dataset=None, log_dir="", resume=True, **config):
        mode = host.resume_mode(resume)
        _note_training_on_the_cpu(device, unique_id)
        result, model_out, report = run_training_node(
            TrainConfig(**config), steps, session=session, model=model, dataset=dataset, lora=lora,
            strategy=strategy, device=device, save_dir=host.loras_dir(), filename_prefix=filename_prefix,
            save_every=save_every, progress=host.progress_reporter(steps), should_stop=host.interrupt_requested,
            resume=mode, state_dir=host.state_dir(), node_id=unique_id, notify=host.notify,
            validation_dataset=validation_dataset, log_dir=host.tensorboard_dir(log_dir),
            probe_progress=host.work_progress("probing the model (auto strategy)", unit="block"),
            interrupts=host.interrupt_exceptions())
        if result.interrupted:
            new = result.saved[len(session.saved) if session is not None else 0:]
            host.notify(f"Train node {unique_id} interrupted at step {result.step}: "
                        + (f"its LoRA is saved in '{new[-1]}'" if new else "no step of this run had completed")
                        + ("; queue the workflow again to go on from there" if mode == "same run" else ""))
            host.raise_interrupt()
        return (result, model_out, report)

    @classmethod
    def VALIDATE_INPUTS(cls, **inputs):
        """Before any node trains: every widget in range (NaN included), timestep_min below timestep_max, the file
        name safe and its folder writable, the device available, the optimizer installed and able to run on it,
        tensorboard installed if logs are asked for (and its folder writable), under torchrun the global batch
        divisible by the world size, a session or model, dataset and lora connected."""
        prefix, device, optimizer = inputs.get("filename_prefix"), inputs.get("device"), inputs.get("optimizer")
        schedule, batch_size = inputs.get("schedule"), inputs.get("batch_size")
        t_range = {k: inputs[k] for k in _TIMESTEP_RANGE_INPUTS if inputs.get(k) is not None}  # min < max
        log_dir = host.tensorboard_dir(inputs.get("log_dir") or "")
        return validation_result(cls, inputs, lambda: prefix is None or check_output_target(host.loras_dir(), prefix),
                                 lambda: device is None or resolve_device(device),
                                 lambda: _optimizer_runs(optimizer, device),
                                 lambda: None in (optimizer, schedule) or TrainConfig(optimizer=optimizer,
                                                                                      schedule=schedule),
                                 lambda: TrainConfig(**t_range),
                                 lambda: log_dir is None or summary_writer_class(log_dir),
                                 lambda: not isinstance(batch_size, int) or check_batch_size(batch_size),  # torchrun
                                 lambda: _check_connected(inputs))


def _note_training_on_the_cpu(device: str, node_id) -> None:
    """device 'auto' without CUDA trains on the CPU, though ComfyUI itself may run on Apple's MPS, Intel's XPU or
    DirectML, which Tightrope does not train on: say so in one line, or a Mac user waits on CPU speed not knowing."""
    theirs = host.comfyui_device_type()
    if device != "auto" or theirs in (None, "cpu", "cuda") or resolve_device(device).type != "cpu":
        return
    host.notify(f"Train node {node_id} trains on the CPU (device auto): Tightrope trains on CUDA GPUs (NVIDIA, or AMD "
                f"with ROCm) or the CPU, not on this ComfyUI's device '{theirs}'; expect CPU speed")


def _check_connected(inputs: dict) -> None:
    """A session, or model, dataset and lora, are connected: ComfyUI (and the headless runner) give a validator a
    linked input as None and leave out an optional input nothing is connected to, so this is known before any node
    runs (it failed when the node ran: after the model had loaded and the dataset was encoded)."""
    if "session" in inputs or not all(name in inputs for name in TightropeTrain.INPUT_TYPES()["required"]):
        return  # a session; or not a queued node's inputs (ComfyUI and the runner pass every required one)
    require_start_inputs(inputs)


def _optimizer_runs(optimizer: str | None, device: str | None) -> None:
    """The optimizer is installed and runs on the device (a device that is not available is reported on its own)."""
    if optimizer is None or device is None:
        return
    try:
        resolved = resolve_device(device)
    except ConfigError:
        return
    optimizer_class(optimizer, resolved)
