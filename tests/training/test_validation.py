"""Validation loss: a deterministic held-out split, fixed noise and timesteps (same seed, same curve, bit for bit on
CPU), scored in the training's memory strategy without touching the training trajectory, and resumed exactly."""
import dataclasses

import pytest
import torch
from demo_setup import demo_session
from timestep_range import restricted_draw

from tightrope.memory.strategy import Strategy
from tightrope.training.data.dataset import TrainingDataset
from tightrope.demo.model import demo_encoders
from tightrope.demo.data import make_demo_dataset
from tightrope.training.flow_loss import noised
from tightrope.training.data.image_folder import DatasetError
from tightrope.training.lora.layers import LoraSpec
from tightrope.training.charts import PALETTE
from tightrope.training.state.resume import load_state, resume_session, state_path
from tightrope.training.charts import loss_chart
from tightrope.training.timesteps import sample_timesteps
from tightrope.training.train_config import ConfigError
from tightrope.training.trainer import SaveTarget, train
from tightrope.training.training_run import report
from tightrope.training.validation import _stream_seed, split_for_validation

CPU = torch.device("cpu")
OFFLOADED = Strategy.of(compute_dtype="fp32", offload_fraction=1.0, checkpoint="all", activation_offload=True)


def second_dataset(tmp_path, n=3) -> TrainingDataset:
    folder = make_demo_dataset(tmp_path / "val_images", n_images=n, size=32, seed=1)
    vae, clip = demo_encoders()
    return TrainingDataset(folder, vae, clip, max_pixels=32 * 32, cache_dir=tmp_path / "cache")


def _latent_keys(dataset) -> set[bytes]:
    return {dataset.latent(i).numpy().tobytes() for i in range(dataset.num_images)}


def test_the_split_is_drawn_from_the_seed_disjoint_and_training_never_sees_it(tmp_path):
    session = demo_session(tmp_path, validation_fraction=0.25)
    train_part, held_out = split_for_validation(session)
    assert (train_part.num_images, held_out.num_images) == (6, 2)
    assert _latent_keys(train_part).isdisjoint(_latent_keys(held_out))
    assert _latent_keys(train_part) | _latent_keys(held_out) == _latent_keys(session.dataset)
    again = split_for_validation(session)[1]
    assert _latent_keys(again) == _latent_keys(held_out)  # same seed, same split
    other = split_for_validation(session.advanced(config=dataclasses.replace(session.config, seed=1)))[1]
    assert _latent_keys(other) != _latent_keys(held_out)  # checked once: seed 1 draws another pair
    batches = train_part.batches(2, 0)
    seen = {row.numpy().tobytes() for _ in range(train_part.steps_per_epoch(2) * 3) for row in next(batches)["latents"]}
    assert seen == _latent_keys(train_part)  # three epochs of training batches: every training image, no held-out one


def test_subset_keeps_repeats(tmp_path):
    dataset = demo_session(tmp_path).dataset
    part = dataset.subset([1, 4])
    assert part.num_images == 2 and len(part) == 2 and len(dataset) == 8
    assert torch.equal(part.latent(1), dataset.latent(4)) and part.caption(0) == dataset.caption(1)


def test_same_seed_same_curve_scored_at_first_last_and_every_n(tmp_path):
    session = demo_session(tmp_path, validation_fraction=0.25, validation_every=2)
    a, b = train(session, 5, device=CPU), train(session, 5, device=CPU)
    assert [step for step, _ in a.validation_losses] == [0, 2, 4, 5]
    assert a.validation_losses == b.validation_losses  # bit for bit: floats compared exactly
    assert a.validation_losses[-1][1] < a.validation_losses[0][1]  # the LoRA learned something the held-out set shows


