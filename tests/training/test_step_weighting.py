"""What one optimizer step averages: grad_accumulation micro-batches of unequal size train like one batch of all
their images (every image weighs the same), and the EMA of a schedule-free run averages the weights it saves (x)."""
import gc
import weakref

import pytest
import torch
from demo_setup import demo_session

from tightrope.memory.ema import ema_weights
from tightrope.demo.data import make_demo_dataset
from tightrope.demo.model import demo_encoders
from tightrope.training import distributed, micro_batches, trainer
from tightrope.training.data.batching import PlannedBatch
from tightrope.training.data.dataset import TrainingDataset
from tightrope.training.flow_loss import flow_matching_loss
from tightrope.training.lora.files import lora_file_tensors, read_lora_file
from tightrope.training.lora.layers import inject_lora, load_lora_state, lora_parameters, remove_lora
from tightrope.training.schedule_free import TRAIN_WEIGHTS
from tightrope.training.trainer import SaveTarget, train

CPU = torch.device("cpu")


def _three_images(tmp_path, **config):
    """3 images in one bucket, batch_size 2: an epoch is a batch of 2 and a batch of 1, so with grad_accumulation=2
    each step holds one micro-batch of 2 images and one of 1 (in the epoch's order)."""
    session = demo_session(tmp_path, batch_size=2, grad_accumulation=2, **config)
    vae, clip = demo_encoders()
    folder = make_demo_dataset(tmp_path / "three", n_images=3, size=32, seed=0)
    return session.advanced(dataset=TrainingDataset(folder, vae, clip, max_pixels=32 * 32,
                                                    cache_dir=tmp_path / "three_cache"))


def test_a_short_micro_batch_weighs_its_images_like_one_batch_of_all_of_them(tmp_path, monkeypatch):
    """Reference: plain PyTorch, the step's 3 images (with the noise and timesteps the trainer drew for them) as one
    batch through the model with the same LoRA, loss = their mean. Dividing each micro-batch's mean by
    grad_accumulation gave the lone image twice the others' weight: every LoRA tensor's gradient moved by 24 % to
    58 % of its largest element, the loss by 5e-3. The fixed step computes the same terms grouped otherwise (fp32
    kernels over 3 rows vs 2 + 1, the two micro-batches summed into .grad), so only rounding differs: about
    n * 2^-24 of a reduction's terms, which cancellation can make large next to a small element, so each tensor is
    checked against its largest gradient, to 1e-4 of it as tests/distributed/test_torchrun.py argues for the same
    regrouping (measured 1.8e-6), 2000 times below the bug. The loss, an fp32 mean of O(1) terms: 1e-6 relative
    (measured 8e-8)."""
    session = _three_images(tmp_path)
    start = train(session, 1, device=CPU)  # lora_B is no longer zero, so every LoRA tensor gets a gradient
    model = session.model
    real_predict, real_loss, real_update = model.predict, trainer.flow_matching_loss, trainer._update
    inputs, targets, grads = [], [], {}

    def predict(module, x_t, t, context, pooled, guidance, to_device=None):
        inputs.append((x_t.detach().clone(), t.clone(), context.clone(), pooled.clone(), guidance))
        return real_predict(module, x_t, t, context, pooled, guidance, to_device)

    def loss(pred, latents, noise, **kw):
        targets.append((latents.clone(), noise.clone(), kw))
        return real_loss(pred, latents, noise, **kw)

    def update(cfg, run, optimizer, params, scaler, step_loss):
        grads.update({k: p.grad.clone() for k, p in params.items()})
        return real_update(cfg, run, optimizer, params, scaler, step_loss)

    monkeypatch.setattr(model, "predict", predict, raising=False)
    monkeypatch.setattr(trainer, "flow_matching_loss", loss)
    monkeypatch.setattr(trainer, "_update", update)
    result = train(start, 1, device=CPU)
    monkeypatch.undo()
    assert sorted(x[0].shape[0] for x in inputs) == [1, 2]  # the ragged step this test is about
    latents = torch.cat([latent for latent, _, _ in targets])
    assert len({tuple(row.flatten()[:8].tolist()) for row in latents}) == 3  # three different images

    flux = model.flux  # the reference: the same module, the LoRA of `start`, one batch of the 3 images
    inject_lora(flux, session.lora, model.family)
    try:
        load_lora_state(flux, start.lora_state)
        params = lora_parameters(flux)
        x_t, t, context, pooled = (torch.cat([x[i] for x in inputs]) for i in range(4))
        with torch.enable_grad():
            pred = model.predict(flux, x_t, t, context, pooled, inputs[0][4])
            reference = flow_matching_loss(pred, latents, torch.cat([n for _, n, _ in targets]), **targets[0][2])
            reference.backward()
        expected = {k: p.grad.clone() for k, p in params.items()}
    finally:
        remove_lora(flux)
    assert result.losses[-1] == pytest.approx(reference.item(), rel=1e-6)
    assert expected.keys() == grads.keys()
    for k, g in expected.items():
        assert g.abs().max() > 0, k
        torch.testing.assert_close(grads[k], g, rtol=0, atol=1e-4 * g.abs().max().item(), msg=lambda m: f"{k}: {m}")


