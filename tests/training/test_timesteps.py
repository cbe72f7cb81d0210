"""Timestep shift: 0 (the default) trains at the shift the model samples with, read from its sampling schedule;
the number trained with is what the state file, the resume check, the LoRA's metadata and the report see."""
import json
import math
import warnings

import pytest
import torch
from demo_setup import demo_session

from tightrope.training.lora.files import read_lora_file
from tightrope.training.models.adapter import FLUX_SAMPLING_SHIFT
from tightrope.training.state.resume import resume_session, state_path
from tightrope.training.timesteps import sample_timesteps, shift_of_schedule
from tightrope.training.train_config import ConfigError, TrainConfig
from tightrope.training.trainer import SaveTarget, train
from tightrope.training.training_run import report

CPU = torch.device("cpu")


def _snr_shift(shift):  # ComfyUI's ModelSamplingDiscreteFlow (SD3, Lumina 2, Wan, Qwen-Image), as percent_to_sigma
    return lambda t: shift * t / (1 + (shift - 1) * t)


def _flux(mu):  # ComfyUI's ModelSamplingFlux: flux_time_shift(mu, 1.0, t)
    return lambda t: math.exp(mu) / (math.exp(mu) + (1 / t - 1))


@pytest.mark.parametrize("schedule, shift", [(_snr_shift(3.0), 3.0), (_snr_shift(6.0), 6.0), (_snr_shift(1.0), 1.0),
                                             (_snr_shift(0.5), 0.5), (_flux(1.15), math.exp(1.15)),
                                             (_flux(0.5), math.exp(0.5))])
def test_the_shift_of_a_sampling_schedule_is_read_from_it(schedule, shift):
    assert shift_of_schedule(schedule, "it") == pytest.approx(shift, rel=1e-12)  # a ratio of two floats: ulps


def test_a_schedule_of_another_form_is_refused_naming_the_fix():
    cosine = lambda t: math.sin(t * math.pi / 2) ** 2  # noqa: E731  sigma(0.5) = 0.5 ("shift 1") but not linear
    with pytest.raises(ValueError, match=r"this model's sampling \(X\) is not a timestep shift schedule .* set "
                                         r"timestep_shift to a number"):
        shift_of_schedule(cosine, "this model's sampling (X)")


def test_an_unresolved_shift_is_never_sampled_with():
    with pytest.raises(ValueError, match="not resolved"):
        sample_timesteps(4, torch.Generator().manual_seed(0), shift=0.0)


def test_shift_settings_are_checked_and_only_0_is_resolved():
    with pytest.raises(ConfigError, match=r"timestep_shift.*0 trains at the model's own sampling shift"):
        TrainConfig(timestep_shift=-1.0)

    def never():
        raise AssertionError("a shift the user set is kept: the model is not asked")

    assert TrainConfig(timestep_shift=2.0).resolved(never).timestep_shift == 2.0
    assert TrainConfig().timestep_shift == 0.0
    assert TrainConfig().resolved(lambda: 3.25).timestep_shift == 3.25


def test_shift_0_trains_at_the_models_own_and_records_the_number(tmp_path):
    """The demo's Flux samples (in ComfyUI's terms) at mu 1.15: shift 0 must train exactly as that number set by
    hand, and not as no shift (so the default is not silently 1)."""
    auto = train(demo_session(tmp_path), 2, device=CPU, save=SaveTarget(tmp_path / "out", "auto", every=2))
    by_hand = train(demo_session(tmp_path, timestep_shift=FLUX_SAMPLING_SHIFT), 2, device=CPU)
    unshifted = train(demo_session(tmp_path, timestep_shift=1.0), 2, device=CPU)
    assert auto.losses == by_hand.losses and auto.losses != unshifted.losses
    assert all(torch.equal(v, by_hand.lora_state[k]) for k, v in auto.lora_state.items())
    assert auto.config.timestep_shift == FLUX_SAMPLING_SHIFT
    _, meta = read_lora_file(auto.last_saved)
    assert json.loads(meta["tightrope.training"])["timestep_shift"] == FLUX_SAMPLING_SHIFT
    assert "timesteps: logit_normal, shift 3.16" in report(auto, 2).splitlines()


def test_a_run_at_the_models_shift_resumes_without_a_changed_setting(tmp_path):
    """The state file holds the resolved number; the node's config still says 0: not a change of settings."""
    session = demo_session(tmp_path)
    save = SaveTarget(tmp_path / "out", "run")
    with pytest.raises(KeyboardInterrupt):
        train(session, 3, device=CPU, save=save, progress=lambda done, total, loss: _raise_at(done, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a "changed training settings" warning fails here
        resumed, state = resume_session(state_path(save.folder, save.filename_prefix), session, same_run=True)
    done = train(resumed, 1, device=CPU, run_start=state.run_start)
    assert done.losses == train(session, 3, device=CPU).losses


def _raise_at(done, step):
    if done == step:
        raise KeyboardInterrupt