def _plain_losses(session, dataset, t_range=(0.0, 1.0)) -> list[float]:
    """Each image's validation loss at batch 1 in plain torch: its own (seed, 'validation', index) noise and
    timestep (in `t_range`: the plain restricted draw, tests/helpers/timestep_range.py), the base model's MSE,
    weighted by the image's loss mask (over its kept area) where it has one."""
    cfg, losses = session.with_model_shift().config, []  # timestep_shift 0: the demo Flux's own, as trained
    with torch.no_grad():
        for i in range(dataset.num_images):
            latent = dataset.latent(i)[None]
            context, pooled = (x[None] for x in dataset.text(i))
            gen = torch.Generator().manual_seed(_stream_seed(cfg.seed, "validation", i))
            noise = torch.randn(latent.shape[1:], generator=gen)[None]
            kind, shift = cfg.timestep_sampling, cfg.timestep_shift
            t = sample_timesteps(1, gen, kind=kind, shift=shift) if t_range == (0.0, 1.0) else \
                restricted_draw(1, gen, kind, shift, *t_range)
            pred = session.model.predict(session.model.flux, noised(latent, noise, t), t, context, pooled,
                                         cfg.guidance)
            err = (pred - (noise - latent)) ** 2
            mask = dataset.mask(i)
            losses.append((err.mean() if mask is None else (err * mask).sum() / (mask.sum() * err.shape[1])).item())
    return losses


def test_the_first_validation_loss_is_the_plain_torch_loss_with_fixed_noise_and_timesteps(tmp_path):
    """At step 0 the LoRA is the identity (peft's B = 0), so the score is the base model's per-image MSE on the
    held-out images, with each image's noise and timestep drawn from its own (seed, 'validation', index) stream."""
    session = demo_session(tmp_path, validation_fraction=0.25, batch_size=1)
    scored = train(session, 1, device=CPU).validation_losses[0]
    held_out = split_for_validation(session)[1]
    losses = _plain_losses(session, held_out)
    assert scored[0] == 0
    # the same fp32 operations on the same inputs (batch_size=1 both ways); only the order in which the two per-image
    # means are summed (float64 there, Python floats here) may differ, by an ulp or so
    assert scored[1] == pytest.approx(sum(losses) / len(losses), rel=1e-6)


@pytest.mark.parametrize("lo, hi", [(0.875, 1.0), (0.0, 0.875)], ids=["high_noise", "low_noise"])
def test_validation_draws_its_timesteps_in_the_training_range(tmp_path, lo, hi):
    """An expert's LoRA (Wan 2.2 A14B) is scored on the timesteps it trains on: each image's fixed timestep is its
    draw restricted to timestep_min..timestep_max, as training's (the plain reference's t within 1e-6: tolerance
    as above, with room); the full range's score differs (the range is not ignored)."""
    session = demo_session(tmp_path, validation_fraction=0.25, batch_size=1, timestep_min=lo, timestep_max=hi)
    scored = train(session, 1, device=CPU).validation_losses[0][1]
    held_out = split_for_validation(session)[1]
    ranged, full = _plain_losses(session, held_out, (lo, hi)), _plain_losses(session, held_out)
    assert scored == pytest.approx(sum(ranged) / len(ranged), rel=1e-5)
    assert scored != pytest.approx(sum(full) / len(full), rel=1e-3)


def test_validation_does_not_change_the_training_trajectory(tmp_path):
    session = demo_session(tmp_path).advanced(lora=LoraSpec(rank=4, targets="attention_mlp", dropout=0.1))
    plain = train(session, 4, device=CPU)
    validated = train(session.advanced(validation_dataset=second_dataset(tmp_path),
                                       config=dataclasses.replace(session.config, validation_every=1)), 4, device=CPU)
    assert [s for s, _ in validated.validation_losses] == [0, 1, 2, 3, 4] and not plain.validation_losses
    assert validated.losses == plain.losses  # bit for bit: dropout (train mode restored), data, noise untouched
    assert all(torch.equal(validated.lora_state[k], v) for k, v in plain.lora_state.items())


@pytest.mark.parametrize("strategy", [OFFLOADED, Strategy.of(compute_dtype="fp32", offload_fraction=0.5,
                                                             checkpoint="every_n", checkpoint_every=2)],
                         ids=["offload_all_checkpoint_all_activation_offload", "offload_half_checkpoint_every_2"])