def test_each_micro_batch_weighs_its_share_of_the_steps_global_batches():
    """The shares are of the global batches (batch["shard"][2]), the same on every rank: each rank then weights its
    part by its share of its global batch (this_rank_part), so the parts of every micro-batch add up to the one
    process's share, whatever the world size, empty parts included (global batches of 4 and 1 over 3 ranks)."""
    def micro_batch(n, shard=None):
        batch = {"latents": torch.zeros(n if shard is None else max(shard[1] - shard[0], 1), 1)}
        return PlannedBatch(n, lambda: batch if shard is None else batch | {"shard": shard})

    whole = micro_batches.step_batches(iter([micro_batch(4), micro_batch(1)]), 2)
    assert [share for _, share in whole] == [0.8, 0.2]
    for world in (1, 2, 3):
        per_micro = [0.0, 0.0]
        for rank in range(world):
            parts = [micro_batch(n, (*distributed.shard_bounds(n, rank, world), n)) for n in (4, 1)]
            for k, (planned, share) in enumerate(micro_batches.step_batches(iter(parts), 2)):
                per_micro[k] += distributed.this_rank_part(planned.load())[1] * share
        assert per_micro == pytest.approx([0.8, 0.2], rel=1e-12), world


def test_a_ragged_accumulation_run_continues_exactly(tmp_path):
    """Each step pulls its micro-batches from the iterator a continued run starts at its step: one call of 3 steps
    and calls of 1 + 2 steps see the same images, noise and weights, bit for bit."""
    session = _three_images(tmp_path)
    whole = train(session, 3, device=CPU)
    halves = train(train(session, 1, device=CPU), 2, device=CPU)
    assert halves.losses == whole.losses
    assert all(torch.equal(v, halves.lora_state[k]) for k, v in whole.lora_state.items())


def test_a_schedule_free_runs_ema_averages_the_weights_it_saves(tmp_path):
    """Schedule-free trains at y and saves x (eval_weights): the EMA must average x. With decay 1e-9 (fp32: the lerp
    weight 1 - 1e-9 rounds to 1, so the EMA becomes the weights exactly) it equals the x of the LoRA file saved at
    the last step, bit for bit; averaging y left it 0.00036 away, a quarter of the weights' mean size. Reading x
    changes nothing in training: the run with the EMA has the losses and weights of the run without."""
    schedule_free = dict(optimizer="adamw_schedulefree", learning_rate=1e-3)
    pytest.importorskip("schedulefree")
    out = tmp_path / "out"
    result = train(demo_session(tmp_path, ema_decay=1e-9, **schedule_free), 5, device=CPU,
                   save=SaveTarget(out, "sf", every=5))
    plain = train(demo_session(tmp_path, **schedule_free), 5, device=CPU)
    saved, _ = read_lora_file(result.saved[-1])
    assert saved.keys() == lora_file_tensors(ema_weights(result.ema_state), result.lora).keys()
    assert all(torch.equal(saved[k], v) for k, v in lora_file_tensors(ema_weights(result.ema_state), result.lora).items())
    assert all(torch.equal(result.ema_state[k], v) for k, v in result.lora_state.items())
    train_weights = [s[TRAIN_WEIGHTS] for _, s in sorted(result.optimizer_state["state"].items())]
    assert any(not torch.equal(y, result.lora_state[k]) for y, k in zip(train_weights, result.lora_state))
    assert result.losses == plain.losses
    assert all(torch.equal(v, plain.lora_state[k]) for k, v in result.lora_state.items())


