"""Optimisation settings of a training run: one frozen, validated dataclass (errors name the input and the fix)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..memory.config_base import ConfigBase
from .flow_loss import LOSSES
from .timesteps import MODEL_SHIFT, SAMPLINGS, T_EDGE

OPTIMIZERS = ("adamw", "adamw8bit", "adafactor", "prodigy", "adamw_schedulefree")
SCHEDULES = ("constant", "cosine")
ON_NONFINITE = ("stop", "skip")


class ConfigError(ValueError):
    """A training setting is invalid; the message names the input and the fix."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig(ConfigBase):
    ERROR = ConfigError
    FIELD_NOUN = "training setting"

    learning_rate: float = 1e-4
    """Peak learning rate of the LoRA weights."""
    optimizer: str = "adamw"
    """'adamw'; 'adamw8bit' (bitsandbytes, CUDA) for a quarter of the optimizer memory; 'adafactor' (torch, factored
    second moments: the least memory); 'prodigy' (prodigyopt: finds the step size itself, use learning_rate 1.0);
    'adamw_schedulefree' (schedulefree: needs no decay schedule, so schedule must be 'constant')."""
    weight_decay: float = 0.0
    warmup_steps: int = 0
    """Linear warmup from 0 over the first steps of the session."""
    schedule: str = "constant"
    """'constant', or 'cosine' decay to min_lr_ratio over the steps of each run."""
    min_lr_ratio: float = 0.0
    batch_size: int = 1
    grad_accumulation: int = 1
    """Micro-batches per optimizer step (effective batch = batch_size * grad_accumulation)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 = off)."""
    seed: int = 0
    """Seeds data order, noise, timesteps and dropout: the same seed gives the same run."""
    timestep_sampling: str = "logit_normal"
    timestep_shift: float = 0.0
    """0: the shift the model samples with (ComfyUI: its model_sampling, after any ModelSampling* node; Flux and
    Qwen-Image 3.16, SD3.5 3.0, Lumina 2 6.0, Wan 2.1 8.0), resolved when the run starts (`resolved`); > 1 moves
    training towards noisier timesteps, 1.0 is none."""
    timestep_min: float = 0.0
    timestep_max: float = 1.0
    """The range t is trained in (0 clean .. 1 noise, t = sigma after the shift): t is drawn from the sampling
    distribution restricted to it (training/timesteps.py says why). For a model split into experts by noise level,
    each expert's LoRA trains on its own: Wan 2.2 A14B text-to-video's high-noise model 0.875..1, its low-noise
    model 0..0.875. 0..1 (the default): every timestep, drawn exactly as without a range."""
    guidance: float = 1.0
    """Guidance value fed to guidance-distilled models (Flux-dev) while training."""
    on_nonfinite: str = "stop"
    """A NaN/inf loss 'stop's the run (the last good LoRA is kept) or 'skip's that step."""
    ema_decay: float = 0.0
    """0: off; else keep an exponential moving average of the LoRA weights on the CPU, updated after every step
    with this decay (0.999 averages over about the last 1000 steps); the Save node can write it as a second file."""
    loss: str = "mse"
    """'mse', 'huber' (quadratic below huber_delta, linear above) or 'l1' distance to the flow-matching target."""
    huber_delta: float = 1.0
    """Where the Huber loss turns from quadratic to linear (loss='huber' only)."""
    validation_fraction: float = 0.0
    """Fraction of the dataset's images held out of training for the validation loss (0: none held out); the split
    is drawn from the seed."""
    validation_every: int = 100
    """Validation loss every N steps (and at the run's first and last step) when there is a validation set."""

    def __post_init__(self) -> None:
        self.check_positive("learning_rate", self.learning_rate, "e.g. 1e-4 for LoRA")
        self.check_choice("optimizer", self.optimizer, OPTIMIZERS)
        self.check_range("weight_decay", self.weight_decay, 0.0, 1.0)
        self.check_int("warmup_steps", self.warmup_steps, 0)
        self.check_choice("schedule", self.schedule, SCHEDULES)
        self.check_range("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        self.check_int("batch_size", self.batch_size, 1)
        self.check_int("grad_accumulation", self.grad_accumulation, 1)
        self.check_range("max_grad_norm", self.max_grad_norm, 0.0, 1e6)
        self.check_int("seed", self.seed, 0)
        self.check_choice("timestep_sampling", self.timestep_sampling, SAMPLINGS)
        self.check_range("timestep_shift", self.timestep_shift, 0.0, 100.0,
                         "0 trains at the model's own sampling shift, 1.0 is no shift")
        self.check_range("timestep_min", self.timestep_min, 0.0, 1.0, "0: from the clean end")
        self.check_range("timestep_max", self.timestep_max, 0.0, 1.0, "1: up to pure noise")
        if not self.timestep_min < self.timestep_max:
            self.fail("timestep_max", self.timestep_max, f"is not above timestep_min={self.timestep_min!r}: the "
                      "timestep range is empty; set timestep_min below timestep_max (Wan 2.2 A14B: 0.875 to 1 for "
                      "its high-noise model, 0 to 0.875 for its low-noise one; 0 to 1 trains every timestep)")
        elif not (self.timestep_min < 1 - T_EDGE and self.timestep_max > T_EDGE):  # both ends: t is kept inside
            end = "timestep_min" if self.timestep_min >= 1 - T_EDGE else "timestep_max"
            self.fail(end, getattr(self, end), f"leaves no timesteps to train on: t is always drawn within "
                      f"{T_EDGE:g} to {1 - T_EDGE:g}, and this range ({self.timestep_min!r} to {self.timestep_max!r}) "
                      "lies at or past that end (every draw would be the same t, that end); set "
                      + (f"timestep_min below {1 - T_EDGE:g}" if end == "timestep_min" else f"timestep_max above "
                         f"{T_EDGE:g}"))
        self.check_range("guidance", self.guidance, 0.0, 100.0)
        self.check_choice("on_nonfinite", self.on_nonfinite, ON_NONFINITE)
        if self.check_number("ema_decay", self.ema_decay) != 0 and not 0 < self.ema_decay < 1:
            self.fail("ema_decay", self.ema_decay, "is out of range: use a number between 0 and 1 (e.g. 0.999), or 0 "
                      "to train without an EMA")
        if self.optimizer == "adamw_schedulefree" and self.schedule != "constant":
            raise ConfigError(f"optimizer='adamw_schedulefree' replaces the learning-rate schedule, so "
                              f"schedule={self.schedule!r} would fight it: set schedule='constant' (warmup_steps "
                              "still applies)")
        self.check_choice("loss", self.loss, LOSSES)
        self.check_positive("huber_delta", self.huber_delta, "e.g. 1.0; smaller treats more errors as outliers")
        if not 0.0 <= self.check_number("validation_fraction", self.validation_fraction) < 1.0:
            self.fail("validation_fraction", self.validation_fraction, "is out of range: hold out a fraction above 0 "
                      "and below 1 of the images (e.g. 0.1), or 0 for no held-out set")
        self.check_int("validation_every", self.validation_every, 1)

    def resolved(self, model_shift) -> "TrainConfig":
        """This config with timestep_shift 0 replaced by `model_shift()` (the adapter's sampling_shift: the shift
        the model samples with); a number set by the user is kept. Resolved before a run resumes, so its state file
        and the resume check see the number trained with."""
        if self.timestep_shift != MODEL_SHIFT:
            return self
        return replace(self, timestep_shift=float(model_shift()))

    @property
    def timestep_range(self) -> tuple[float, float]:
        """(timestep_min, timestep_max): sample_timesteps' t_range."""
        return (self.timestep_min, self.timestep_max)