def test_validation_runs_in_the_memory_strategy(tmp_path, strategy):
    """No-grad forwards through offloaded blocks (unloaded weights are NaN placeholders, so a block used unloaded
    would make the score NaN), with checkpointing and activation offload applied, between training steps."""
    cfg = dict(validation_fraction=0.25)
    plain = train(demo_session(tmp_path, validation_every=1, **cfg), 3, device=CPU)
    managed = train(demo_session(tmp_path, strategy=strategy, validation_every=1, **cfg), 3, device=CPU)
    unvalidated = train(demo_session(tmp_path, strategy=strategy, validation_every=100, **cfg), 3, device=CPU)
    assert [s for s, _ in unvalidated.validation_losses] == [0, 3]
    assert managed.losses == unvalidated.losses  # scoring between steps leaves the runtime as the step left it
    # a scoring pass is a step of its own: a training step after one streams what a cold first step does (the pass
    # left the last blocks in the slots, not the first ones), never the scoring pass's own transfers on top
    assert [s["h2d_bytes"] for s in managed.stats] == [unvalidated.stats[0]["h2d_bytes"]] * 3
    # as test_trainer's strategy-vs-plain check: the LoRA trained under offload drifts from the plain one by fp32
    # rounding in a different operation order, and the scores with it
    torch.testing.assert_close(torch.tensor([v for _, v in managed.validation_losses]),
                               torch.tensor([v for _, v in plain.validation_losses]), rtol=1e-5, atol=1e-6)


def test_a_continued_session_does_not_score_its_first_step_again(tmp_path):
    session = demo_session(tmp_path, validation_fraction=0.25, validation_every=3)
    whole = train(session, 4, device=CPU)
    halves = train(train(session, 2, device=CPU), 2, device=CPU)
    assert [s for s, _ in whole.validation_losses] == [0, 3, 4]
    assert [s for s, _ in halves.validation_losses] == [0, 2, 3, 4]  # 2: the first node run's last step
    scores = dict(halves.validation_losses)
    assert all(scores[s] == v for s, v in whole.validation_losses)  # continuation is exact, so are the scores


def _ctrl_c_at(step):
    def progress(done, total, loss):
        if done == step:
            raise KeyboardInterrupt
    return progress


def test_resume_restores_the_validation_history_exactly(tmp_path):
    """Stopped after step 4, before its validation: the state file lacks that score and the resumed run makes it."""
    session = demo_session(tmp_path, validation_fraction=0.25, validation_every=2)
    whole = train(session, 6, device=CPU)
    save = SaveTarget(tmp_path / "out", "run")
    with pytest.raises(KeyboardInterrupt):
        train(session, 6, device=CPU, save=save, progress=_ctrl_c_at(4))
    path = state_path(save.folder, save.filename_prefix)
    assert load_state(path).info["validation"] == [[0, whole.validation_losses[0][1]],
                                                      [2, whole.validation_losses[1][1]]]
    resumed, state = resume_session(path, session)
    assert resumed.validation_losses == whole.validation_losses[:2]
    done = train(resumed, 2, device=CPU, run_start=state.run_start)
    assert done.losses == whole.losses and done.validation_losses == whole.validation_losses


def test_the_report_and_the_loss_plot_show_the_validation_loss(tmp_path):
    session = train(demo_session(tmp_path, validation_fraction=0.25, validation_every=1), 2, device=CPU)
    (s0, v0), _, (s2, v2) = session.validation_losses
    best = min(session.validation_losses, key=lambda p: p[1])
    assert f"validation loss: step 0 {v0:.4f}, step 2 {v2:.4f} (best {best[1]:.4f} at step {best[0]}, 3 evaluations)" \
        in report(session, 2)
    validation_colour = tuple(int(PALETTE[2][k:k + 2], 16) for k in (1, 3, 5))  # the third series' colour
    colours = {c for _, c in loss_chart(session).getcolors(1 << 16)}
    assert validation_colour in colours
    without = loss_chart(session.advanced(validation_losses=()))
    assert validation_colour not in {c for _, c in without.getcolors(1 << 16)}
    assert "validation" not in report(session.advanced(validation_losses=()), 2)


@pytest.mark.parametrize("config, error, words", [
    (dict(validation_fraction=0.05), DatasetError, "validation_fraction=0.05 of 8 images holds out 0 images: raise it "
                                                   "to at least 0.125"),
    (dict(validation_fraction=1.0), ConfigError, r"validation_fraction=1.0 is out of range: hold out a fraction above "
                                                 "0 and below 1"),
    (dict(validation_fraction=-0.1), ConfigError, "validation_fraction=-0.1 is out of range"),
    (dict(validation_every=0), ConfigError, r"validation_every=0 is invalid: use a whole number >= 1"),
], ids=["holds_out_nothing", "fraction_1", "fraction_negative", "every_0"])
def test_bad_validation_settings_fail_before_training(tmp_path, config, error, words):
    with pytest.raises(error, match=words):
        train(demo_session(tmp_path, **config), 1, device=CPU)


