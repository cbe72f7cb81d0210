"""Timestep shift: 0 (the default) trains at the shift the model samples with, read from its sampling schedule;
the number trained with is what the state file, the resume check, the LoRA's metadata and the report see."""
import json
import math
import warnings

import pytest
import torch
from demo_setup import demo_session
from timestep_range import restricted_draw

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


# --- the timestep range (TrainConfig.timestep_min/max: Wan 2.2 A14B's experts) ---

def _today(n, seed, kind, shift):
    """The draw as sample_timesteps made it before ranges existed (a copy of that code, kept as the reference)."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=gen) if kind == "uniform" else torch.sigmoid(torch.randn(n, generator=gen))
    if shift != 1.0:
        t = shift * t / (1 + (shift - 1) * t)
    return t.clamp(1e-5, 1 - 1e-5), gen.get_state()


@pytest.mark.parametrize("kind", ["uniform", "logit_normal"])
@pytest.mark.parametrize("shift", [1.0, 3.0, 8.0])
def test_the_default_range_draws_bit_for_bit_what_it_drew_before(kind, shift):
    expected, state = _today(1000, 7, kind, shift)
    for cfg in (TrainConfig(), TrainConfig(timestep_min=0, timestep_max=1)):  # ints from JSON too
        gen = torch.Generator().manual_seed(7)
        got = sample_timesteps(1000, gen, kind=kind, shift=shift, t_range=cfg.timestep_range)
        assert torch.equal(got, expected) and torch.equal(gen.get_state(), state)


@pytest.mark.parametrize("kind", ["uniform", "logit_normal"])
@pytest.mark.parametrize("lo, hi, shift", [(0.875, 1.0, 8.0), (0.0, 0.875, 8.0), (0.9, 1.0, 5.0), (0.2, 0.3, 1.0)])
def test_a_range_draws_the_training_distribution_restricted_to_it(kind, lo, hi, shift):
    """Against the definition: the full range's draws that fall in [lo, hi] (rejection, 400000 draws) have the same
    distribution as the range's draws (two-sample Kolmogorov-Smirnov: at alpha 1e-6 the critical distance is
    ~2.8 * sqrt(1/n + 1/m), under 0.015 here); and against the inverse-CDF formula written out plainly
    (tests/helpers/timestep_range.py: float64 erf/erfinv against torch's ndtr/ndtri, then one fp32 rounding: 1e-6).
    A linear map of the whole draw into the range (the first version) fails the first check at every shift but 1
    for uniform: at shift 8 it put the high-noise expert's median t at 0.986, the restriction's is 0.934."""
    n = 60_000
    got = sample_timesteps(n, torch.Generator().manual_seed(3), kind=kind, shift=shift, t_range=(lo, hi))
    assert lo <= got.min() and got.max() <= hi
    torch.testing.assert_close(got, restricted_draw(n, torch.Generator().manual_seed(3), kind, shift, lo, hi),
                               rtol=0, atol=1e-6)
    full = sample_timesteps(400_000, torch.Generator().manual_seed(4), kind=kind, shift=shift)
    kept = full[(lo <= full) & (full <= hi)].double().sort().values
    m = kept.numel()
    assert m > 5_000
    grid = torch.linspace(lo, hi, 2001, dtype=torch.float64)
    ecdf = lambda x: torch.searchsorted(x, grid, right=True).double() / x.numel()  # noqa: E731
    distance = (ecdf(got.double().sort().values) - ecdf(kept)).abs().max().item()
    assert distance < 2.8 * (1 / n + 1 / m) ** 0.5


def test_a_uniform_draw_stays_uniform_in_its_range():
    """The mapped uniform draw has the uniform's mean (lo+hi)/2 and variance (hi-lo)^2/12 on the range: with 200000
    draws the mean's standard error is (hi-lo)/sqrt(12*200000) ~ 8e-5 for 0.125; 5e-4 is 6 of them. Each tenth of
    the range holds a tenth of the draws (binomial sd 0.00067; 0.004 is 6 of them)."""
    lo, hi, n = 0.875, 1.0, 200_000
    t = sample_timesteps(n, torch.Generator().manual_seed(0), kind="uniform", shift=1.0, t_range=(lo, hi)).double()
    assert abs(t.mean().item() - (lo + hi) / 2) < 5e-4
    assert abs(t.var().item() / ((hi - lo) ** 2 / 12) - 1) < 0.02  # relative sd of a variance estimate: ~0.003
    share = torch.histc(t, bins=10, min=lo, max=hi) / n
    assert (share - 0.1).abs().max() < 0.004


@pytest.mark.parametrize("values, words", [
    (dict(timestep_min=-0.1), "timestep_min=-0.1 is out of range: use a number from 0.0 to 1.0"),
    (dict(timestep_max=1.5), "timestep_max=1.5 is out of range: use a number from 0.0 to 1.0"),
    (dict(timestep_min=float("nan")), "timestep_min=nan is out of range"),
    (dict(timestep_min=0.9, timestep_max=0.875), "timestep_max=0.875 is not above timestep_min=0.9: the timestep "
                                                  "range is empty; set timestep_min below timestep_max"),
    (dict(timestep_min=0.5, timestep_max=0.5), "timestep_max=0.5 is not above timestep_min=0.5"),
    (dict(timestep_min=1.0), "timestep_max=1.0 is not above timestep_min=1.0"),
    # a range at or past an end of the clamp every t goes through drew one t, outside the range (a review helper)
    (dict(timestep_min=0.999999), "timestep_min=0.999999 leaves no timesteps to train on: t is always drawn within "
                                  "1e-05 to 0.99999"),
    (dict(timestep_max=1e-6), "timestep_max=1e-06 leaves no timesteps to train on"),
])
def test_bad_ranges_are_refused_naming_the_field_and_the_fix(values, words):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**values)
    assert words in str(e.value)


@pytest.mark.parametrize("kind", ["uniform", "logit_normal"])
@pytest.mark.parametrize("lo, hi", [(0.99998, 1.0), (0.0, 2e-5)])
def test_a_range_next_to_an_end_draws_inside_it(kind, lo, hi):
    """The narrowest ranges TrainConfig takes at either end draw t inside the range, not one constant t."""
    TrainConfig(timestep_min=lo, timestep_max=hi)
    t = sample_timesteps(1000, torch.Generator().manual_seed(0), kind=kind, shift=3.0, t_range=(lo, hi))
    assert bool(((t >= lo) & (t <= hi)).all()) and t.unique().numel() > 1


def test_a_run_in_a_range_trains_as_a_loop_drawing_t_that_way(tmp_path, monkeypatch):
    """A run with timestep_min/max 0.875..1 trains as the full-range run whose every draw is replaced by the plain
    restricted draw (tests/helpers/timestep_range.py; its t within 1e-6 of the runtime's, so losses within 1e-5
    relative over 3 steps); every t the model saw is in the range, and the range changes the run (teeth)."""
    from tightrope.training import micro_batches, trainer
    lo, hi = 0.875, 1.0
    seen, real_prepare, real_sample = [], micro_batches.prepare, micro_batches.sample_timesteps

    def recording(*args, **kwargs):
        inputs = real_prepare(*args, **kwargs)
        seen.append(inputs.t)
        return inputs
    monkeypatch.setattr(trainer, "prepare", recording)
    ranged = train(demo_session(tmp_path, timestep_min=lo, timestep_max=hi), 3, device=CPU)
    assert len(seen) == 3 and all(((lo < t) & (t < hi)).all() for t in seen)
    assert "timesteps: logit_normal, shift 3.16, range 0.875 to 1" in report(ranged, 3).splitlines()

    def reference(n, gen, *, kind, shift, t_range):
        assert t_range == (0.0, 1.0)
        return restricted_draw(n, gen, kind, shift, lo, hi)
    monkeypatch.setattr(micro_batches, "sample_timesteps", reference)
    by_hand = train(demo_session(tmp_path), 3, device=CPU)
    monkeypatch.setattr(micro_batches, "sample_timesteps", real_sample)
    assert ranged.losses == pytest.approx(by_hand.losses, rel=1e-5)
    assert all(torch.allclose(v, by_hand.lora_state[k], rtol=1e-4, atol=1e-7) for k, v in ranged.lora_state.items())
    assert ranged.losses != train(demo_session(tmp_path), 3, device=CPU).losses
    assert ranged.config.timestep_range == (lo, hi)


def test_a_run_at_the_default_range_is_bit_for_bit_a_run_drawing_as_before(tmp_path, monkeypatch):
    """The default 0..1 trains exactly as before ranges existed: the same losses and LoRA (compared exactly) as a run
    whose draws come from the pre-range code (_today's copy of it)."""
    from tightrope.training import micro_batches

    def before(n, gen, *, kind, shift, t_range):
        t = torch.rand(n, generator=gen) if kind == "uniform" else torch.sigmoid(torch.randn(n, generator=gen))
        return (shift * t / (1 + (shift - 1) * t) if shift != 1.0 else t).clamp(1e-5, 1 - 1e-5)
    now = train(demo_session(tmp_path), 3, device=CPU)
    monkeypatch.setattr(micro_batches, "sample_timesteps", before)
    then = train(demo_session(tmp_path), 3, device=CPU)
    assert now.losses == then.losses and all(torch.equal(v, then.lora_state[k]) for k, v in now.lora_state.items())


@pytest.mark.parametrize("lo, hi, shift, median", [(0.9999, 1.0, 1.0, 0.9999071), (0.0, 1e-4, 3.0, 9.357509e-05)])
def test_a_range_in_a_tail_of_the_logit_normal_keeps_its_distribution(lo, hi, shift, median):
    """float64 rounds the CDF 1 - 4e-11 at t = 0.9999 to 1, and torch's ndtr is 0 below z = -8.3 (t = 1e-4 at shift
    3): every draw was one t, the clamp's end of the range. The medians are the exact conditional ones (mpmath, 50
    digits, /work/helpers/review6/ts_tail.py)."""
    t = sample_timesteps(20_000, torch.Generator().manual_seed(0), kind="logit_normal", shift=shift,
                         t_range=(lo, hi))
    assert t.unique().numel() > 100 and lo <= t.min() and t.max() <= hi
    assert t.double().median().item() == pytest.approx(median, abs=0.02 * (hi - lo))  # the sample median: 1e-3