def test_a_step_reads_its_micro_batches_at_most_one_ahead(tmp_path, monkeypatch):
    """A step with grad_accumulation=3 knows its micro-batches' sizes (their shares) before reading any, and host
    memory holds at most two micro-batches made ready (the one training and the next, read ahead on a worker) and at
    most one read and not yet made ready: when a micro-step starts, the earlier micro-steps' batches are freed (host
    RAM: a step is not grad_accumulation batches of latents and text embeddings). Bounds, as the worker's progress
    at that moment depends on timing."""
    session = demo_session(tmp_path, grad_accumulation=3)
    loaded, ready, live_at_micro_step = [], [], []
    collate, real_prepare = TrainingDataset._collate, micro_batches.prepare

    def reading(self, batch):
        stacked = collate(self, batch)
        loaded.append(weakref.ref(stacked["latents"]))
        return stacked

    def prepare(*args, **kwargs):
        inputs = real_prepare(*args, **kwargs)
        ready.append(weakref.ref(inputs))
        return inputs

    def micro_step(parts, inputs, *args, **kwargs):
        gc.collect()
        live_at_micro_step.append((sum(ref() is not None for ref in loaded), sum(ref() is not None for ref in ready)))
        return real_micro_step(parts, inputs, *args, **kwargs)
    real_micro_step = trainer._micro_step
    monkeypatch.setattr(TrainingDataset, "_collate", reading)
    monkeypatch.setattr(micro_batches, "prepare", prepare)
    monkeypatch.setattr(trainer, "prepare", prepare)
    monkeypatch.setattr(trainer, "_micro_step", micro_step)
    train(session, 2, device=torch.device("cpu"))
    assert len(live_at_micro_step) == 6 and len(loaded) == len(ready) == 6  # nothing read beyond the run
    assert all(n_loaded <= 1 and 1 <= n_ready <= 2 for n_loaded, n_ready in live_at_micro_step), live_at_micro_step
    gc.collect()
    assert not any(ref() for ref in loaded + ready)  # nothing kept after the run


def test_the_next_micro_batch_is_read_while_the_current_one_trains(tmp_path, monkeypatch):
    """The first micro-step of a step waits (inside its forward's turn) until the second micro-batch's read has begun:
    read ahead, it has; read in turn (after the first micro-step), it never would (the wait times out)."""
    import threading
    session = demo_session(tmp_path, grad_accumulation=2)
    second_read, calls, reads = threading.Event(), [], []
    collate = TrainingDataset._collate

    def reading(self, batch):
        reads.append(threading.current_thread().name)
        if len(reads) == 2:
            second_read.set()
        return collate(self, batch)

    def micro_step(parts, inputs, *args, **kwargs):
        calls.append(second_read.wait(timeout=60))
        return real_micro_step(parts, inputs, *args, **kwargs)
    real_micro_step = trainer._micro_step
    monkeypatch.setattr(TrainingDataset, "_collate", reading)
    monkeypatch.setattr(trainer, "_micro_step", micro_step)
    result = train(session, 1, device=torch.device("cpu"))
    assert calls == [True, True] and len(result.losses) == 1
    assert all(name.startswith("tightrope-batches") for name in reads)  # read on the worker, not the training thread


def test_a_micro_batch_that_fails_to_read_fails_in_its_turn(tmp_path):
    """Read (or planned) ahead, a micro-batch's error is raised when it is taken, after the one before it trained,
    and one read ahead for a step that never runs is dropped with its error."""
    def planned(n, fail=False):
        def load():
            if fail:
                raise OSError(f"cache file of batch {n} unreadable")
            return {"n": n}
        return PlannedBatch(1, load)

    made = []
    plans = iter([planned(0), planned(1), planned(2, fail=True)])
    batches = micro_batches.MicroBatches(plans, 1, 0, 3, lambda batch, *_: made.append(batch) or batch)
    try:
        assert batches.take(0, 0) == {"n": 0} and batches.take(1, 0) == {"n": 1}
        with pytest.raises(OSError, match="cache file of batch 2 unreadable"):
            batches.take(2, 0)
    finally:
        batches.close()
    assert made == [{"n": 0}, {"n": 1}]
    ahead = micro_batches.MicroBatches(iter([planned(0), planned(1, fail=True)]), 1, 0, 2, lambda b, *a: b)
    try:
        assert ahead.take(0, 0) == {"n": 0}  # the next one, read ahead, failed: not this one's error
    finally:
        ahead.close()  # its turn never came: dropped
    def broken_order():
        yield from (planned(0), planned(1))
        raise RuntimeError("the dataset's order broke")

    planning = micro_batches.MicroBatches(broken_order(), 1, 0, 5, lambda b, *a: b)
    try:
        assert planning.take(0, 0) == {"n": 0} and planning.take(1, 0) == {"n": 1}  # step 2 planned (and failed)
        with pytest.raises(RuntimeError, match="the dataset's order broke"):
            planning.take(2, 0)  # in its own turn
    finally:
        planning.close()