def test_a_fraction_and_a_second_dataset_are_refused_together(tmp_path):
    session = demo_session(tmp_path, validation_fraction=0.25).advanced(validation_dataset=second_dataset(tmp_path))
    with pytest.raises(ConfigError, match="validation_fraction=0.25 and a validation_dataset are both given"):
        train(session, 1, device=CPU)


def test_a_schedule_free_run_scores_the_weights_it_saves(tmp_path, monkeypatch):
    """Schedule-free AdamW trains at y but saves its average x: validation scores x, like a save, and training goes
    on from y exactly (the trajectory equals a run without validation)."""
    pytest.importorskip("schedulefree", reason="schedulefree is not installed (optional): nothing to check")
    from tightrope.training import validation as validation_module
    from tightrope.training.lora.layers import lora_state
    seen = []
    real_loss = validation_module.Validation.loss

    def spying_loss(self, adapter, module, runtime):
        seen.append({k: v.clone() for k, v in lora_state(module).items()})
        return real_loss(self, adapter, module, runtime)

    monkeypatch.setattr(validation_module.Validation, "loss", spying_loss)
    session = demo_session(tmp_path, optimizer="adamw_schedulefree", learning_rate=1e-2, validation_every=3)
    plain = train(session, 3, device=CPU)
    validated = train(session.advanced(validation_dataset=second_dataset(tmp_path)), 3, device=CPU)
    assert [s for s, _ in validated.validation_losses] == [0, 3]
    saved = validated.lora_state  # the session's LoRA: x, what a save writes
    assert all(torch.equal(seen[-1][k], v) for k, v in saved.items())
    # the train weights y travel in the optimizer state; they differ from x, so scoring y would have failed above
    y = [entry["tightrope_train_weights"] for entry in validated.optimizer_state["state"].values()]
    assert y and any(not any(torch.equal(t, v) for v in saved.values()) for t in y)
    assert validated.losses == plain.losses  # scoring x left the training at y untouched


def _ragged_or_masked(dataset: TrainingDataset, ragged: bool, masked: bool) -> TrainingDataset:
    """The demo images with captions cut to 2 token counts (an encoder that does not pad: Lumina 2, Qwen-Image), each
    in both latent buckets, optionally with a loss mask that keeps a different area of each image."""
    n = dataset.num_images
    contexts = [dataset.text(i)[0][: dataset.text(i)[0].shape[0] - (i % 2) * 3 * ragged] for i in range(n)]
    ds = TrainingDataset.from_tensors([dataset.latent(i) for i in range(n)], contexts,
                                      [dataset.text(i)[1] for i in range(n)])
    if masked:
        for i, sample in enumerate(ds._samples):
            mask = torch.zeros(1, *sample.shape[1:])
            mask[..., : 2 + i, :] = 1
            sample.mask = mask
    return ds


@pytest.mark.parametrize("ragged,masked", [(True, False), (False, True)], ids=["ragged", "masks"])
def test_validation_batches_captions_of_one_length_and_weights_by_the_loss_mask(tmp_path, ragged, masked):
    """Batched by latent shape alone, two captions of different lengths were stacked (a RuntimeError at the first
    score); and the score ignored the loss masks training uses. Reference: the same per-image loss at batch 1, where
    masks weigh each image's squared errors by its own kept area, computed here in plain torch."""
    session = demo_session(tmp_path, batch_size=2)
    val = _ragged_or_masked(session.dataset, ragged, masked)
    batched = train(session.advanced(validation_dataset=val), 1, device=CPU).validation_losses[0][1]
    losses = _plain_losses(session, val)
    # batches of 2 against single images: the same fp32 math, matmuls of other shapes (a few ulps per element)
    assert batched == pytest.approx(sum(losses) / len(losses), rel=1e-5)


def test_setting_up_validation_reads_no_latent_file(tmp_path, monkeypatch):
    """The held-out images are batched by shape: read from what the dataset knows, not by loading each cached latent
    (a file read and a finite check per image before the first step)."""
    from tightrope.training import validation
    from tightrope.training.data import dataset as dataset_module
    held_out = second_dataset(tmp_path, n=4)
    reads, real = [], dataset_module._load_cached
    monkeypatch.setattr(dataset_module, "_load_cached", lambda path: reads.append(path) or real(path))
    config = demo_session(tmp_path).config
    batches = validation.Validation(held_out, config, run_start=0, run_end=2).batches
    assert sorted(i for batch in batches for i in batch) == list(range(4)) and reads == []
